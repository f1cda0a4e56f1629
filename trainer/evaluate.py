"""Final validation: sliding-window prediction on whole cases and `validation/summary.json`.

Windows overlap by half a patch; each window's logits are weighted by a Gaussian (sigma =
1/8 of the patch per axis) so window borders count less. 2d configurations predict slice
by slice. Dice is computed in the preprocessed space (spacing of the plans).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from trainer.events import finite_or_none
from trainer.schema import atomic_write_bytes


def window_starts(size: int, patch: int, step_fraction: float = 0.5) -> list[int]:
    """Window starts covering [0, size), at most step_fraction * patch apart."""
    if size <= patch:
        return [0]
    num_steps = math.ceil((size - patch) / (patch * step_fraction)) + 1
    step = (size - patch) / (num_steps - 1)
    return [round(i * step) for i in range(num_steps)]


@lru_cache(maxsize=8)
def _gaussian(patch: tuple[int, ...], sigma_scale: float = 1 / 8) -> np.ndarray:
    grids = np.meshgrid(*[np.arange(p, dtype=np.float64) for p in patch], indexing="ij")
    exponent = np.zeros(patch, dtype=np.float64)
    for grid, p in zip(grids, patch, strict=True):
        sigma = max(p * sigma_scale, 1e-6)
        exponent += ((grid - (p - 1) / 2) / sigma) ** 2
    weights = np.exp(-0.5 * exponent)
    weights /= weights.max()
    # Zero weights would divide by zero at the volume corners.
    weights[weights == 0] = weights[weights > 0].min()
    return weights.astype(np.float32)


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
        batch = torch.stack([images[(n, slice(None), *window)] for n, window in group])
        out = _predict_window(model, batch, mirror_axes)
        for j, (n, window) in enumerate(group):
            logits[(n, slice(None), *window)] += out[j] * weights
    logits /= norm
    if any(pad):
        crop = tuple(slice(a // 2, a // 2 + s) for a, s in zip(pad, spatial, strict=True))
        logits = logits[(slice(None), slice(None), *crop)]
    return logits


def predict_case(
    model: torch.nn.Module,
    image: np.ndarray,
    patch: Sequence[int],
    num_classes: int,
    device: torch.device,
    mirror: bool = False,
) -> torch.Tensor:
    """Softmax probabilities (K, Z, Y, X) for a preprocessed case image (C, Z, Y, X)."""
    volume = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32)).to(device)
    if len(patch) == 3:
        logits = sliding_window_logits(model, volume[None], patch, num_classes, mirror)[0]
    else:
        # 2d: the slices along the first spatial axis are a batch of images.
        slices = volume.permute(1, 0, 2, 3)  # (Z, C, Y, X)
        logits = sliding_window_logits(model, slices, patch, num_classes, mirror)
        logits = logits.permute(1, 0, 2, 3)  # (K, Z, Y, X)
    return torch.softmax(logits, dim=0)


def case_dice(
    prediction: np.ndarray, reference: np.ndarray, labels: Sequence[int]
) -> dict[str, float | None]:
    """Dice per foreground label; None when the label is absent from both (undefined)."""
    result: dict[str, float | None] = {}
    for label in labels:
        pred = prediction == label
        ref = reference == label
        tp = int(np.logical_and(pred, ref).sum())
        denominator = int(pred.sum()) + int(ref.sum())
        result[str(label)] = None if denominator == 0 else 2 * tp / denominator
    return result


def summarize(per_case: list[dict[str, Any]], labels: Sequence[int]) -> dict[str, Any]:
    """Mean Dice per class over cases (undefined cases skipped) and their foreground mean."""
    mean_per_class: dict[str, float | None] = {}
    for label in labels:
        values = [c["dice"][str(label)] for c in per_case if c["dice"].get(str(label)) is not None]
        mean_per_class[str(label)] = float(np.mean(values)) if values else None
    defined = [v for v in mean_per_class.values() if v is not None]
    return {
        "num_cases": len(per_case),
        "dice_per_class": mean_per_class,
        "mean_fg_dice": finite_or_none(float(np.mean(defined))) if defined else None,
        "per_case": sorted(per_case, key=lambda c: c["case_id"]),
    }


# Called once per predicted case, in order: (index among this rank's cases, case id,
# softmax probabilities (K, Z, Y, X) on the prediction device).
ProbabilitySink = Callable[[int, str, torch.Tensor], None]


@torch.inference_mode()
def validate_cases(
    model: torch.nn.Module,
    cases: Any,
    case_ids: Sequence[str],
    patch: Sequence[int],
    num_classes: int,
    device: torch.device,
    mirror: bool = False,
    on_probabilities: ProbabilitySink | None = None,
) -> list[dict[str, Any]]:
    """Per-case Dice for this rank's cases; probabilities go to `on_probabilities` (--npz)."""
    model.eval()
    labels = list(range(1, num_classes))
    results = []
    for index, case_id in enumerate(case_ids):
        image, seg, _props = cases.load_case(case_id)
        probs = predict_case(model, np.asarray(image), patch, num_classes, device, mirror)
        prediction = probs.argmax(0).cpu().numpy()
        reference = np.maximum(np.asarray(seg)[0], 0)
        results.append({"case_id": case_id, "dice": case_dice(prediction, reference, labels)})
        if on_probabilities is not None:
            on_probabilities(index, case_id, probs)
    return results


def write_probabilities(output_dir: Path, case_id: str, probs: torch.Tensor) -> Path:
    """CASE.npz with `probabilities` (float32, K x spatial), written atomically."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, probabilities=probs.detach().cpu().float().numpy())
    path = Path(output_dir) / f"{case_id}.npz"
    atomic_write_bytes(path, buffer.getvalue())
    return path
