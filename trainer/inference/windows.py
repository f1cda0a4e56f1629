"""Sliding-window building blocks: window positions and Gaussian importance weights.

Windows overlap by half a patch; each window's logits are weighted by a Gaussian (sigma =
1/8 of the patch per axis) so window borders count less. The inference engine
(trainer.inference.sliding) and hence final validation (trainer.training.final_validation) use
them; `sliding_window_logits` is the plain single-model form kept for unit tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage


def window_starts(size: int, patch: int, step_fraction: float = 0.5) -> list[int]:
    """Window starts covering [0, size), at most step_fraction * patch apart."""
    if size <= patch:
        return [0]
    num_steps = math.ceil((size - patch) / (patch * step_fraction)) + 1
    step = (size - patch) / (num_steps - 1)
    return [round(i * step) for i in range(num_steps)]


@lru_cache(maxsize=8)
def _gaussian(patch: tuple[int, ...], sigma_scale: float = 1 / 8) -> np.ndarray:
    """nnU-Net's importance map: a unit impulse at p // 2 per axis (half a voxel past the
    middle of an even patch) blurred by scipy's Gaussian (sigma p / 8, cut at 4 sigma),
    peak 1; weights cut to 0 get the smallest non-zero one (no division by zero where only
    window corners reach). Kept in float32 (nnU-Net: float16)."""
    impulse = np.zeros(patch, dtype=np.float64)
    impulse[tuple(p // 2 for p in patch)] = 1.0
    weights = ndimage.gaussian_filter(
        impulse, [p * sigma_scale for p in patch], 0, mode="constant", cval=0
    )
    weights /= weights.max()
    weights = weights.astype(np.float32)
    weights[weights == 0] = weights[weights > 0].min()
    return weights


def gaussian_importance(patch: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_gaussian(tuple(int(p) for p in patch))).to(device)


def _predict_window(
    model: torch.nn.Module, x: torch.Tensor, mirror_axes: Sequence[int]
) -> torch.Tensor:
    out = model(x)
    out = out[0] if isinstance(out, (list, tuple)) else out
    out = out.float()
    if mirror_axes:
        count = 1
        for axis in mirror_axes:
            flipped = model(torch.flip(x, (axis,)))
            flipped = flipped[0] if isinstance(flipped, (list, tuple)) else flipped
            out = out + torch.flip(flipped.float(), (axis,))
            count += 1
        out = out / count
    return out


def _at(n: int, window: tuple[slice, ...]) -> tuple[int | slice, ...]:
    """The index of case n's window, every channel."""
    return (n, slice(None), *window)


def sliding_window_logits(
    model: torch.nn.Module,
    images: torch.Tensor,
    patch: Sequence[int],
    num_classes: int,
    mirror: bool = False,
    max_batch: int = 16,
) -> torch.Tensor:
    """Logits (N, K, *spatial) for images (N, C, *spatial), len(spatial) == len(patch).

    Windows of all N images are stacked into batches of up to max_batch (2d: the slices
    of a volume are the N images, so a whole volume needs few forward passes).
    """
    ndim = len(patch)
    spatial = tuple(images.shape[2:])
    pad = [max(0, p - s) for p, s in zip(patch, spatial, strict=True)]
    if any(pad):
        # F.pad takes the last axis first: (left, right) pairs.
        pairs = []
        for amount in reversed(pad):
            pairs += [amount // 2, amount - amount // 2]
        images = F.pad(images, pairs)
    padded = tuple(images.shape[2:])
    weights = gaussian_importance(patch, images.device)
    logits = torch.zeros((images.shape[0], num_classes, *padded), device=images.device)
    norm = torch.zeros(padded, device=images.device)
    starts = [window_starts(s, p) for s, p in zip(padded, patch, strict=True)]
    corners: list[tuple[int, ...]] = [()]
    for axis_starts in starts:
        corners = [(*c, s) for c in corners for s in axis_starts]
    windows = [
        tuple(slice(c, c + p) for c, p in zip(corner, patch, strict=True)) for corner in corners
    ]
    for window in windows:
        norm[window] += weights
    items = [(n, window) for window in windows for n in range(images.shape[0])]
    mirror_axes = list(range(2, 2 + ndim)) if mirror else []
    for i in range(0, len(items), max_batch):
        group = items[i : i + max_batch]
        batch = torch.stack([images[_at(n, window)] for n, window in group])
        out = _predict_window(model, batch, mirror_axes)
        for j, (n, window) in enumerate(group):
            logits[_at(n, window)] += out[j] * weights
    logits /= norm
    if any(pad):
        crop = tuple(slice(a // 2, a // 2 + s) for a, s in zip(pad, spatial, strict=True))
        logits = logits[(slice(None), slice(None), *crop)]
    return logits
