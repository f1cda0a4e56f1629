"""Gaussian sliding window over whole cases, mirroring TTA, probabilities averaged over folds.

Windows and Gaussian weights are final validation's (`trainer.inference.windows.window_starts`,
`gaussian_importance`). Test-time mirroring flips over every combination of the spatial
axes the training mirrored (all of them, as nnU-Net's default): 8 passes in 3d, 4 in 2d.
The folds' Gaussian-weighted logits are averaged and the softmax taken after, as nnU-Net
ensembles folds (the mean of the folds' logits, not of their probabilities: a fold that is
sure of itself weighs more).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import numpy as np
import torch
import torch.nn.functional as F

from trainer.inference.windows import gaussian_importance, window_starts
from trainer.network import precision

# Voxels of input per forward pass on a GPU: several windows per batch keep it busy; the
# cap bounds activations. On CPU one 3D window per pass: activations grow with the batch
# (patch 64x80x80: nnui-predict peaked at 2.1 GiB PSS with 5 windows per pass, 0.86 GiB
# with one, nnU-Net at 1.6 GiB) for at most ~20 % less CPU per window (bench/history.md).
# 2D windows on CPU are the opposite case: a 64x64 window alone costs ~10x the CPU it costs
# in a batch of 64 (the deep stages are a few pixels wide, so per-op overhead dominates),
# and 64 of them hold ~50 MB per full-resolution feature map.
VOXELS_PER_BATCH = 1 << 21
MAX_WINDOWS_PER_BATCH = 8
CPU_2D_VOXELS_PER_BATCH = 1 << 18
CPU_2D_MAX_WINDOWS_PER_BATCH = 64


def windows_per_batch(device: torch.device, patch: Sequence[int]) -> int:
    if device.type == "cpu" and len(patch) == 3:
        return 1
    voxels = int(np.prod(patch))
    if device.type == "cpu":
        return max(1, min(CPU_2D_MAX_WINDOWS_PER_BATCH, CPU_2D_VOXELS_PER_BATCH // voxels))
    return max(1, min(MAX_WINDOWS_PER_BATCH, VOXELS_PER_BATCH // voxels))


def memory_format(device: torch.device, ndim: int) -> torch.memory_format:
    """channels_last_3d for 3D networks on CPU: oneDNN's convs then skip their per-conv
    reorders from NCDHW (-20 % CPU per 64x80x80 window; trainer.network.norm keeps the instance
    norms in that layout). Elsewhere the default layout."""
    if device.type == "cpu" and ndim == 3:
        return torch.channels_last_3d
    return torch.contiguous_format


def mirror_combinations(
    ndim: int, enabled: bool, spatial_axes: Sequence[int] | None = None
) -> list[tuple[int, ...]]:
    """Flip axes of (N, C, *spatial) tensors: () first, then every non-empty combination of
    `spatial_axes` (0-based over the patch; None: all of them, nnU-Net's default)."""
    chosen = range(ndim) if spatial_axes is None else sorted(set(spatial_axes))
    axes = [2 + a for a in chosen] if enabled else []
    combos: list[tuple[int, ...]] = [()]
    for r in range(1, len(axes) + 1):
        combos += list(itertools.combinations(axes, r))
    return combos


def _windows(spatial: Sequence[int], patch: Sequence[int], step_size: float) -> list[tuple]:
    starts = [window_starts(s, p, step_size) for s, p in zip(spatial, patch, strict=True)]
    return [
        tuple(slice(c, c + p) for c, p in zip(corner, patch, strict=True))
        for corner in itertools.product(*starts)
    ]


def _pad_to_patch(images: torch.Tensor, patch: Sequence[int]) -> tuple[torch.Tensor, tuple]:
    """Zero-pad (N, C, *spatial) to at least the patch; returns (padded, crop back)."""
    spatial = tuple(images.shape[2:])
    pad = [max(0, p - s) for p, s in zip(patch, spatial, strict=True)]
    crop = tuple(slice(a // 2, a // 2 + s) for a, s in zip(pad, spatial, strict=True))
    if not any(pad):
        return images, crop
    pairs: list[int] = []
    for amount in reversed(pad):  # F.pad takes the last axis first
        pairs += [amount // 2, amount - amount // 2]
    return F.pad(images, pairs), crop


def _flip(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    return torch.flip(x, axes) if axes else x


def _fold_logits(
    model: torch.nn.Module,
    images: torch.Tensor,
    windows: list[tuple],
    weights: torch.Tensor,
    combos: list[tuple[int, ...]],
    num_classes: int,
    batch: int,
    autocast: Callable[[], AbstractContextManager],
) -> torch.Tensor:
    """Gaussian-weighted sums of window logits (N, K, *padded) for one fold, averaged over
    the mirror combinations. Windows and flips share batches, so every forward pass is full
    even when a small case has few windows."""
    logits = torch.zeros((images.shape[0], num_classes, *images.shape[2:]), device=images.device)
    # Per item the tensor is (C, *spatial): flip axes shift by one.
    items = [
        (n, w, tuple(a - 1 for a in axes))
        for w in windows
        for n in range(images.shape[0])
        for axes in combos
    ]
    weights = weights / len(combos)
    layout = memory_format(images.device, images.dim() - 2)
    for i in range(0, len(items), batch):
        group = items[i : i + batch]
        x = torch.stack([_flip(images[(n, slice(None), *w)], axes) for n, w, axes in group])
        with autocast():
            out = model(x.contiguous(memory_format=layout))
        out = (out[0] if isinstance(out, (list, tuple)) else out).contiguous()
        for j, (n, w, axes) in enumerate(group):
            logits[(n, slice(None), *w)] += _flip(out[j].float(), axes) * weights
    return logits


def sliding_window_probabilities(
    models: Sequence[torch.nn.Module],
    images: torch.Tensor,
    patch: Sequence[int],
    num_classes: int,
    step_size: float = 0.5,
    mirror: bool = True,
    autocast_dtype: torch.dtype | None = None,
    sigmoid: bool = False,
    mirror_axes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Softmax (sigmoid: one independent probability per channel, region-based training) of
    the fold-averaged logits (N, K, *spatial) for images (N, C, *spatial); the networks run
    under autocast to `autocast_dtype` (trainer.network.precision), else float32."""
    images, crop = _pad_to_patch(images, patch)
    windows = _windows(tuple(images.shape[2:]), patch, step_size)
    weights = gaussian_importance(patch, images.device)
    norm = torch.zeros(tuple(images.shape[2:]), device=images.device)
    for w in windows:
        norm[w] += weights
    combos = mirror_combinations(len(patch), mirror, mirror_axes)
    batch = windows_per_batch(images.device, patch)
    autocast = _autocast_for(images.device, autocast_dtype)
    total = None
    for model in models:
        logits = _fold_logits(model, images, windows, weights, combos, num_classes, batch, autocast)
        total = logits if total is None else total.add_(logits)
        del logits
    assert total is not None, "at least one model"
    total /= norm * len(models)
    probs = torch.sigmoid(total) if sigmoid else torch.softmax(total, dim=1)
    return probs[(slice(None), slice(None), *crop)]


def _autocast_for(
    device: torch.device, dtype: torch.dtype | None
) -> Callable[[], AbstractContextManager]:
    return lambda: precision.autocast(device.type, dtype)


@torch.inference_mode()
def predict_probabilities(
    models: Sequence[torch.nn.Module],
    data: np.ndarray,
    patch: Sequence[int],
    num_classes: int,
    device: torch.device,
    step_size: float = 0.5,
    mirror: bool = True,
    autocast_dtype: torch.dtype | None = None,
    sigmoid: bool = False,
    mirror_axes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Softmax (sigmoid: regions) (K, z, y, x) for one preprocessed case (C, z, y, x); 2d
    predicts slices. `mirror_axes`: the patch axes mirrored (None: all)."""
    volume = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(device)
    if len(patch) == 3:
        return sliding_window_probabilities(
            models,
            volume[None],
            patch,
            num_classes,
            step_size,
            mirror,
            autocast_dtype,
            sigmoid,
            mirror_axes,
        )[0]
    slices = volume.permute(1, 0, 2, 3)  # (z, C, y, x): the slices are a batch of images
    probs = sliding_window_probabilities(
        models, slices, patch, num_classes, step_size, mirror, autocast_dtype, sigmoid, mirror_axes
    )
    return probs.permute(1, 0, 2, 3)
