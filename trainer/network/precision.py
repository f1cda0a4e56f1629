"""The float format the network computes in, per device: the one place that decides autocast.

nnU-Net trains and predicts under autocast on CUDA and in float32 elsewhere. nnui does the
same on CUDA (bf16 where the GPU has it, else fp16 with loss scaling) and adds bf16 on CPUs
with AMX tile units (Intel Xeon 4th generation and later): there bf16 convolutions run
2.5-4x faster than float32 ones (a 2d training step 2.0-2.9x, a 3D one 2.9x, a 3D
convolution 3.8x; bench/history.md), and the results stay those of mixed-precision
training (weights, optimiser state, loss and softmax stay float32, as under nnU-Net's CUDA
autocast). CPUs without AMX keep float32 (their bf16 convolutions were not measured here;
`--precision bf16` asks for them).

`--precision fp32` gives float32 on every device (the numbers of nnU-Net's CPU run).
Standard library until autocast_dtype is called: the CLIs validate before torch loads.
"""

from __future__ import annotations

import functools
from typing import Any

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
HELP = (
    "compute format: auto (default) = mixed precision on CUDA (bf16, else fp16) and on "
    "CPUs with AMX (bf16), float32 elsewhere; fp32 = float32 everywhere; bf16; fp16 (CUDA)"
)


def check(choice: str, device_type: str) -> None:
    """ValueError naming the flag when `choice` cannot run on `device_type`."""
    if choice not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    if choice == "fp16" and device_type != "cuda":
        raise ValueError("--precision fp16 needs -device cuda (use bf16 or fp32 on CPU)")
    if choice == "bf16" and device_type == "mps":
        raise ValueError("--precision bf16 is not supported with -device mps (use fp32)")


@functools.lru_cache(maxsize=1)
def cpu_has_amx() -> bool:
    """This machine's CPU has AMX tiles the OS lets torch use (torch's own CPU probe; False
    where this torch build has none)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def autocast_dtype(choice: str, device_type: str) -> Any:
    """torch dtype to autocast to, or None for plain float32."""
    import torch

    check(choice, device_type)
    if choice == "fp32" or device_type == "mps":
        return None
    if choice == "fp16":
        return torch.float16
    if device_type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        if choice == "bf16" and not supported:
            raise ValueError("--precision bf16: this GPU has no bf16 support (use fp16 or fp32)")
        return torch.bfloat16 if supported else torch.float16
    if choice == "bf16" or cpu_has_amx():
        return torch.bfloat16
    return None


def autocast(device_type: str, dtype: Any) -> Any:
    """The one autocast context of training and inference: to `dtype` (autocast_dtype's
    answer) on `device_type`, or switched off (float32) when dtype is None."""
    import torch

    if dtype is None:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


def describe(dtype: Any) -> str:
    """For the console log: "bf16 autocast", "fp16 autocast" or "float32"."""
    if dtype is None:
        return "float32"
    short = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), str(dtype))
    return f"{short} autocast"
