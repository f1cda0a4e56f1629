"""One raw case preprocessed exactly as nnui-preprocess does for training.

Crop to the non-zero region of all channels, normalise with the plans' schemes, resample
to the configuration's spacing (2d keeps the case's own slice spacing). The properties
have the keys of preprocessing's CASE.json, so `export.to_raw_geometry` undoes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.case_ops import crop, nonzero_bbox, normalize, resample_image, resampled_shape
from trainer.data.image_io import ImageReadError, read_case, read_image
from trainer.inference.cases import InputCase, InputError
from trainer.planning.plans import ConfigurationPlan, Plans


@dataclass(frozen=True)
class PreparedCase:
    case: InputCase
    data: np.ndarray  # (C, z, y, x) float32 in the configuration's geometry
    properties: dict[str, Any]  # CASE.json keys: spacing, shape_before_cropping, bbox...


def read_channels(
    case: InputCase, fallback_spacing: tuple[float, ...] | None
) -> tuple[np.ndarray, tuple[float, ...]]:
    """(image (C, Z, Y, X) float32, spacing zyx); InputError for unreadable or odd files."""
    try:
        return read_case(case.image_files, fallback_spacing)
    except ImageReadError as exc:
        raise InputError(str(exc)) from None


def target_spacing(cplan: ConfigurationPlan, spacing: tuple[float, ...]) -> tuple[float, ...]:
    target = tuple(float(s) for s in cplan.spacing)
    if cplan.name == "2d":  # 2d keeps each case's own slice spacing (as preprocessing)
        target = (float(spacing[0]), *target[-2:])
    return target


def prepare_case(
    case: InputCase,
    plans: Plans,
    cplan: ConfigurationPlan,
    fallback_spacing: tuple[float, ...] | None = None,
    previous_stage_dir: Path | None = None,
) -> PreparedCase:
    """previous_stage_dir (a cascade): the previous stage's segmentation of the case there,
    preprocessed alike and appended one-hot (trainer.data.cascade)."""
    image, spacing = read_channels(case, fallback_spacing)
    forward = plans.transpose[0]
    if forward != (0, 1, 2):  # stored as nnU-Net stores it: the plans' axis order
        image = np.ascontiguousarray(image.transpose(0, *(a + 1 for a in forward)))
        spacing = tuple(spacing[a] for a in forward)
    raw_shape = [int(n) for n in image.shape[1:]]
    bbox = nonzero_bbox(image)
    fg = [
        plans.foreground_intensity_properties.get(str(c), {})
        for c in range(plans.num_input_channels)
    ]
    cropped = crop(image, bbox)  # a view: the raw image stays alive until normalised
    cropped_shape = tuple(int(n) for n in cropped.shape[1:])
    normalized = normalize(cropped, cplan.normalization_schemes, cplan.use_mask_for_norm, fg)
    del image, cropped
    target = target_spacing(cplan, spacing)
    new_shape = resampled_shape(cropped_shape, spacing, target)
    data = resample_image(normalized, new_shape, spacing, target)
    properties = {
        "case_id": case.case_id,
        "spacing": list(spacing),
        "shape_before_cropping": raw_shape,
        "bbox_used_for_cropping": bbox,
        "shape_after_cropping_and_before_resampling": list(cropped_shape),
        "spacing_after_resampling": list(target),
        "shape_after_resampling": list(new_shape),
    }
    if forward != (0, 1, 2):
        properties["transpose_forward"] = list(forward)
    if previous_stage_dir is not None:
        where = (bbox, new_shape, raw_shape, spacing, target, forward)
        data = _with_previous_stage(data, case, plans, where, previous_stage_dir)
    return PreparedCase(case, data, properties)


def _with_previous_stage(
    data: np.ndarray, case: InputCase, plans: Plans, where: tuple, folder: Path
) -> np.ndarray:
    from trainer.data.cascade import foreground_labels, one_hot
    from trainer.data.case_ops import resample_seg

    path = Path(folder) / f"{case.case_id}{case.ending}"
    try:
        previous = read_image(path)[0]
    except (ImageReadError, OSError) as exc:
        raise InputError(f"previous stage's segmentation of {case.case_id}: {exc}") from None
    bbox, new_shape, raw_shape, spacing, target, forward = where
    previous = previous.transpose(forward)  # the raw file's axes -> the plans' axis order
    if list(previous.shape) != list(raw_shape):
        raise InputError(f"{path}: shape {list(previous.shape)}, the image's is {raw_shape}")
    spec = plans.label_spec
    seg = resample_seg(crop(previous, bbox), new_shape, spacing, target)
    return np.concatenate([data, one_hot(seg, foreground_labels(spec))])
