"""Predictions back to the raw geometry for any labels (trainer.data.labels).

Plain labels and the ignore label go through trainer.inference.export.to_raw_geometry
with the values the network predicts (never the ignore label). Regions: the sigmoid
probabilities are resampled as logits (linear, as nnU-Net resamples its logits), turned
back into probabilities, thresholded at 0.5 and written in regions_class_order; outside
the crop every region is absent (probability 0, background).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.data.case_ops import resample_image
from trainer.data.labels import LabelSpec
from trainer.inference.export import RawPrediction, to_raw_geometry

EPS = 1e-7  # logit guard: a probability of exactly 0 or 1 stays finite


def _numpy(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):
        array = array.detach().float().cpu().numpy()
    return np.asarray(array, dtype=np.float32)


def resample_sigmoid(
    probs: np.ndarray, shape: tuple[int, ...], spacing: Any, raw_spacing: Any
) -> np.ndarray:
    """Per-region probabilities at `shape`, resampled linearly in logit space (nnU-Net's
    separate-z rule: nearest along a thick axis), as the softmax path does."""
    clipped = np.clip(probs.astype(np.float64), EPS, 1 - EPS)
    logits = resample_image(
        np.log(clipped) - np.log1p(-clipped), shape, spacing, raw_spacing, order=1
    )
    return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)


def export_raw(
    probabilities: Any,
    properties: dict[str, Any],
    spec: LabelSpec,
    keep_probabilities: bool = False,
) -> RawPrediction:
    """RawPrediction (segmentation in the raw image's shape) for these labels."""
    if not spec.has_regions:
        return to_raw_geometry(probabilities, properties, spec.all_labels, keep_probabilities)
    probs = _numpy(probabilities)
    cropped_shape = tuple(int(n) for n in properties["shape_after_cropping_and_before_resampling"])
    full_shape = tuple(int(n) for n in properties["shape_before_cropping"])
    if tuple(probs.shape[1:]) != cropped_shape:
        spacings = (properties["spacing_after_resampling"], properties["spacing"])
        probs = resample_sigmoid(probs, cropped_shape, *spacings)
    region = tuple(slice(lo, hi) for lo, hi in properties["bbox_used_for_cropping"])
    inside = spec.to_segmentation(probs)
    segmentation = np.zeros(full_shape, dtype=inside.dtype)
    segmentation[region] = inside
    full = None
    if keep_probabilities:
        full = np.zeros((probs.shape[0], *full_shape), dtype=np.float32)
        full[(slice(None), *region)] = probs
    return RawPrediction(segmentation, full)
