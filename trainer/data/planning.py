"""Experiment planning: fingerprint + dataset.json -> Plans (nnU-Net-like rules, CPU-sized).

- target spacing: median spacing; if the coarsest axis is > 3x the others and few voxels
  long, its 10th-percentile spacing instead (nnU-Net's anisotropy rule);
- patch size: the median image shape, shrunk uniformly to a voxel budget small enough
  to train on a CPU (3D 48x64x64, 2D 64x64), then rounded to the pooling divisor;
- topology: pool an axis while its feature map stays >= 4 voxels and its spacing is
  within 2x the finest; kernel 1 on axes whose spacing is still > 2x the finest;
- batch size: 3D 2; 2D from a voxels-per-batch budget; never more than 5 % of the
  dataset's voxels per batch (at least 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from trainer.data.case_ops import CT, ZSCORE
from trainer.plans import (
    ConfigurationPlan,
    NetworkPlan,
    Plans,
    plans_labels,
    regions_order,
    with_identity,
)
from trainer.schema import DEFAULT_PLANS

ANISO_THRESHOLD = 3.0
MIN_FEATURE_MAP = 4
BASE_FEATURES = 32
MAX_FEATURES = {2: 512, 3: 320}
MAX_STAGES = {2: 7, 3: 6}
PATCH_VOXEL_BUDGET = {2: 64 * 64, 3: 48 * 64 * 64}
BATCH_3D = 2
VOXELS_PER_BATCH_2D = 16 * 64 * 64
MAX_BATCH_2D = 32
MAX_DATASET_FRACTION_PER_BATCH = 0.05
CONFIGURATIONS = ("2d", "3d_fullres")


class PlanningError(ValueError):
    """A user override that cannot work (message is one line)."""


@dataclass(frozen=True)
class Overrides:
    patch_size: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per configuration
    batch_size: dict[str, int] = field(default_factory=dict)


def target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> tuple[float, float, float]:
    """Median spacing, with nnU-Net's rule for one very coarse axis of few voxels."""
    spacing = np.median(spacings, axis=0)
    size = np.median(shapes, axis=0)
    worst = int(np.argmax(spacing))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = spacing[worst] > ANISO_THRESHOLD * max(spacing[others])
    aniso_voxels = size[worst] * ANISO_THRESHOLD < min(size[others])
    if aniso_spacing and aniso_voxels:
        tenth = float(np.percentile(spacings[:, worst], 10))
        # Never finer than the other axes: that would only invent slices.
        if tenth < max(spacing[others]):
            tenth = float(max(spacing[others])) + 1e-5
        spacing[worst] = tenth
    return tuple(float(s) for s in spacing)


def plan_network(patch_size: tuple[int, ...], spacing: tuple[float, ...]) -> NetworkPlan:
    ndim = len(patch_size)
    size = [float(p) for p in patch_size]
    current = [float(s) for s in spacing]
    strides = [(1,) * ndim]
    kernels = []
    kernel = [1] * ndim
    while True:
        finest = min(current)
        kernel = [3 if (k == 3 or current[a] <= 2 * finest) else 1 for a, k in enumerate(kernel)]
        kernels.append(tuple(kernel))
        if len(strides) >= MAX_STAGES[ndim]:
            break
        poolable = [a for a in range(ndim) if size[a] >= 2 * MIN_FEATURE_MAP]
        if not poolable:
            break
        finest_poolable = min(current[a] for a in poolable)
        stride = tuple(
            2 if a in poolable and current[a] <= 2 * finest_poolable else 1 for a in range(ndim)
        )
        if all(s == 1 for s in stride):
            break
        strides.append(stride)
        size = [n / s for n, s in zip(size, stride, strict=True)]
        current = [c * s for c, s in zip(current, stride, strict=True)]
    num_stages = len(strides)
    features = tuple(min(BASE_FEATURES * 2**i, MAX_FEATURES[ndim]) for i in range(num_stages))
    return NetworkPlan(
        features_per_stage=features,
        kernel_sizes=tuple(kernels[:num_stages]),
        strides=tuple(strides),
        n_conv_per_stage_encoder=(2,) * num_stages,
        n_conv_per_stage_decoder=(2,) * (num_stages - 1),
    )


def plan_patch(median_shape: tuple[float, ...], spacing: tuple[float, ...]) -> tuple[int, ...]:
    """Shrink the median shape uniformly to the budget, then round to the pooling divisor."""
    ndim = len(median_shape)
    shape = np.asarray(median_shape, dtype=np.float64)
    budget = PATCH_VOXEL_BUDGET[ndim]
    if shape.prod() > budget:
        shape = shape * (budget / shape.prod()) ** (1.0 / ndim)
    patch = tuple(max(1, round(s)) for s in shape)
    for _ in range(8):  # the divisor depends on the patch: iterate to a fixed point
        divisor = plan_network(patch, spacing).pooling_divisor
        rounded = tuple(max(d, round(s / d) * d) for s, d in zip(shape, divisor, strict=True))
        if rounded == patch:
            break
        patch = rounded
    return patch


def _batch_size(ndim: int, patch: tuple[int, ...], dataset_voxels: float) -> int:
    patch_voxels = math.prod(patch)
    batch = BATCH_3D if ndim == 3 else min(MAX_BATCH_2D, VOXELS_PER_BATCH_2D // patch_voxels)
    cap = int(MAX_DATASET_FRACTION_PER_BATCH * dataset_voxels // patch_voxels)
    return max(2, min(batch, cap))


@dataclass(frozen=True)
class _DatasetGeometry:
    """What every configuration plans from: after cropping, resampled to `spacing`."""

    spacing: tuple[float, ...]
    median_shape: tuple[float, ...]
    dataset_voxels: float


def _dataset_geometry(fingerprint: dict) -> _DatasetGeometry:
    spacings = np.asarray(fingerprint["spacings"], dtype=np.float64)
    shapes = np.asarray(fingerprint["shapes_after_crop"], dtype=np.float64)
    spacing = target_spacing(spacings, shapes)
    resampled = shapes * spacings / np.asarray(spacing)
    median_shape = tuple(float(v) for v in np.median(resampled, axis=0))
    dataset_voxels = float(resampled.prod(axis=1).sum())
    return _DatasetGeometry(spacing, median_shape, dataset_voxels)


def _normalization(
    fingerprint: dict, channel_names: list[str]
) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """(scheme per channel, use the nonzero mask per channel)."""
    schemes = tuple(CT if name.upper() == "CT" else ZSCORE for name in channel_names)
    shrank = fingerprint["median_relative_size_after_cropping"] < 0.75
    use_mask = tuple(scheme != CT and shrank for scheme in schemes)
    return schemes, use_mask


def _checked_patch(
    name: str, ndim: int, geometry: _DatasetGeometry, overrides: Overrides
) -> tuple[tuple[int, ...], NetworkPlan]:
    """The planned (or overridden) patch and its network; PlanningError with a divisible
    suggestion when an overridden patch does not fit the network's pooling."""
    config_spacing = geometry.spacing[-ndim:]
    config_median = geometry.median_shape[-ndim:]
    patch = overrides.patch_size.get(name) or plan_patch(config_median, config_spacing)
    network = plan_network(patch, config_spacing)
    divisor = network.pooling_divisor
    if len(patch) != ndim or any(p % d for p, d in zip(patch, divisor, strict=True)):
        suggestion = tuple(max(d, round(p / d) * d) for p, d in zip(patch, divisor, strict=True))
        raise PlanningError(
            f"patch size {list(patch)} for {name} is not divisible by the network's "
            f"pooling {list(divisor)}; try --patch-size {' '.join(map(str, suggestion))}"
        )
    return patch, network


def plan_experiment(
    fingerprint: dict,
    dataset_json: dict,
    dataset_name: str,
    configurations: tuple[str, ...] = CONFIGURATIONS,
    overrides: Overrides | None = None,
    plans_name: str = DEFAULT_PLANS,
) -> Plans:
    overrides = overrides or Overrides()
    geometry = _dataset_geometry(fingerprint)
    channel_names = [
        dataset_json["channel_names"][k] for k in sorted(dataset_json["channel_names"], key=int)
    ]
    schemes, use_mask = _normalization(fingerprint, channel_names)
    planned = {}
    for name in configurations:
        if name not in CONFIGURATIONS:
            raise PlanningError(
                f"unknown configuration {name!r}; choose from {', '.join(CONFIGURATIONS)}"
            )
        ndim = 2 if name == "2d" else 3
        patch, network = _checked_patch(name, ndim, geometry, overrides)
        batch = overrides.batch_size.get(name) or _batch_size(ndim, patch, geometry.dataset_voxels)
        planned[name] = ConfigurationPlan(
            name=name,
            data_identifier=f"{plans_name}_{name}",
            patch_size=tuple(int(p) for p in patch),
            batch_size=int(batch),
            spacing=geometry.spacing,
            normalization_schemes=schemes,
            use_mask_for_norm=use_mask,
            network=network,
            median_image_size=tuple(round(v) for v in geometry.median_shape),
        )
    plans = Plans(
        dataset_name=dataset_name,
        plans_name=plans_name,
        configurations=planned,
        num_input_channels=len(channel_names),
        labels=plans_labels(dataset_json["labels"]),
        regions_class_order=regions_order(dataset_json.get("regions_class_order")),
        identity="",
        foreground_intensity_properties=fingerprint["foreground_intensity_properties_per_channel"],
    )
    return with_identity(plans)


def parse_overrides(patch: list[int] | None, batch: list[str] | None, configs) -> Overrides:
    """--patch-size / --batch-size of nnui-preprocess; PlanningError (one line) if unusable."""
    patch_sizes, batch_sizes = {}, {}
    if patch is not None and any(p < 1 for p in patch):
        raise PlanningError(f"--patch-size {' '.join(map(str, patch))}: every size must be >= 1")
    if patch:
        matching = [c for c in configs if (2 if c == "2d" else 3) == len(patch)]
        if not matching:
            raise PlanningError(
                f"--patch-size with {len(patch)} values matches no configuration in {list(configs)}"
            )
        patch_sizes = {c: tuple(patch) for c in matching}
    for entry in batch or []:
        config, _, value = entry.rpartition("=")
        if not value.isdigit() or int(value) < 1:
            raise PlanningError(f"--batch-size {entry!r}: expected N or CONFIG=N with N >= 1")
        for c in [config] if config else configs:
            if c not in configs:
                raise PlanningError(f"--batch-size {entry!r}: {c!r} is not among {list(configs)}")
            batch_sizes[c] = int(value)
    return Overrides(patch_sizes, batch_sizes)
