"""What a resume needs beyond intact bytes (torch side): RNG states every generator accepts,
optimizer references that exist, and weights and optimizer state that fit the live objects.
Each check raises CheckpointError with a one-line reason, before anything is loaded."""

from __future__ import annotations

from typing import Any

from trainer.checkpoint.format import CheckpointError


def _check_rng(name: str, tensors: dict[str, Any], states: dict[str, Any]) -> None:
    """Every stored RNG state is accepted by a throw-away generator of its kind."""
    import random

    import numpy as np
    import torch

    cpu = tensors.get("rng.torch_cpu")
    cuda = [v for k, v in tensors.items() if k.startswith("rng.cuda.")]
    try:
        if cpu is None or cpu.dtype != torch.uint8:
            raise ValueError("no CPU state")
        torch.Generator().set_state(cpu)
        if any(t.dtype != torch.uint8 or t.dim() != 1 or t.numel() == 0 for t in cuda):
            raise ValueError("malformed CUDA state")
        if "numpy" in states:
            kind, keys, pos, has_gauss, cached = states["numpy"]
            state = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(state)
        if "python" in states:
            version, state, gauss = states["python"]
            random.Random().setstate((version, tuple(state), gauss))
    except Exception as error:  # each generator has its own error types for a bad state
        raise CheckpointError(f"{name}: bad RNG state ({str(error)[:80]})") from None


def _check_optimizer_refs(name: str, tensors: dict[str, Any], skeleton: dict[str, Any]) -> None:
    for param_id, fields in skeleton["state"].items():
        if not (param_id.isascii() and param_id.isdigit()) or not isinstance(fields, dict):
            raise CheckpointError(f"{name}: malformed optimizer state")
        for spec in fields.values():
            ref = spec.get("tensor") if isinstance(spec, dict) else None
            ok = (
                isinstance(spec, dict)
                and len(spec) == 1
                and ("value" in spec or (isinstance(ref, str) and ref in tensors))
            )
            if not ok:
                raise CheckpointError(f"{name}: optimizer state refers to a missing tensor")


def check_resumable(name: str, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """RNG states, optimizer references and scaler state usable as they are (CheckpointError)."""
    _check_rng(name, tensors, metadata["rng"])
    _check_optimizer_refs(name, tensors, metadata["optimizer"])
    scaler = metadata.get("scaler") or {}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scaler.values()):
        raise CheckpointError(f"{name}: malformed scaler state")


FLOAT32_MAX = 3.4028234663852886e38


def _same_kind(stored: Any, live: Any) -> bool:
    """A stored optimizer setting of the live one's kind; numbers finite and within float32
    (the optimizers' kernels turn them into tensors of the parameters' dtype)."""
    number = (int, float)
    if isinstance(live, bool) or isinstance(stored, bool):
        return type(stored) is type(live)
    if isinstance(live, number):
        return isinstance(stored, number) and abs(stored) <= FLOAT32_MAX  # False for NaN, inf
    if isinstance(live, (list, tuple)):
        return isinstance(stored, (list, tuple)) and len(stored) == len(live)
    return type(stored) is type(live)


def check_fits(
    name: str, tensors: dict[str, Any], metadata: dict[str, Any], model: Any, optimizer: Any
) -> None:
    """The checkpoint's weights and optimizer state fit these live objects (checked before
    anything is loaded into them, so a refusal leaves them untouched)."""
    live = model.state_dict()
    stored = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    if stored.keys() != live.keys():
        raise CheckpointError(f"{name}: weights of another network")
    for key, tensor in live.items():
        if stored[key].shape != tensor.shape or stored[key].dtype != tensor.dtype:
            found = f"{str(stored[key].dtype).removeprefix('torch.')} {list(stored[key].shape)}"
            raise CheckpointError(f"{name}: weight {key} is {found}, this network's is not")
    skeleton, groups = metadata["optimizer"], optimizer.state_dict()["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(skeleton["param_groups"]) != len(groups):
        raise CheckpointError(f"{name}: optimizer of another kind")
    for saved, group in zip(skeleton["param_groups"], groups, strict=True):
        if saved.keys() != group.keys() or saved["params"] != group["params"]:
            raise CheckpointError(f"{name}: optimizer of another kind")
        if not all(_same_kind(saved[k], v) for k, v in group.items()):
            raise CheckpointError(f"{name}: malformed optimizer settings")
    for param_id, fields in skeleton["state"].items():
        if int(param_id) >= len(params):
            raise CheckpointError(f"{name}: optimizer state of another network")
        for spec in fields.values():
            value = tensors[spec["tensor"]] if "tensor" in spec else None
            if value is not None and value.dim() and value.shape != params[int(param_id)].shape:
                raise CheckpointError(f"{name}: optimizer state of another network")
