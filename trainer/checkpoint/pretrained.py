"""`nnui-train ... -pretrained_weights FILE.safetensors`: start a training from the tensors
of another training (nnU-Net's `-pretrained_weights`, e.g. after pre-training on a larger
dataset).

Two kinds of file are accepted: an nnui checkpoint (`checkpoint_*.safetensors`: its
`model.*` tensors, every byte checked as for --c) and a plain safetensors state dict (names
as in `model.state_dict()`; a `module.` or `_orig_mod.` prefix of a DDP or compiled model
is dropped). Every tensor whose name and shape match the new network is loaded; the rest
keep their fresh initialisation, e.g. the segmentation heads when the label count differs.
Only weights: optimizer, schedule and epoch start fresh. Pickles (.pth) are refused: loading
one can run any code it holds.

The CLI (rank 0's process) checks the file against a network built on the meta device
(shapes, no memory); the worker's rank 0 loads it and every rank gets the same tensors
(trainer.training.worker), before the DDP wrap.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.format import META_KEY, CheckpointError

_PICKLE_SUFFIXES = (".pth", ".pt", ".pkl", ".ckpt", ".model")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_MAX_NAMES_SHOWN = 6


class PretrainedError(ValueError):
    """A -pretrained_weights file nnui will not load (one line; the CLI exits 2)."""


def _refuse_pickles(path: Path) -> None:
    why = (
        "nnui reads safetensors only: a .pth/.pt file is a pickle, and loading a pickle runs "
        "whatever code it holds; convert it once where you trust it "
        "(safetensors.torch.save_file(state_dict, 'weights.safetensors'))"
    )
    if path.name.lower().endswith(_PICKLE_SUFFIXES):
        raise PretrainedError(f"-pretrained_weights {path.name}: {why}")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic.startswith(b"PK\x03\x04") or magic[:1] == b"\x80":  # torch.save zip / pickle
        raise PretrainedError(f"-pretrained_weights {path.name} is a pickle (torch.save): {why}")


def _header(path: Path) -> dict[str, Any]:
    """The safetensors header (tensor table and metadata); PretrainedError if it is none."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise PretrainedError(f"-pretrained_weights {path.name} is not a safetensors file")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            header = None
    if not isinstance(header, dict):
        raise PretrainedError(f"-pretrained_weights {path.name} is not a safetensors file")
    return header


def _check_plain_file(path: Path, header: dict[str, Any]) -> None:
    """A plain safetensors file: a well-formed tensor table that fills the file exactly."""
    from trainer.checkpoint.format import check_tensor_table

    table = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        data_bytes = check_tensor_table(path.name, table)
    except CheckpointError as error:
        raise PretrainedError(f"-pretrained_weights {error}") from None
    with open(path, "rb") as handle:
        header_bytes = struct.unpack("<Q", handle.read(8))[0]
    if 8 + header_bytes + data_bytes != path.stat().st_size:
        raise PretrainedError(f"-pretrained_weights {path.name}: truncated or extended file")


def _is_nnui_checkpoint(header: dict[str, Any]) -> bool:
    metadata = header.get("__metadata__")
    return isinstance(metadata, dict) and META_KEY in metadata


def _state_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """State-dict name -> shape of the file's weights (header only for a state dict; an nnui
    checkpoint is verified byte for byte). PretrainedError for anything else."""
    path = Path(path)
    if not path.is_file():
        raise PretrainedError(f"-pretrained_weights {path}: no such file")
    _refuse_pickles(path)
    header = _header(path)
    if _is_nnui_checkpoint(header):
        from trainer.checkpoint import store

        try:
            store.read_metadata(path)
        except CheckpointError as error:
            raise PretrainedError(f"-pretrained_weights: {error}") from None
        tensors = {k[len("model.") :]: v for k, v in header.items() if k.startswith("model.")}
    else:
        tensors = {_state_name(k): v for k, v in header.items() if k != "__metadata__"}
        _check_plain_file(path, header)
    try:
        return {name: tuple(int(n) for n in entry["shape"]) for name, entry in tensors.items()}
    except (TypeError, KeyError, ValueError):
        raise PretrainedError(f"-pretrained_weights {path.name}: malformed tensor table") from None


@dataclass(frozen=True)
class Match:
    loaded: list[str]  # name and shape match
    wrong_shape: list[str]  # in both, another shape (e.g. heads of another label count)
    missing: list[str]  # in the network, not in the file: fresh initialisation
    unused: list[str]  # in the file, not in the network

    def report(self, path: Path) -> str:
        """One log line."""
        total = len(self.loaded) + len(self.wrong_shape) + len(self.missing)
        line = f"pretrained weights {Path(path).name}: loaded {len(self.loaded)} of {total} tensors"
        for what, names in (
            ("skipped (shape differs)", self.wrong_shape),
            ("not in the file (fresh)", self.missing),
            ("unused from the file", self.unused),
        ):
            if names:
                shown = ", ".join(names[:_MAX_NAMES_SHOWN])
                hidden = len(names) - _MAX_NAMES_SHOWN
                line += f"; {what}: {shown}" + (f" and {hidden} more" if hidden > 0 else "")
        return line


def match(stored: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> Match:
    return Match(
        loaded=[n for n in wanted if n in stored and stored[n] == wanted[n]],
        wrong_shape=[n for n in wanted if n in stored and stored[n] != wanted[n]],
        missing=[n for n in wanted if n not in stored],
        unused=[n for n in stored if n not in wanted],
    )


def network_shapes(plans: Any, cplan: Any) -> dict[str, tuple[int, ...]]:
    """State-dict shapes of this configuration's network, built on the meta device."""
    import torch

    from trainer.data.cascade import input_channels
    from trainer.network.build import build_network

    with torch.device("meta"):  # a cascade's input: the image and the previous stage's one-hot
        net = build_network(cplan.network, input_channels(plans, cplan), plans.num_classes,
                            cplan.ndim)  # fmt: skip
    return {name: tuple(t.shape) for name, t in net.state_dict().items()}


def check_pretrained_file(path: Path, plans: Any, cplan: Any) -> Match:
    """The CLI's check: a readable safetensors file sharing at least one tensor."""
    found = match(stored_shapes(path), network_shapes(plans, cplan))
    if not found.loaded:
        raise PretrainedError(
            f"-pretrained_weights {Path(path).name} shares no tensor (name and shape) with the "
            f"{cplan.name} network of these plans"
        )
    return found


def load_matching(path: Path, model: Any) -> tuple[dict[str, Any], str]:
    """(tensors to load into `model`, the log line). Rank 0 only; PretrainedError."""
    path = Path(path)
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    found = match(stored_shapes(path), wanted)
    if not found.loaded:
        raise PretrainedError(f"-pretrained_weights {path.name} shares no tensor with the network")
    if _is_nnui_checkpoint(_header(path)):
        from trainer.checkpoint import store

        tensors, _ = store.load(path)
        weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    else:
        from trainer.checkpoint import store

        try:
            weights = {_state_name(k): v for k, v in store.load_plain(path).items()}
        except CheckpointError as error:
            raise PretrainedError(f"-pretrained_weights {error}") from None
    keep = {k: v.contiguous() for k, v in weights.items() if k in set(found.loaded)}
    for name, tensor in keep.items():  # a NaN weight would only poison the training later
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise PretrainedError(f"-pretrained_weights {path.name}: {name} holds NaN or inf")
    return keep, found.report(path)
