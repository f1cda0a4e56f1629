"""Batched data augmentation as torch ops on whatever device the batch lives on.

nnU-Net v2's training transforms: rotation and scaling (a grid_sample per sample that
needs it; image linear, segmentation by linear interpolation of each label's indicator and
argmax), taking the network patch out of the centre of a larger read (read_size), so
rotated or zoomed-out corners hold image, not fill; mirroring (exact reversals, done with
the spatial step where they cost no pass: nnU-Net mirrors last, see augment_batch);
Gaussian noise, Gaussian blur, brightness, contrast, low-resolution simulation, gamma on
the inverted image, gamma; then, for use_mask_for_norm channels, the outside of the body
(nnU-Net's -1 label, resampled as a label of its own) set back to 0. Brightness, contrast
and gamma are drawn per channel; "dummy 2D" (in_plane_only) rotates about axis 0 and
scales y and x only. The ops live in grid_sampling (spatial) and intensity_ops.
Each transform touches only the samples it was drawn for; samples are written one by one
into the output batch and transformed there in place (no batch-sized temporaries). Every
random number comes from the generators given, in a fixed number of draws, so a batch is
reproducible from its seed; per-sample statistics are summed in float64 so the result
does not depend on how many threads compute it (loader thread or main thread).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.data.grid_sampling import (
    centre_into,
    outside_body,
    spatial_with_outside,
    touched_box,
)
from trainer.data.intensity_ops import (
    contrast_,
    gamma_retain_stats_,
    gaussian_blur,
    low_resolution,
)


@dataclass(frozen=True)
class AugmentConfig:
    """nnU-Net-like defaults; probabilities are per sample (mirroring per sample and axis)."""

    p_rotation: float = 0.2
    rotation_deg: float = 30.0
    # nnU-Net's "dummy 2D" for 3D patches much thinner along axis 0: rotate about axis 0
    # and scale y and x only, the patch's slices kept as they are
    in_plane_only: bool = False
    p_scale: float = 0.2
    scale_range: tuple[float, float] = (0.7, 1.4)
    p_mirror: float = 0.5
    p_noise: float = 0.1
    noise_variance: tuple[float, float] = (0.0, 0.1)  # nnU-Net's name; the draw is the std
    p_blur: float = 0.2
    p_blur_per_channel: float = 0.5
    blur_sigma: tuple[float, float] = (0.5, 1.0)  # voxels, drawn per axis
    p_brightness: float = 0.15
    brightness_range: tuple[float, float] = (0.75, 1.25)
    p_contrast: float = 0.15
    contrast_range: tuple[float, float] = (0.75, 1.25)
    p_low_res: float = 0.25
    p_low_res_per_channel: float = 0.5
    low_res_scale: tuple[float, float] = (0.5, 1.0)  # one zoom for all (in-plane) axes
    p_gamma_inverted: float = 0.1
    p_gamma: float = 0.3
    gamma_range: tuple[float, float] = (0.7, 1.5)
    # Channels normalised over the body only (plans' use_mask_for_norm): their voxels
    # outside it are set back to 0 after the intensity transforms, as nnU-Net does
    # (MaskImageTransform on its seg's -1 region), so noise, brightness and gamma never
    # paint the air around the body the network then has to learn to ignore.
    mask_channels: tuple[bool, ...] = ()


def _uniform(u: float, bounds: tuple[float, float]) -> float:
    return bounds[0] + (bounds[1] - bounds[0]) * u


def _below_or_above_one(u: float, bounds: tuple[float, float]) -> float:
    """nnU-Net's BGContrast draw (brightness, contrast, gamma): half the time from
    (low, 1), else from (1, high), whatever the range's asymmetry; one uniform u in [0, 1)."""
    low, high = bounds
    if low >= 1 or high <= 1:
        return _uniform(u, bounds)
    if u < 0.5:
        return low + (1.0 - low) * (2.0 * u)
    return 1.0 + (high - 1.0) * (2.0 * u - 1.0)


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


# nnU-Net sizes its read for scale factors down to 0.85, not its scale range's 0.7 (its own
# comment calls this a shortcut); zooming out beyond 1 / 0.85 reaches the fill.
_READ_SCALE = 0.85


def _rotated_extent(extent: list[float], i: int, j: int, angle: float) -> list[float]:
    """|extent| after a rotation by `angle` in the (i, j) plane, in nnU-Net's convention
    (the extent vector as a row times the rotation matrix), so both sides read alike."""
    c, s = math.cos(angle), math.sin(angle)
    out = list(extent)
    out[i] = abs(extent[i] * c + extent[j] * s)
    out[j] = abs(extent[j] * c - extent[i] * s)
    return out


def read_size(patch_size: tuple[int, ...], config: AugmentConfig) -> tuple[int, ...]:
    """The box to read for a patch_size network patch, nnU-Net's rule: the patch's extent
    rotated by the largest angle (at most 90 degrees) about each axis alone, the larger of
    each axis, divided by 0.85; the slice axis stays as it is for in-plane rotation only.
    patch_size itself when the config neither rotates nor scales."""
    patch = [int(p) for p in patch_size]
    if config.p_rotation <= 0 and config.p_scale <= 0:
        return tuple(patch)
    angle = min(math.radians(config.rotation_deg), math.pi / 2) if config.p_rotation > 0 else 0.0
    if len(patch) == 2:
        planes = [(0, 1)]
    elif config.in_plane_only:
        planes = [(1, 2)]
    else:
        planes = [(1, 2), (0, 2), (0, 1)]  # about axis 0, 1, 2 in turn
    widest = [float(p) for p in patch]
    for i, j in planes:
        # nnU-Net's rotation about y has the opposite sign convention: mirror the plane
        k, m = (j, i) if (i, j) == (0, 2) else (i, j)
        rotated = _rotated_extent([float(p) for p in patch], k, m, angle)
        widest = [max(a, b) for a, b in zip(widest, rotated, strict=True)]
    read = [int(w / _READ_SCALE) for w in widest]
    if len(patch) == 3 and config.in_plane_only:
        read[0] = patch[0]
    return tuple(max(r, p) for r, p in zip(read, patch, strict=True))


@dataclass(frozen=True)
class _Draws:
    """Every random number of one batch, drawn up front in a fixed order (reproducibility).

    u (b, 17): rotation/scale gates, angles, zoom, mirror gates, noise, brightness,
    contrast and gamma gates (columns 12, 14, 16 unused since those factors are drawn per
    channel); v (b, 4): blur and low-resolution gates, inverted gamma gate (column 3
    unused); per_channel (b, C, 7 + ndim): blur gate and sigmas, low-resolution gate and
    zoom, then brightness, contrast, inverted gamma and gamma factors (nnU-Net draws those
    four per channel).
    """

    u: list[list[float]]
    v: list[list[float]]
    per_channel: list[list[list[float]]]
    noise_generator: torch.Generator


def _draw_u(generator: torch.Generator, b: int) -> list[list[float]]:
    return torch.rand(b, 17, generator=generator, dtype=torch.float64).tolist()


def _moves(u: list[float], config: AugmentConfig) -> bool:
    """Whether a sample with the uniforms u is rotated or scaled (else centre-cropped)."""
    return u[0] < config.p_rotation or u[1] < config.p_scale


def sample_windows(
    generator: torch.Generator,
    batch_size: int,
    config: AugmentConfig,
    read: tuple[int, ...],
    patch: tuple[int, ...],
) -> list[tuple[slice, ...]]:
    """The part of its read each sample's augmentation with this generator uses (the
    generator's state is left as it was): the centre patch of a sample it neither rotates
    nor scales, else the box its rotation and zoom can touch. A reader can fetch just that
    and pass read_size to augment_batch."""
    state = generator.get_state()
    u = _draw_u(generator, batch_size)
    generator.set_state(state)
    windows = []
    for row in u:
        if _moves(row, config):
            windows.append(touched_box(_matrix(row, config, len(read))[None], read, patch))
        else:  # centre_crop's box
            starts = [n // 2 - p // 2 for n, p in zip(read, patch, strict=True)]
            windows.append(tuple(slice(s, s + p) for s, p in zip(starts, patch, strict=True)))
    return windows


def _draw(
    shape: tuple[int, int, int],
    device: torch.device,
    generator: torch.Generator,
    noise_generator: torch.Generator | None,
) -> _Draws:
    b, channels, ndim = shape
    u = _draw_u(generator, b)
    if noise_generator is None:
        noise_generator = torch.Generator(device=device)
        noise_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    v = torch.rand(b, 4, generator=generator, dtype=torch.float64).tolist()
    per_channel = torch.rand(b, channels, 7 + ndim, generator=generator, dtype=torch.float64)
    return _Draws(u, v, per_channel.tolist(), noise_generator)


def _matrix(u: list[float], config: AugmentConfig, ndim: int) -> torch.Tensor:
    """(ndim, ndim) rotation times zoom of a sample drawn for rotation or scaling."""
    max_angle = math.radians(config.rotation_deg)
    rotates = u[0] < config.p_rotation
    angles = torch.tensor(
        [[(x * 2 - 1) * max_angle if rotates else 0.0 for x in u[2:5]]], dtype=torch.float64
    )
    if ndim == 3 and config.in_plane_only:
        angles[:, 1:] = 0.0
    factor = _uniform(u[5], config.scale_range) if u[1] < config.p_scale else 1.0
    matrix = _rotation_matrices(angles, ndim)[0] * factor
    if ndim == 3 and config.in_plane_only:
        matrix[0, 0] = 1.0  # dummy 2D: y and x scaled, each slice stays one slice
    return matrix


def _rotate_and_scale(
    data: torch.Tensor,
    seg: torch.Tensor,
    u: list[float],
    config: AugmentConfig,
    out_size: tuple[int, ...],
    masked: list[int],
    read_size: tuple[int, ...] | None,
    start: tuple[int, ...] | None,
    flips: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One sample (C, *read) (or its part at start) resampled at its drawn rotation /
    zoom about the centre, mirrored along `flips`, cut to out_size: (image, seg, outside
    mask or None without masked channels). Mirrored by the map itself: an output axis
    reversed is its column negated, the very same grid values in reverse order."""
    matrix = _matrix(u, config, data.ndim - 1)
    for axis in flips:
        matrix[:, axis] = -matrix[:, axis]
    matrix = matrix[None]
    # the outside (masked channels) is resampled as a label of its own
    image, label, outside = spatial_with_outside(
        data[None], seg[None], matrix, out_size, masked, read_size, start
    )
    return image[0], label[0], None if outside is None else outside[0]


def _blur_channels(x: torch.Tensor, pc: list[list[float]], config: AugmentConfig, ndim: int):
    for c in range(x.shape[0]):
        if pc[c][0] < config.p_blur_per_channel:
            sigmas = [_uniform(s, config.blur_sigma) for s in pc[c][1 : 1 + ndim]]
            x[c] = gaussian_blur(x[c], sigmas)


def _low_res_channels(x: torch.Tensor, pc: list[list[float]], config: AugmentConfig, ndim: int):
    low_res_axes = tuple(range(1 if ndim == 3 and config.in_plane_only else 0, ndim))
    for c in range(x.shape[0]):
        if pc[c][1 + ndim] < config.p_low_res_per_channel:
            zoom = _uniform(pc[c][2 + ndim], config.low_res_scale)
            x[c] = low_resolution(x[c], zoom, low_res_axes)


FACTOR_NAMES = ("brightness", "contrast", "gamma_inverted", "gamma")


def channel_factors(pc: list[list[float]], config: AugmentConfig) -> dict[str, list[float]]:
    """Per-channel brightness, contrast, inverted-gamma and gamma factors of one sample
    from its per-channel uniforms pc (C, 7 + ndim): one draw per channel, as nnU-Net's
    transforms with synchronize_channels=False."""
    ndim = len(pc[0]) - 7
    ranges = (config.brightness_range, config.contrast_range, config.gamma_range,
              config.gamma_range)  # fmt: skip
    return {
        name: [_below_or_above_one(row[3 + ndim + k], ranges[k]) for row in pc]
        for k, name in enumerate(FACTOR_NAMES)
    }


def _per_channel(values: list[float], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype, device=x.device).view(-1, *[1] * (x.ndim - 1))


def _intensities_(x: torch.Tensor, draws: _Draws, i: int, config: AugmentConfig) -> None:
    """Image-only transforms of sample i (C, *spatial), in place, each if drawn for it, in
    nnU-Net's order."""
    ndim = x.ndim - 1
    ui, vi, pc = draws.u[i], draws.v[i], draws.per_channel[i]
    factors = channel_factors(pc, config)
    if ui[9] < config.p_noise:
        # nnU-Net draws the noise's standard deviation from this range (its argument is
        # named noise_variance, but batchgeneratorsv2 uses the draw as the std).
        sigma = _uniform(ui[10], config.noise_variance)
        noise = torch.randn(
            x.shape, generator=draws.noise_generator, device=x.device, dtype=x.dtype
        )
        x.add_(noise.mul_(sigma))
    if vi[0] < config.p_blur:
        _blur_channels(x, pc, config, ndim)
    if ui[11] < config.p_brightness:
        x.mul_(_per_channel(factors["brightness"], x))
    if ui[13] < config.p_contrast:
        contrast_(x, _per_channel(factors["contrast"], x))
    if vi[1] < config.p_low_res:
        _low_res_channels(x, pc, config, ndim)
    if vi[2] < config.p_gamma_inverted:
        x.neg_()
        gamma_retain_stats_(x, _per_channel(factors["gamma_inverted"], x))
        x.neg_()
    if ui[15] < config.p_gamma:
        gamma_retain_stats_(x, _per_channel(factors["gamma"], x))


def augment_batch(
    data: torch.Tensor | Sequence[torch.Tensor],
    seg: torch.Tensor | Sequence[torch.Tensor],
    generator: torch.Generator,
    config: AugmentConfig = AugmentConfig(),
    noise_generator: torch.Generator | None = None,
    patch_size: tuple[int, ...] | None = None,
    read_size: tuple[int, ...] | None = None,
    starts: Sequence[tuple[int, ...]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """data (b, C, *read) float, seg (b, 1, *read) integer; returns new tensors of
    patch_size (default: read), cut from the centre of the read (read_size(patch_size)).
    data and seg may also be b per-sample tensors, each the whole read or, with
    read_size and starts given, a part of it at starts[i] (a reader fetches what of its
    sample_windows window lies inside the image), the rest of the read being the zero
    fill; the input is never written to.

    `generator` is a CPU generator for the per-sample parameters; `noise_generator` lives
    on data.device for the noise field (defaults to one seeded from `generator`).
    """
    samples, seg_samples = list(data), list(seg)
    b, first = len(samples), samples[0]
    out = tuple(patch_size) if patch_size is not None else tuple(first.shape[1:])
    read = tuple(read_size) if read_size is not None else tuple(first.shape[1:])
    draws = _draw((b, first.shape[0], first.ndim - 1), first.device, generator, noise_generator)
    masked = [c for c, on in enumerate(config.mask_channels) if on and c < first.shape[0]]
    images = torch.empty((b, first.shape[0], *out), dtype=first.dtype, device=first.device)
    labels = torch.empty((b, 1, *out), dtype=seg_samples[0].dtype, device=first.device)
    # Samples in order: the noise generator's stream is consumed sample by sample.
    for i in range(b):
        x, y, outside = images[i], labels[i], None
        start = tuple(starts[i]) if starts is not None else (0,) * len(read)
        # Mirroring, nnU-Net's last transform, is done first, where it costs nothing: by
        # the spatial map or the centre crop's copy. The intensity transforms commute with
        # it (noise is i.i.d., the blur kernel symmetric and its padding reflecting, the
        # rest per-channel statistics), except low resolution's nearest down-sampling,
        # whose picks may shift by a voxel (its phase): docs/fidelity.md.
        flips = [axis for axis in range(len(out)) if draws.u[i][6 + axis] < config.p_mirror]
        if _moves(draws.u[i], config):
            image, label, outside = _rotate_and_scale(
                samples[i], seg_samples[i], draws.u[i], config, out, masked, read, start,
                flips,
            )  # fmt: skip
            x.copy_(image)
            y.copy_(label)
        else:
            centre_into(x, samples[i], start, read, flips)
            centre_into(y, seg_samples[i], start, read, flips)
            if masked:
                outside = outside_body(x[None], y[None], masked)[0]
        _intensities_(x, draws, i, config)
        if outside is not None:  # nnU-Net's MaskImageTransform, after the intensities
            for c in masked:
                x[c].masked_fill_(outside[0], 0.0)
    return images, labels
