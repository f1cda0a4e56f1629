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
it cost up to 0.07 lesion Dice per fold (bench/history.md, "the export to the raw geometry").
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.data.case_ops import nearest_indices, separate_z_axis
from trainer.data.image_io import encode_like
from trainer.schema.atomic import atomic_write_bytes

PROBABILITIES_KEY = "probabilities"
TINY = float(np.finfo(np.float32).tiny)  # log(0) guard: a class the network rules out stays ~0
SLAB_BYTES = 32 * 2**20  # log-probabilities of one output slab: the export's working memory


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
    probs = _as_tensor(probabilities)
    cropped_shape = tuple(int(n) for n in properties["shape_after_cropping_and_before_resampling"])
    full_shape = tuple(int(n) for n in properties["shape_before_cropping"])
    region = tuple(slice(lo, hi) for lo, hi in properties["bbox_used_for_cropping"])
    values = np.asarray(sorted(int(v) for v in label_values))
    segmentation = np.zeros(full_shape, dtype=label_dtype(values))
    full = None
    if keep_probabilities:
        full = np.zeros((probs.shape[0], *full_shape), dtype=np.float32)
        full[0] = 1.0  # outside the crop: background for sure (it was all zero)
    axis = None
    if tuple(probs.shape[1:]) != cropped_shape:
        axis = separate_z_axis(properties["spacing_after_resampling"], properties["spacing"])
    resample_to_labels(
        probs,
        values,
        segmentation[region],
        None if full is None else full[(slice(None), *region)],
        axis,
    )
    backward = transpose_backward(properties)
    if backward:  # the stored data was transposed: back to the raw image's axis order
        segmentation = np.ascontiguousarray(segmentation.transpose(backward))
        if full is not None:
            full = np.ascontiguousarray(full.transpose(0, *(a + 1 for a in backward)))
    return RawPrediction(segmentation, full)


def _axis_weights(
    n_in: int, n_out: int, nearest: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index along one axis: the two input indices and the second's weight.
    Linear: voxel centres aligned, edges clamped (skimage resize order 1 mode 'edge', as
    nnU-Net resamples; torch's align_corners=False); nearest: nnU-Net's order_z=0."""
    if nearest or n_in == n_out:
        index = nearest_indices(n_in, n_out) if n_in != n_out else np.arange(n_out)
        return index, index, np.zeros(n_out, dtype=np.float32)
    src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
    low = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    return low, np.minimum(low + 1, n_in - 1), (src - low).astype(np.float32)


def resample_to_labels(
    probs: torch.Tensor,
    values: np.ndarray,
    segmentation: np.ndarray,
    full: np.ndarray | None,
    separate_axis: int | None,
) -> None:
    """Write values[argmax] of probs (K, *in) resampled to segmentation's shape into
    `segmentation` (and the renormalised probabilities into `full` (K, *out)), slab by
    slab along the first axis (the thick one for separate z), so no (K, *out) array is
    ever whole in memory: linear in log space in-plane, linear or nearest along the slab
    axis (nnU-Net's rule for the thick axis). float32 (nnU-Net: float64): labels can only
    differ where two classes' resampled logits tie to ~1e-6 (tests/test_predict_geometry)."""
    if probs.ndim == 3:  # 2D: one slice deep
        probs, segmentation = probs[:, None], segmentation[None]
        full = None if full is None else full[:, None]
        separate_axis = None if separate_axis is None else separate_axis + 1
    axis = separate_axis or 0
    probs = probs.movedim(1 + axis, 1)
    segmentation = np.moveaxis(segmentation, axis, 0)
    full = None if full is None else np.moveaxis(full, 1 + axis, 1)
    n_out, plane = segmentation.shape[0], tuple(segmentation.shape[1:])
    low, high, weight = _axis_weights(probs.shape[1], n_out, separate_axis is not None)
    rows = max(1, SLAB_BYTES // (4 * probs.shape[0] * math.prod(plane)))
    for start in range(0, n_out, rows):
        stop = min(start + rows, n_out)
        first, last = int(low[start:stop].min()), int(high[start:stop].max()) + 1
        # (slices, K, *plane): the input slices this slab needs, in log space, in-plane
        part = probs[:, first:last].clamp_min(TINY).log_().transpose(0, 1).contiguous()
        if tuple(part.shape[2:]) != plane:
            part = F.interpolate(part, size=plane, mode="bilinear", align_corners=False)
        scores = part[torch.from_numpy(low[start:stop] - first)]
        w = torch.from_numpy(weight[start:stop]).view(-1, 1, 1, 1)
        if bool((w > 0).any()):
            scores.mul_(1 - w).add_(part[torch.from_numpy(high[start:stop] - first)] * w)
        segmentation[start:stop] = values[_first_argmax(scores).numpy()]
        if full is not None:
            full[:, start:stop] = scores.softmax(1).transpose(0, 1).numpy()


def _first_argmax(scores: torch.Tensor) -> torch.Tensor:
    """argmax over dim 1 of (n, K, ...) (the first class on ties) as a running maximum:
    torch's argmax across a short middle axis is a strided reduction ~10x slower on CPU."""
    index = torch.zeros((scores.shape[0], *scores.shape[2:]), dtype=torch.int64)
    best = scores[:, 0].clone()
    for k in range(1, scores.shape[1]):
        wins = scores[:, k] > best
        index.masked_fill_(wins, k)
        torch.maximum(best, scores[:, k], out=best)
    return index


def _as_tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array.detach().to("cpu", torch.float32)
    return torch.from_numpy(np.asarray(array, dtype=np.float32))


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
