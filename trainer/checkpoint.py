"""Checkpoints as single safetensors files (the only safetensors user in nnui).

One file holds model weights (`model.*`), optimizer tensors (`optim.*`), the CPU/CUDA RNG
states (`rng.*`) and a JSON metadata block under the key `nnui` (epoch to run next,
history, best EMA, optimizer skeleton, scaler state, resolved config, plans identity).
Loading never unpickles. Writes are atomic (tmp + fsync + os.replace).

Selecting a checkpoint to resume (`find_resume`) reads only the header with the standard
library, so the CLI can refuse a mismatching checkpoint before importing torch.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.schema import atomic_write_bytes, checkpoint_file

log = logging.getLogger(__name__)

FORMAT = "nnui-checkpoint-v1"
META_KEY = "nnui"
# Resume preference when stored epochs tie: final, then latest, then best.
RESUME_ORDER = ("final", "latest", "best")


class CheckpointError(ValueError):
    """A file that is not a complete nnui checkpoint."""


class IdentityMismatch(ValueError):
    """A valid checkpoint from another dataset, configuration or plans."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    kind: str
    epoch_next: int
    metadata: dict[str, Any]


# ---- header (stdlib only) -----------------------------------------------------------------


def read_metadata(path: Path) -> dict[str, Any]:
    """The JSON metadata of a checkpoint, after checking that the file is complete.

    safetensors layout: u64 header length, JSON header (tensor offsets + __metadata__),
    data. A truncated file is caught by comparing its size with the largest end offset.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path.name}: too short")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise CheckpointError(f"{path.name}: header runs past the end of the file")
            header = json.loads(handle.read(header_len))
    except OSError as error:
        raise CheckpointError(f"{path.name}: {error}") from error
    except ValueError as error:
        raise CheckpointError(f"{path.name}: unreadable header ({error})") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not an object")
    try:
        data_end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise CheckpointError(f"{path.name}: malformed tensor table ({error!r})") from error
    if 8 + header_len + data_end != size:
        raise CheckpointError(
            f"{path.name}: truncated ({size} bytes, expected {8 + header_len + data_end})"
        )
    try:
        metadata = json.loads(header["__metadata__"][META_KEY])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path.name}: no nnui metadata") from error
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path.name}: nnui metadata is not an object")
    if metadata.get("format") != FORMAT or not isinstance(metadata.get("epoch_next"), int):
        raise CheckpointError(f"{path.name}: not an {FORMAT} file")
    return metadata


def check_identity(info: CheckpointInfo, expected: dict[str, str]) -> None:
    stored = info.metadata.get("identity")
    stored = stored if isinstance(stored, dict) else {}
    for key, value in expected.items():
        if stored.get(key) != value:
            raise IdentityMismatch(
                f"{info.path} belongs to {key}={stored.get(key)!r}, this run has {value!r}; "
                "use another results folder or remove the checkpoint"
            )


def find_resume(
    run_dir: Path, expected_identity: dict[str, str] | None = None
) -> CheckpointInfo | None:
    """Newest valid checkpoint by stored epoch; invalid files are skipped with a warning.

    Raises IdentityMismatch when the chosen one belongs to another configuration/plans.
    """
    candidates: list[CheckpointInfo] = []
    for kind in RESUME_ORDER:
        path = Path(run_dir) / checkpoint_file(kind)
        if not path.exists():
            continue
        try:
            metadata = read_metadata(path)
        except CheckpointError as error:
            log.warning("skipping invalid checkpoint %s", error)
            continue
        candidates.append(CheckpointInfo(path, kind, metadata["epoch_next"], metadata))
    if not candidates:
        return None
    # max() keeps the first of equal epochs, i.e. RESUME_ORDER decides ties.
    best = max(candidates, key=lambda info: info.epoch_next)
    if expected_identity is not None:
        check_identity(best, expected_identity)
    return best


# ---- save / load (torch + safetensors) ----------------------------------------------------


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
    kind, keys, pos, has_gauss, cached = np.random.get_state()
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


def save(
    path: Path,
    model: Any,
    optimizer: Any,
    scaler: Any,
    metadata: dict[str, Any],
) -> float:
    """Write one checkpoint atomically; returns the write time in seconds."""
    from safetensors.torch import save as save_bytes

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
    blob = save_bytes(tensors, metadata={META_KEY: json.dumps(meta)})
    atomic_write_bytes(Path(path), blob)
    return time.perf_counter() - started


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors on CPU, metadata). Raises CheckpointError for anything unreadable."""
    from safetensors.torch import load_file

    metadata = read_metadata(Path(path))
    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as error:  # safetensors raises its own error types for corrupt data
        raise CheckpointError(f"{Path(path).name}: {error}") from error
    return tensors, metadata


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
