"""Per-case array operations of preprocessing: crop to nonzero, normalise, resample.

Pure numpy/scipy functions on (C, Z, Y, X) images and (Z, Y, X) segmentations, with
nnU-Net 2.8.1's rules (tests/trainer/data/test_fidelity_case_ops.py runs nnU-Net's functions beside
these): the body mask is the nonzero region with its holes filled; resampling is skimage's
resize (edge mode, no anti-aliasing, clipped to the input's range), and for anisotropic
spacings in-plane only, with nearest neighbour along the thick axis ("separate z").
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from trainer.data.raw import DataError

CT = "CTNormalization"
ZSCORE = "ZScoreNormalization"
NO_NORM = "NoNormalization"
RESCALE_0_1 = "RescaleTo01Normalization"
RGB_0_1 = "RGBTo01Normalization"
SCHEMES = (CT, ZSCORE, NO_NORM, RESCALE_0_1, RGB_0_1)
# nnU-Net's ANISO_THRESHOLD: above this max/min spacing ratio the thick axis is
# resampled by nearest neighbour, the others in-plane.
ANISO_THRESHOLD = 3.0


def nonzero_mask(image: np.ndarray) -> np.ndarray:
    """Where any channel is non-zero, holes filled (a dark structure inside the body,
    e.g. air in the lungs, stays part of it)."""
    return ndimage.binary_fill_holes(np.any(image != 0, axis=0))


def nonzero_bbox(image: np.ndarray) -> list[list[int]]:
    """[[lo, hi), ...] per spatial axis of the voxels where any channel is non-zero."""
    mask = np.any(image != 0, axis=0)
    if not mask.any():  # an all-zero image keeps its full extent
        return [[0, n] for n in mask.shape]
    box = []
    for axis in range(mask.ndim):
        other = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=other))
        box.append([int(hits[0]), int(hits[-1]) + 1])
    return box


def crop(array: np.ndarray, bbox: list[list[int]]) -> np.ndarray:
    """Crop the last len(bbox) axes."""
    lead = (slice(None),) * (array.ndim - len(bbox))
    return array[lead + tuple(slice(lo, hi) for lo, hi in bbox)]


def _normalize_channel(
    channel: np.ndarray, scheme: str, use_mask: bool, props: dict, body: np.ndarray | None
) -> np.ndarray:
    if scheme == CT:
        channel = np.clip(channel, props["percentile_00_5"], props["percentile_99_5"])
        return (channel - props["mean"]) / max(props["std"], 1e-8)
    if scheme == NO_NORM:
        return channel
    if scheme == RESCALE_0_1:
        channel = channel - channel.min()
        return channel / max(float(channel.max()), 1e-8)
    if scheme == RGB_0_1:
        if channel.min() < 0 or channel.max() > 255:  # a user's data: one line, exit 2
            raise DataError(
                f"{RGB_0_1} needs values in [0, 255], got [{channel.min()}, {channel.max()}]"
            )
        return channel / 255.0
    if scheme != ZSCORE:
        raise ValueError(f"unknown normalization scheme {scheme!r}; known: {list(SCHEMES)}")
    if use_mask:
        assert body is not None  # made for every z-score channel that uses the mask
        values = channel[body]
        mean, std = (float(values.mean()), float(values.std())) if values.size else (0.0, 1.0)
        # outside the body the image was 0 in every channel: it stays 0
        return np.where(body, (channel - mean) / max(std, 1e-8), channel)
    return (channel - channel.mean()) / max(float(channel.std()), 1e-8)


def normalize(
    image: np.ndarray,
    schemes: tuple[str, ...],
    use_mask: tuple[bool, ...],
    fg_properties: list[dict[str, float]],
    seg: np.ndarray | None = None,
) -> np.ndarray:
    """Normalise each channel in place of a copy (float32).

    CT: clip to the dataset's foreground 0.5/99.5 percentiles, then the foreground mean/std.
    Z-score per case; with use_mask only the body counts (nonzero region with holes filled,
    plus any labelled voxel of `seg`: nnU-Net's seg >= 0). NoNormalization keeps values,
    RescaleTo01 maps the case's min/max to 0/1, RGBTo01 divides by 255.
    """
    out = np.empty_like(image, dtype=np.float32)
    body = None
    if any(m for s, m in zip(schemes, use_mask, strict=False) if s == ZSCORE):
        body = nonzero_mask(image)
        if seg is not None:
            body |= seg > 0
    for c in range(image.shape[0]):
        props = fg_properties[c] if c < len(fg_properties) else {}
        channel = image[c].astype(np.float32)
        out[c] = _normalize_channel(channel, schemes[c], use_mask[c], props, body)
    return out


def resampled_shape(
    shape: tuple[int, ...], spacing: tuple[float, ...], target_spacing: tuple[float, ...]
) -> tuple[int, ...]:
    return tuple(
        max(1, round(n * s / t)) for n, s, t in zip(shape, spacing, target_spacing, strict=True)
    )


def _thick_axis(spacing) -> int | None:
    """The one axis with the largest spacing, or None when two or three share it."""
    spacing = np.asarray(spacing, dtype=np.float64)
    axes = np.flatnonzero(spacing.max() / spacing == 1)
    return int(axes[0]) if len(axes) == 1 else None


def separate_z_axis(spacing, target_spacing) -> int | None:
    """nnU-Net's rule: the thick axis of the current spacing if its ratio is > 3, else of
    the target spacing if that one's is; None (resample all axes alike) otherwise or when
    the largest spacing is shared by two axes."""
    for s in (spacing, target_spacing):
        if max(s) / min(s) > ANISO_THRESHOLD:
            return _thick_axis(s)
    return None


def _resize(x: np.ndarray, shape: tuple[int, ...], order: int) -> np.ndarray:
    """skimage.transform.resize(x, shape, order, mode='edge', anti_aliasing=False) in
    float64: a voxel-centre-aligned spline zoom, clipped to the input's range."""
    x = np.asarray(x, dtype=np.float64)
    zoom = [1 / f for f in np.divide(x.shape, shape)]
    out = ndimage.zoom(x, zoom, order=order, mode="nearest", grid_mode=True)
    if order > 0:
        np.clip(out, x.min(), x.max(), out=out)
    return out


def nearest_indices(n_in: int, n_out: int) -> np.ndarray:
    """Input index of each output voxel centre by nearest neighbour (map_coordinates'
    rounding, as nnU-Net's order_z=0)."""
    coords = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    picked = ndimage.map_coordinates(
        np.arange(n_in, dtype=np.float64), coords[None], order=0, mode="nearest"
    )
    return picked.astype(np.int64)


def _resize_volume(volume, new_shape, axis: int | None, resize_fn) -> np.ndarray:
    """resize_fn over the whole volume, or per slice of `axis` then nearest along it."""
    if axis is None:
        return resize_fn(volume, tuple(new_shape))
    plane = tuple(n for a, n in enumerate(new_shape) if a != axis)
    slices = [resize_fn(np.take(volume, k, axis=axis), plane) for k in range(volume.shape[axis])]
    stacked = np.stack(slices, axis=axis)
    if volume.shape[axis] == new_shape[axis]:
        return stacked
    return np.take(stacked, nearest_indices(volume.shape[axis], new_shape[axis]), axis=axis)


def resample_image(
    image: np.ndarray,
    new_shape: tuple[int, ...],
    spacing: tuple[float, ...],
    target_spacing: tuple[float, ...],
    order: int = 3,
) -> np.ndarray:
    """(C, *new_shape) float32; separate z when separate_z_axis says so."""
    new_shape = tuple(int(n) for n in new_shape)
    if tuple(image.shape[1:]) == new_shape:
        return image.astype(np.float32, copy=True)
    axis = separate_z_axis(spacing, target_spacing)
    out = np.empty((image.shape[0], *new_shape), dtype=np.float32)
    for c in range(image.shape[0]):
        out[c] = _resize_volume(image[c], new_shape, axis, lambda v, s: _resize(v, s, order))
    return out


def _resize_labels(seg: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Each label's indicator resized linearly, the per-voxel argmax; exact ties go to the
    nearest neighbour's label when it is among the tied, else to the lowest label
    (batchgenerators' resize_segmentation, order 1, tiebreak 'nearest')."""
    labels = np.unique(seg)
    if len(labels) == 1:
        return np.full(shape, labels[0], dtype=seg.dtype)
    nearest = _resize(seg, shape, 0)
    best = _resize(seg == labels[0], shape, 1)
    win, nn_score = np.full(shape, labels[0], seg.dtype), np.zeros(shape)
    for i, value in enumerate(labels):
        score = best if i == 0 else _resize(seg == value, shape, 1)
        if i > 0:
            wins = score > best
            win[wins] = value
            np.maximum(best, score, out=best)
        is_nn = nearest == value
        nn_score[is_nn] = score[is_nn]
    nn_on_top = (nn_score == best) & (best > 0)
    win[nn_on_top] = nearest[nn_on_top].astype(seg.dtype)
    return win


def resample_seg(
    seg: np.ndarray,
    new_shape: tuple[int, ...],
    spacing: tuple[float, ...],
    target_spacing: tuple[float, ...],
) -> np.ndarray:
    """Label map at new_shape by _resize_labels (never a label that was not there);
    separate z: in-plane per slice, nearest neighbour along the thick axis."""
    new_shape = tuple(int(n) for n in new_shape)
    if tuple(seg.shape) == new_shape:
        return seg.copy()
    axis = separate_z_axis(spacing, target_spacing)
    return _resize_volume(seg, new_shape, axis, _resize_labels)
