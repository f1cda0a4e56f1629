"""One raw case preprocessed exactly as nnui-preprocess does for training.

Crop to the non-zero region of all channels, normalise with the plans' schemes, resample
to the configuration's spacing (2d keeps the case's own slice spacing). The properties
have the keys of preprocessing's CASE.json, so `export.to_raw_geometry` undoes either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.case_ops import crop, nonzero_bbox, normalize, resample_image, resampled_shape
from trainer.data.image_io import ImageReadError, read_image
from trainer.data.raw import SPACING_RTOL
from trainer.inference.cases import InputCase, InputError
from trainer.plans import ConfigurationPlan, Plans


@dataclass(frozen=True)
class PreparedCase:
    case: InputCase
    data: np.ndarray  # (C, z, y, x) float32 in the configuration's geometry
    properties: dict[str, Any]  # CASE.json keys: spacing, shape_before_cropping, bbox...


def read_channels(case: InputCase, fallback_spacing: tuple[float, ...] | None):
    """(image (C, Z, Y, X) float32, spacing zyx); InputError for unreadable or odd files."""
    try:
        channels = [read_image(path, fallback_spacing) for path in case.image_files]
    except ImageReadError as exc:
        raise InputError(str(exc)) from None
    shape, spacing = channels[0][0].shape, channels[0][1]
    for path, (data, channel_spacing) in zip(case.image_files, channels, strict=True):
        if data.shape != shape:
            raise InputError(
                f"{path}: shape {list(data.shape)} differs from channel 0's {list(shape)}"
            )
        if not np.allclose(channel_spacing, spacing, rtol=SPACING_RTOL):
            raise InputError(
                f"{path}: spacing {channel_spacing} differs from channel 0's {spacing}"
            )
        if not np.issubdtype(data.dtype, np.number):
            raise InputError(f"{path}: not a numeric image (dtype {data.dtype})")
        if not np.isfinite(data).all():
            raise InputError(f"{path}: image contains NaN or inf values")
    image = np.stack([c[0] for c in channels]).astype(np.float32, copy=False)
    return image, spacing


def target_spacing(cplan: ConfigurationPlan, spacing: tuple[float, ...]) -> tuple[float, ...]:
    target = tuple(float(s) for s in cplan.spacing)
    if cplan.name == "2d":  # 2d keeps each case's own slice spacing (as preprocessing)
        target = (float(spacing[0]), target[1], target[2])
    return target


def prepare_case(
    case: InputCase,
    plans: Plans,
    cplan: ConfigurationPlan,
    fallback_spacing: tuple[float, ...] | None = None,
) -> PreparedCase:
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
    data = resample_image(normalized, new_shape)
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
    return PreparedCase(case, data, properties)
