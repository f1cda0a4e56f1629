"""Predictions back to the raw geometry, and their files (written atomically).

`to_raw_geometry` undoes preprocessing for any case whose properties follow CASE.json
(nnui-preprocess writes them; `prepare.prepare_case` returns the same): log-probabilities
are resampled linearly to the cropped shape (nearest neighbour along the thick axis of an
anisotropic spacing, nnU-Net's rule) and normalised again (softmax), pasted into the
full image (background outside the crop) and turned into dataset.json's label values by
argmax. Final validation and nnui-predict share it.

Why log-probabilities: nnU-Net resamples the logits, and log p differs from the logits by
one term per voxel shared by all classes, so the argmax is nnU-Net's. Resampling the
probabilities themselves blurs a small structure's mass into its background neighbours:
on the accuracy bench's 2d demo (lesions of ~50 voxels, in-plane resampling 0.87 -> 0.78 mm)
it cost up to 0.07 lesion Dice per fold (bench/RESULTS.md, "the export to the raw geometry").
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.case_ops import resample_image
from trainer.data.image_io import encode_like
from trainer.schema import atomic_write_bytes

PROBABILITIES_KEY = "probabilities"
TINY = np.finfo(np.float32).tiny  # log(0) guard: a class the network rules out stays ~0


@dataclass(frozen=True)
class RawPrediction:
    segmentation: np.ndarray  # (Z, Y, X) label values, the raw image's shape
    probabilities: np.ndarray | None  # (K, Z, Y, X) float32, or None when not asked for


def transpose_backward(properties: dict[str, Any]) -> tuple[int, ...] | None:
    """The axis order back to the raw image's, for data preprocessing stored transposed
    (nnU-Net's transpose_forward, kept in the case properties); None: not transposed."""
    forward = properties.get("transpose_forward")
    if forward is None or list(forward) == sorted(forward):
        return None
    return tuple(int(a) for a in np.argsort(forward))


def raw_shape(properties: dict[str, Any]) -> list[int]:
    """The raw image's (Z, Y, X) shape: shape_before_cropping, in the raw axis order."""
    shape = [int(n) for n in properties["shape_before_cropping"]]
    backward = transpose_backward(properties)
    return [shape[a] for a in backward] if backward else shape


def label_dtype(label_values: Sequence[int] | np.ndarray) -> np.dtype:
    return np.dtype(np.uint8 if max(label_values) < 256 else np.uint16)


def to_raw_geometry(
    probabilities: Any,
    properties: dict[str, Any],
    label_values: Sequence[int],
    keep_probabilities: bool = False,
) -> RawPrediction:
    """Segmentation (and probabilities) in the raw image's shape.

    probabilities: (K, *shape_after_resampling), numpy or torch; class k is the k-th of
    the sorted label values.
    """
    probs = _as_numpy(probabilities)
    cropped_shape = tuple(int(n) for n in properties["shape_after_cropping_and_before_resampling"])
    full_shape = tuple(int(n) for n in properties["shape_before_cropping"])
    bbox = properties["bbox_used_for_cropping"]
    if tuple(probs.shape[1:]) != cropped_shape:
        spacings = (properties["spacing_after_resampling"], properties["spacing"])
        probs = _resample_log_space(probs, cropped_shape, *spacings)
    region = tuple(slice(lo, hi) for lo, hi in bbox)
    values = np.asarray(sorted(int(v) for v in label_values))
    segmentation = np.zeros(full_shape, dtype=label_dtype(values))
    segmentation[region] = values[np.argmax(probs, axis=0)]
    full = None
    if keep_probabilities:
        full = np.zeros((probs.shape[0], *full_shape), dtype=np.float32)
        full[0] = 1.0  # outside the crop: background for sure (it was all zero)
        full[(slice(None), *region)] = probs
    backward = transpose_backward(properties)
    if backward:  # the stored data was transposed: back to the raw image's axis order
        segmentation = np.ascontiguousarray(segmentation.transpose(backward))
        if full is not None:
            full = np.ascontiguousarray(full.transpose(0, *(a + 1 for a in backward)))
    return RawPrediction(segmentation, full)


def _resample_log_space(
    probs: np.ndarray,
    shape: tuple[int, ...],
    spacing: Sequence[float],
    raw_spacing: Sequence[float],
) -> np.ndarray:
    """Probabilities at `shape`: linear in log space (nnU-Net's logit resampling, with its
    separate-z rule: nearest along the thick axis), then a softmax over the classes, so
    they sum to 1 again."""
    log_probs = resample_image(
        np.log(np.maximum(probs, TINY)), shape, tuple(spacing), tuple(raw_spacing), 1
    )
    log_probs -= log_probs.max(axis=0, keepdims=True)
    np.exp(log_probs, out=log_probs)
    log_probs /= log_probs.sum(axis=0, keepdims=True)
    return log_probs.astype(np.float32, copy=False)


def _as_numpy(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):
        array = array.detach().float().cpu().numpy()
    return np.asarray(array, dtype=np.float32)


def probabilities_bytes(probabilities: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    arrays: dict[str, Any] = {PROBABILITIES_KEY: probabilities.astype(np.float32)}
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def write_prediction(
    out_dir: Path, case_id: str, prediction: RawPrediction, reference: Path, ending: str
) -> list[Path]:
    """`CASE<ending>` in that format with the geometry of `reference` (a raw image of the
    case; a 3D TIFF also gets its `CASE.json` spacing file), and `CASE.npz` when the
    prediction has probabilities. The segmentation goes last: its presence says the case
    is complete (--continue_prediction)."""
    written = []
    if prediction.probabilities is not None:
        npz = Path(out_dir) / f"{case_id}.npz"
        atomic_write_bytes(npz, probabilities_bytes(prediction.probabilities))
        written.append(npz)
    seg_path = Path(out_dir) / f"{case_id}{ending}"
    for path, data in encode_like(prediction.segmentation, reference, seg_path):
        atomic_write_bytes(path, data)
        written.append(path)
    return written
