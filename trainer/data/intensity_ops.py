"""The intensity half of augmentation: per-channel operations on (C, *spatial) tensors
(batchgeneratorsv2's blur kernel and padding, low resolution, gamma, contrast), with
per-sample statistics summed in float64 so results do not depend on thread counts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _mean(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    count = math.prod(x.shape[d] for d in dims)
    return (x.sum(dim=dims, keepdim=True, dtype=torch.float64) / count).to(x.dtype)


def _mean_std(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row mean and (unbiased) std, accumulated in float64."""
    count = math.prod(x.shape[d] for d in dims)
    mean = _mean(x, dims)
    centred = x - mean
    var = (centred * centred).sum(dim=dims, keepdim=True, dtype=torch.float64) / max(1, count - 1)
    return mean, var.sqrt().to(x.dtype)


def blur_radius(sigma: float) -> int:
    """batchgeneratorsv2's kernel half-width: the odd size nearest to 6 sigma + 0.5 (halves
    towards n's side), so sigma 0.5 -> 3 taps, sigma 1 -> 7."""
    n = sigma * 6 + 0.5
    size = round(n)
    if size % 2 == 0:
        size = size + 1 if n - size >= 0 else size - 1
    return size // 2


def gaussian_blur(x: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
    """x (*spatial) blurred by a separable Gaussian, sigmas (ndim) in voxels, edges
    reflected (batchgeneratorsv2's kernel and padding). A weighted sum of shifted views
    per axis: ~10x faster on CPU than a conv with a (k, 1, 1) kernel."""
    out = x
    for axis, sigma in enumerate(sigmas):
        radius = min(blur_radius(sigma), x.shape[axis] - 1)  # reflect needs pad < length
        taps = torch.arange(-radius, radius + 1, dtype=torch.float64)
        kernel = torch.exp(-0.5 * (taps / sigma) ** 2)
        weights = (kernel / kernel.sum()).tolist()
        pad = [0] * (2 * x.ndim)
        pad[2 * (x.ndim - 1 - axis)] = pad[2 * (x.ndim - 1 - axis) + 1] = radius
        padded = F.pad(out[None, None], pad, mode="reflect")[0, 0]
        length = x.shape[axis]
        out = padded.narrow(axis, 0, length) * weights[0]
        for k in range(1, 2 * radius + 1):
            out.add_(padded.narrow(axis, k, length), alpha=weights[k])
    return out


def low_resolution(x: torch.Tensor, zoom: float, axes: tuple[int, ...]) -> torch.Tensor:
    """x (*spatial): nearest down-sampling by `zoom` along `axes`, linear back up."""
    spatial = tuple(x.shape)
    small = tuple(max(1, round(n * zoom)) if a in axes else n for a, n in enumerate(spatial))
    mode = "trilinear" if len(spatial) == 3 else "bilinear"
    down = F.interpolate(x[None, None], size=small, mode="nearest-exact")
    return F.interpolate(down, size=spatial, mode=mode, align_corners=False)[0, 0]


def gamma_retain_stats(x: torch.Tensor, gamma: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Gamma on the [0, 1]-rescaled image, then mean and std restored (nnU-Net's
    retain_stats)."""
    mean, std = _mean_std(x, dims)
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    span = (hi - lo).clamp_min(1e-7)
    out = ((x - lo) / span).clamp_min(0).pow(gamma) * span + lo
    out_mean, out_std = _mean_std(out, dims)
    return (out - out_mean) / out_std.clamp_min(1e-7) * std + mean


def contrast(x: torch.Tensor, factor: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    mean = _mean(x, dims)
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    return torch.minimum(torch.maximum((x - mean) * factor + mean, lo), hi)
