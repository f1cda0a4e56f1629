"""Checkpoints as single safetensors files (the only safetensors user in nnui).

One file holds model weights (`model.*`), optimizer tensors (`optim.*`), the CPU/CUDA RNG
states (`rng.*`) and a JSON metadata block under the key `nnui` (epoch to run next,
history, best EMA, optimizer skeleton, scaler state, resolved config, identity) with a
sha256 of every tensor's bytes and of the metadata itself (trainer.checkpoint.format).
Loading never unpickles and trusts nothing: a file that fails any check is skipped with a
one-line warning and the next valid one is used. Writes are atomic (tmp + fsync +
os.replace); a failed write removes its partial file and leaves the older ones in place.

Selecting a checkpoint to resume (`find_resume`) uses the standard library only, so the CLI
can refuse a mismatching checkpoint before importing torch; the worker's `load_resume`
repeats the choice with the torch-side checks (finite values, RNG states, shapes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from trainer.checkpoint.atomic import write_atomically
from trainer.checkpoint.fit import check_resumable
from trainer.checkpoint.format import (
    FORMAT,
    META_KEY,
    META_SHA_KEY,
    TENSOR_SHA_KEY,
    CheckpointError,
    Header,
    expected_digests,
    file_reader,
    parse_header,
    regular_file_size,
    verify_file,
    warn_unchecked,
)
from trainer.schema.tree import checkpoint_file

log = logging.getLogger(__name__)

# Resume preference when stored epochs tie: final, then latest, then best.
RESUME_ORDER = ("final", "latest", "best")


class IdentityMismatch(ValueError):
    """A valid checkpoint from another dataset, configuration, fold or plans."""


class BeyondSchedule(ValueError):
    """The newest valid checkpoint is further than this run's --epochs: continuing it would
    overwrite a longer training, so it is refused rather than skipped."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    kind: str
    epoch_next: int
    metadata: dict[str, Any]


# ---- checks and selection (stdlib only) ---------------------------------------------------


def read_metadata(path: Path) -> dict[str, Any]:
    """The JSON metadata of a checkpoint, after checking every byte of it (CheckpointError)."""
    return verify_file(Path(path)).metadata


def read_header(path: Path) -> Header:
    """Header and metadata only (cheap): enough to order the candidates."""
    path = Path(path)
    size = regular_file_size(path)
    try:
        with open(path, "rb") as handle:
            return parse_header(path.name, size, file_reader(handle, path.name))
    except OSError as error:
        raise CheckpointError(f"{path.name}: {error.strerror or error}") from error


def _stored_identity(metadata: dict[str, Any], key: str) -> Any:
    """A key of the stored identity; checkpoints written before a key joined the identity
    (e.g. fold) still record it in their config."""
    stored = metadata.get("identity")
    if not isinstance(stored, dict):
        return None
    if key in stored:
        return stored[key]
    config = metadata.get("config")
    return config.get(key) if isinstance(config, dict) else None


def identity_mismatch(metadata: dict[str, Any], expected: dict[str, str]) -> tuple[str, Any] | None:
    """The first identity key whose stored value differs from `expected`, with the stored
    value; None when the checkpoint is this run's. The one identity comparison: resume,
    --val and nnui-predict all use it, each with its own wording."""
    for key, value in expected.items():
        stored = _stored_identity(metadata, key)
        if stored != value:
            return key, stored
    return None


def check_identity(info: CheckpointInfo, expected: dict[str, str]) -> None:
    mismatch = identity_mismatch(info.metadata, expected)
    if mismatch is not None:
        key, stored = mismatch
        shown = repr(stored[:80] if isinstance(stored, str) else stored)[:80]
        raise IdentityMismatch(
            f"{info.path} belongs to {key}={shown}, this run has {expected[key]!r}; "
            "use another results folder or remove the checkpoint"
        )


def check_schedule(info: CheckpointInfo, num_epochs: int) -> None:
    if info.epoch_next > num_epochs:
        raise BeyondSchedule(
            f"{info.path.name} has trained {info.epoch_next} epochs, beyond --epochs "
            f"{num_epochs}; pass --epochs {info.epoch_next} or more to continue it, or use "
            "another results folder"
        )


_skips_told: set[tuple[str, str]] = set()


def _warn_skipped(path: Path, error: CheckpointError) -> None:
    """One line per refused file and reason, also when the CLI and then the worker (the
    same process, without a launcher) each look at the run folder."""
    if (str(path), str(error)) not in _skips_told:
        _skips_told.add((str(path), str(error)))
        log.warning("skipping invalid checkpoint %s", error)


def _candidates(run_dir: Path) -> list[CheckpointInfo]:
    """Checkpoints whose header is sound, newest stored epoch first (RESUME_ORDER on ties)."""
    found = []
    for kind in RESUME_ORDER:
        path = Path(run_dir) / checkpoint_file(kind)
        if not os.path.lexists(path):
            continue
        try:
            metadata = read_header(path).metadata
        except CheckpointError as error:
            _warn_skipped(path, error)
            continue
        found.append(CheckpointInfo(path, kind, metadata["epoch_next"], metadata))
    return sorted(found, key=lambda info: -info.epoch_next)  # stable: ties keep RESUME_ORDER


def _first_valid(
    run_dir: Path,
    expected_identity: dict[str, str] | None,
    num_epochs: int | None,
    check: Callable[[CheckpointInfo], tuple[CheckpointInfo, Any]],
) -> tuple[CheckpointInfo, Any] | None:
    """The newest candidate that passes `check`; the others are skipped with a warning.

    The newest valid one decides: another identity or a longer schedule is refused
    (IdentityMismatch / BeyondSchedule), never silently replaced by an older file.
    """
    for candidate in _candidates(run_dir):
        try:
            info, payload = check(candidate)
        except CheckpointError as error:
            _warn_skipped(candidate.path, error)
            continue
        if expected_identity is not None:
            check_identity(info, expected_identity)
        if num_epochs is not None:
            check_schedule(info, num_epochs)
        return info, payload
    return None


def find_resume(
    run_dir: Path, expected_identity: dict[str, str] | None = None, num_epochs: int | None = None
) -> CheckpointInfo | None:
    """Newest valid checkpoint (every byte checked); invalid files are skipped with a warning.

    Raises IdentityMismatch / BeyondSchedule when it belongs to another run.
    """

    def check(info: CheckpointInfo) -> tuple[CheckpointInfo, None]:
        metadata = read_metadata(info.path)
        return CheckpointInfo(info.path, info.kind, metadata["epoch_next"], metadata), None

    found = _first_valid(Path(run_dir), expected_identity, num_epochs, check)
    return found[0] if found else None


# ---- save / load (torch) ------------------------------------------------------------------


def _flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Optimizer state -> (tensors with string keys, JSON skeleton)."""
    tensors: dict[str, Any] = {}
    skeleton_state: dict[str, dict[str, Any]] = {}
    for param_id, entry in state_dict["state"].items():
        fields: dict[str, Any] = {}
        for name, value in entry.items():
            if hasattr(value, "detach"):
                key = f"optim.state.{param_id}.{name}"
                tensors[key] = value.detach().contiguous().clone()
                fields[name] = {"tensor": key}
            else:
                fields[name] = {"value": value}
        skeleton_state[str(param_id)] = fields
    return tensors, {"state": skeleton_state, "param_groups": state_dict["param_groups"]}


def _unflatten_optimizer(skeleton: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    state = {}
    for param_id, fields in skeleton["state"].items():
        state[int(param_id)] = {
            name: tensors[spec["tensor"]] if "tensor" in spec else spec["value"]
            for name, spec in fields.items()
        }
    return {"state": state, "param_groups": skeleton["param_groups"]}


def capture_rng() -> tuple[dict[str, Any], dict[str, Any]]:
    """RNG states as (tensors, JSON); Python/numpy too, in case augmentation uses them."""
    import random

    import numpy as np
    import torch

    tensors = {"rng.torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{index}"] = state.clone()
    # The legacy (default) form: a tuple (typed as tuple-or-dict).
    kind, keys, pos, has_gauss, cached = cast(
        tuple[str, np.ndarray, int, int, float], np.random.get_state()
    )
    py_version, py_state, py_gauss = random.getstate()
    return tensors, {
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "python": [py_version, list(py_state), py_gauss],
    }


def restore_rng(tensors: dict[str, Any], states: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    torch.set_rng_state(tensors["rng.torch_cpu"])
    cuda_states = sorted(k for k in tensors if k.startswith("rng.cuda."))
    if cuda_states and torch.cuda.is_available():
        count = min(len(cuda_states), torch.cuda.device_count())
        for index in range(count):
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{index}"], index)
    if "numpy" in states:
        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "python" in states:
        version, state, gauss = states["python"]
        random.setstate((version, tuple(state), gauss))


_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}  # fmt: skip


def tensor_checksums(tensors: dict[str, Any]) -> dict[str, list[Any]]:
    """name -> [safetensors dtype, shape, sha256 of the bytes safetensors writes for it]
    (the raw little-endian memory of a contiguous CPU tensor)."""
    import torch

    sums = {}
    for key, tensor in tensors.items():
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        dtype = _SAFETENSORS_DTYPES[str(tensor.dtype).removeprefix("torch.")]
        sums[key] = [dtype, list(tensor.shape), hashlib.sha256(raw).hexdigest()]
    return sums


def write_tensors(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """One safetensors file with nnui's metadata and its checksums, written atomically."""
    from safetensors.torch import save as save_bytes

    text = json.dumps({**metadata, TENSOR_SHA_KEY: tensor_checksums(tensors)})
    meta = {META_KEY: text, META_SHA_KEY: hashlib.sha256(text.encode("utf-8")).hexdigest()}
    write_atomically(Path(path), save_bytes(tensors, metadata=meta))


def save(
    path: Path,
    model: Any,
    optimizer: Any,
    scaler: Any,
    metadata: dict[str, Any],
) -> float:
    """Write one checkpoint atomically; returns the write time in seconds.

    Raises CheckpointWriteError (partial file removed, older checkpoints untouched).
    """
    started = time.perf_counter()
    tensors = {f"model.{k}": v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    optim_tensors, optim_skeleton = _flatten_optimizer(optimizer.state_dict())
    tensors.update(optim_tensors)
    rng_tensors, rng_json = capture_rng()
    tensors.update(rng_tensors)
    tensors = {k: v.cpu() for k, v in tensors.items()}
    meta = {
        **metadata,
        "format": FORMAT,
        "optimizer": optim_skeleton,
        "scaler": scaler.state_dict() if scaler is not None else {},
        "rng": rng_json,
    }
    write_tensors(Path(path), tensors, meta)
    return time.perf_counter() - started


_TORCH_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def _read_tensor(handle: Any, header: Header, key: str, digest: str | None) -> Any:
    """One tensor in a buffer of its own, its bytes checked against `digest`."""
    import torch

    entry = header.tensors[key]
    dtype_name = _TORCH_DTYPES.get(entry["dtype"])
    if dtype_name is None:
        raise CheckpointError(f"{header.name}: tensor {key[:60]!r} has dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    buffer = bytearray(end - begin)
    handle.seek(header.data_start + begin)
    if handle.readinto(buffer) != len(buffer):
        raise CheckpointError(f"{header.name}: file changed while it was read")
    if digest is not None and hashlib.sha256(buffer).hexdigest() != digest:
        raise CheckpointError(f"{header.name}: checksum mismatch in {key[:60]!r}")
    dtype = getattr(torch, dtype_name)
    if not buffer:
        return torch.empty(entry["shape"], dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(entry["shape"])


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors on CPU, metadata) of an intact checkpoint, else CheckpointError.

    One open file: the bytes that are checked are the bytes that are loaded, each tensor
    into its own buffer. Floating-point tensors must be finite (older files have no
    checksums, and a NaN weight would only poison the training later).
    """
    path = Path(path)
    size = regular_file_size(path)
    try:
        with open(path, "rb") as handle:
            header = parse_header(path.name, size, file_reader(handle, path.name))
            digests = expected_digests(header)
            tensors = {
                key: _read_tensor(handle, header, key, None if digests is None else digests[key])
                for key in header.tensors
            }
    except OSError as error:
        raise CheckpointError(f"{path.name}: {error.strerror or error}") from error
    warn_unchecked(path, header)
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not _all_finite(tensor):
            raise CheckpointError(f"{path.name}: {key[:60]!r} holds NaN or infinite values")
    return tensors, header.metadata


def load_plain(path: Path) -> dict[str, Any]:
    """Every tensor of a plain safetensors file (no nnui metadata); CheckpointError if it
    cannot be read. This module is the one safetensors user (docs/layout-trainer.md)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{Path(path).name}: {error}") from None


def _all_finite(tensor: Any) -> bool:
    """NaN and inf survive a float64 sum (one pass, no mask tensor); only a sum that
    overflowed without either needs the exact look."""
    import torch

    if bool(torch.isfinite(tensor.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(tensor).all())


@dataclass(frozen=True)
class Resumed:
    info: CheckpointInfo
    tensors: dict[str, Any]


def load_resume(
    run_dir: Path,
    expected_identity: dict[str, str] | None = None,
    num_epochs: int | None = None,
    fits: Callable[[str, dict[str, Any], dict[str, Any]], None] | None = None,
) -> Resumed | None:
    """The newest checkpoint that is intact, resumable and (with `fits`) fits the live
    objects, loaded; the others are skipped with a one-line warning. None: nothing valid.

    Raises IdentityMismatch / BeyondSchedule like find_resume.
    """

    def check(info: CheckpointInfo) -> tuple[CheckpointInfo, dict[str, Any]]:
        tensors, metadata = load(info.path)
        check_resumable(info.path.name, tensors, metadata)
        if fits is not None:
            fits(info.path.name, tensors, metadata)
        return CheckpointInfo(info.path, info.kind, metadata["epoch_next"], metadata), tensors

    found = _first_valid(Path(run_dir), expected_identity, num_epochs, check)
    return Resumed(*found) if found else None


def apply(
    tensors: dict[str, Any],
    metadata: dict[str, Any],
    model: Any,
    optimizer: Any | None = None,
    scaler: Any | None = None,
    restore_rng_state: bool = False,
) -> None:
    """Load weights (and optionally optimizer, scaler, RNG) into live objects."""
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    model.load_state_dict(weights)
    if optimizer is not None:
        optimizer.load_state_dict(_unflatten_optimizer(metadata["optimizer"], tensors))
    if scaler is not None and metadata.get("scaler"):
        scaler.load_state_dict(metadata["scaler"])
    if restore_rng_state:
        restore_rng(tensors, metadata.get("rng", {}))
