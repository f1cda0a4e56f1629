"""Per-case array operations of preprocessing: crop to nonzero, normalise, resample.

Pure numpy/scipy functions on (C, Z, Y, X) images and (Z, Y, X) segmentations.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

CT = "CTNormalization"
ZSCORE = "ZScoreNormalization"


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


def normalize(
    image: np.ndarray,
    schemes: tuple[str, ...],
    use_mask: tuple[bool, ...],
    fg_properties: list[dict[str, float]],
) -> np.ndarray:
    """Normalise each channel in place of a copy (float32).

    CT: clip to the dataset's foreground 0.5/99.5 percentiles, then the foreground mean/std.
    Otherwise z-score per case; with use_mask only the nonzero region counts, and voxels
    outside it are set to 0 (they were background before cropping).
    """
    out = np.empty_like(image, dtype=np.float32)
    nonzero = np.any(image != 0, axis=0)
    for c in range(image.shape[0]):
        channel = image[c].astype(np.float32)
        if schemes[c] == CT:
            props = fg_properties[c]
            channel = np.clip(channel, props["percentile_00_5"], props["percentile_99_5"])
            channel = (channel - props["mean"]) / max(props["std"], 1e-8)
        elif use_mask[c]:
            values = channel[nonzero]
            mean, std = (float(values.mean()), float(values.std())) if values.size else (0.0, 1.0)
            channel = np.where(nonzero, (channel - mean) / max(std, 1e-8), 0.0)
        else:
            channel = (channel - channel.mean()) / max(float(channel.std()), 1e-8)
        out[c] = channel
    return out


def resampled_shape(
    shape: tuple[int, ...], spacing: tuple[float, ...], target_spacing: tuple[float, ...]
) -> tuple[int, ...]:
    return tuple(
        max(1, round(n * s / t)) for n, s, t in zip(shape, spacing, target_spacing, strict=True)
    )


def _resample(volume: np.ndarray, new_shape: tuple[int, ...], order: int) -> np.ndarray:
    """Voxel-centre-aligned resampling of one 3D volume to new_shape."""
    if tuple(volume.shape) == tuple(new_shape):
        return volume.astype(np.float32, copy=True)
    scale = np.array(volume.shape, dtype=np.float64) / np.array(new_shape, dtype=np.float64)
    # Output voxel centre i maps to input coordinate (i + 0.5) * scale - 0.5.
    return ndimage.affine_transform(
        volume.astype(np.float32, copy=False),
        scale,
        offset=0.5 * scale - 0.5,
        output_shape=tuple(new_shape),
        order=order,
        mode="nearest",
        prefilter=order > 1,
    )


def resample_image(image: np.ndarray, new_shape: tuple[int, ...], order: int = 3) -> np.ndarray:
    return np.stack([_resample(c, new_shape, order) for c in image])


def resample_seg(
    seg: np.ndarray, new_shape: tuple[int, ...], label_values: list[int]
) -> np.ndarray:
    """Resample each class as a soft mask (linear) and take the argmax.

    Never interpolates label values, so no class can appear that was not there.
    """
    if tuple(seg.shape) == tuple(new_shape):
        return seg.copy()
    values = sorted(set(label_values) | {0})
    best = np.full(new_shape, -1.0, dtype=np.float32)
    out = np.zeros(new_shape, dtype=seg.dtype)
    for value in values:
        present = seg == value
        if not present.any():
            continue
        soft = _resample(present.astype(np.float32), new_shape, order=1)
        win = soft > best
        out[win] = value
        best[win] = soft[win]
    return out
