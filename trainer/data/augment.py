"""Batched data augmentation as torch ops on whatever device the batch lives on.

One affine_grid/grid_sample call per batch does rotation and scaling (image linear,
segmentation nearest); mirroring is a flip (exact); intensity transforms are per-sample
elementwise ops. Every random number is drawn from the generators given, in a fixed
number of draws, so a batch is reproducible from its seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AugmentConfig:
    """nnU-Net-like defaults; probabilities are per sample (mirroring per sample and axis)."""

    p_rotation: float = 0.2
    rotation_deg: float = 30.0
    in_plane_only: bool = False  # anisotropic 3D data: rotate about the slice axis only
    p_scale: float = 0.2
    scale_range: tuple[float, float] = (0.7, 1.4)
    p_mirror: float = 0.5
    p_noise: float = 0.1
    noise_variance: tuple[float, float] = (0.0, 0.1)
    p_brightness: float = 0.15
    brightness_range: tuple[float, float] = (0.75, 1.25)
    p_contrast: float = 0.15
    contrast_range: tuple[float, float] = (0.75, 1.25)
    p_gamma: float = 0.3
    gamma_range: tuple[float, float] = (0.7, 1.5)


def _uniform(u: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    return bounds[0] + (bounds[1] - bounds[0]) * u


def _rotation_matrices(angles: torch.Tensor, ndim: int) -> torch.Tensor:
    """(b, ndim, ndim) rotations acting on (z, y, x) / (y, x) voxel coordinates."""
    b = angles.shape[0]
    if ndim == 2:
        c, s = torch.cos(angles[:, 0]), torch.sin(angles[:, 0])
        return torch.stack([torch.stack([c, -s], 1), torch.stack([s, c], 1)], 1)
    out = torch.eye(3, dtype=angles.dtype).repeat(b, 1, 1)
    for axis in range(3):  # rotate about z, then y, then x
        c, s = torch.cos(angles[:, axis]), torch.sin(angles[:, axis])
        i, j = [a for a in range(3) if a != axis]
        rot = torch.eye(3, dtype=angles.dtype).repeat(b, 1, 1)
        rot[:, i, i], rot[:, i, j], rot[:, j, i], rot[:, j, j] = c, -s, s, c
        out = rot @ out
    return out


def _affine_grid(m: torch.Tensor, spatial: tuple[int, ...]) -> torch.Tensor:
    """F.affine_grid without translation, built by broadcasting 1D coordinates.

    Same result as affine_grid(align_corners=False), ~20x faster on CPU where
    affine_grid's batched matmul over a materialised base grid dominates the transform.
    """
    ndim = len(spatial)
    coords = []  # normalised voxel centres per axis in (x, y, z) order
    for i, n in enumerate(reversed(spatial)):
        c = (torch.arange(n, device=m.device, dtype=m.dtype) * 2 + 1) / n - 1
        shape = [1] * (ndim + 1)
        shape[ndim - i] = n
        coords.append(c.view(shape))
    outputs = []
    for row in range(ndim):
        acc = 0
        for col in range(ndim):
            acc = acc + m[:, row, col].view(-1, *([1] * ndim)) * coords[col]
        outputs.append(acc)
    return torch.stack(outputs, dim=-1)


def spatial_transform(
    data: torch.Tensor, seg: torch.Tensor, matrices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply per-sample voxel-space linear maps (b, d, d) (output -> input coordinates)."""
    spatial = data.shape[2:]
    ndim = len(spatial)
    # grid_sample's normalised coordinates are per-axis scaled and in (x, y, z) order.
    half = torch.tensor([n / 2.0 for n in spatial], dtype=matrices.dtype)
    m = matrices / half[None, :, None] * half[None, None, :]
    flip = list(range(ndim))[::-1]
    m = m[:, flip][:, :, flip]
    grid = _affine_grid(m.to(device=data.device, dtype=data.dtype), spatial)
    data = F.grid_sample(data, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    seg_f = F.grid_sample(
        seg.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False
    )
    return data, seg_f.to(seg.dtype)


def augment_batch(
    data: torch.Tensor,
    seg: torch.Tensor,
    generator: torch.Generator,
    config: AugmentConfig = AugmentConfig(),
    noise_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """data (b, C, *spatial) float, seg (b, 1, *spatial) integer; returns new tensors.

    `generator` is a CPU generator for the per-sample parameters; `noise_generator` lives
    on data.device for the noise field (defaults to one seeded from `generator`).
    """
    b, ndim = data.shape[0], data.ndim - 2
    device = data.device
    u = torch.rand(b, 17, generator=generator, dtype=torch.float64)
    if noise_generator is None:
        noise_generator = torch.Generator(device=device)
        noise_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))

    # --- rotation and scaling: one grid_sample for the samples that need it
    rotate = u[:, 0] < config.p_rotation
    scale = u[:, 1] < config.p_scale
    max_angle = math.radians(config.rotation_deg)
    angles = (u[:, 2:5] * 2 - 1) * max_angle
    if ndim == 3 and config.in_plane_only:
        angles[:, 1:] = 0.0
    angles = torch.where(rotate[:, None], angles, torch.zeros_like(angles))
    factors = torch.where(
        scale, _uniform(u[:, 5], config.scale_range), torch.ones(b, dtype=u.dtype)
    )
    moved = torch.nonzero(rotate | scale).flatten()
    if len(moved):
        matrices = _rotation_matrices(angles[moved], ndim) * factors[moved, None, None]
        index = moved.to(device)
        new_data, new_seg = spatial_transform(data[index], seg[index], matrices)
        data, seg = data.clone(), seg.clone()
        data[index], seg[index] = new_data, new_seg

    # --- mirroring: exact flips per sample and axis
    for axis in range(ndim):
        flip = (u[:, 6 + axis] < config.p_mirror).to(device)
        if flip.any():
            view = flip.view(b, *([1] * (ndim + 1)))
            dim = 2 + axis
            data = torch.where(view, data.flip(dim), data)
            seg = torch.where(view, seg.flip(dim), seg)

    # --- intensities (image only)
    per_sample = [1] * (ndim + 1)

    def column(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=data.dtype).view(b, *per_sample)

    noise_on = u[:, 9] < config.p_noise
    if noise_on.any():
        sigma = torch.sqrt(_uniform(u[:, 10], config.noise_variance)) * noise_on
        noise = torch.randn(data.shape, generator=noise_generator, device=device, dtype=data.dtype)
        data = data + noise * column(sigma)
    brightness = torch.where(
        u[:, 11] < config.p_brightness, _uniform(u[:, 12], config.brightness_range), 1.0
    )
    data = data * column(brightness)
    spatial_dims = tuple(range(2, data.ndim))
    contrast_on = u[:, 13] < config.p_contrast
    if contrast_on.any():
        factor = column(torch.where(contrast_on, _uniform(u[:, 14], config.contrast_range), 1.0))
        mean = data.mean(dim=spatial_dims, keepdim=True)
        lo, hi = (
            data.amin(dim=spatial_dims, keepdim=True),
            data.amax(dim=spatial_dims, keepdim=True),
        )
        data = torch.minimum(torch.maximum((data - mean) * factor + mean, lo), hi)
    gamma_on = u[:, 15] < config.p_gamma
    if gamma_on.any():
        # Gamma on the [0, 1]-rescaled image, then mean and std restored (nnU-Net's
        # retain_stats).
        gamma = column(torch.where(gamma_on, _uniform(u[:, 16], config.gamma_range), 1.0))
        mean = data.mean(dim=spatial_dims, keepdim=True)
        std = data.std(dim=spatial_dims, keepdim=True)
        lo, hi = (
            data.amin(dim=spatial_dims, keepdim=True),
            data.amax(dim=spatial_dims, keepdim=True),
        )
        span = (hi - lo).clamp_min(1e-7)
        out = ((data - lo) / span).clamp_min(0).pow(gamma) * span + lo
        out = (out - out.mean(dim=spatial_dims, keepdim=True)) / out.std(
            dim=spatial_dims, keepdim=True
        ).clamp_min(1e-7) * std + mean
        data = torch.where(column(gamma_on) > 0, out, data)
    return data, seg
