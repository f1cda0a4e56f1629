"""`nnui-preprocess D -pl nnuiCPUPlanner`: small plans a CPU trains in minutes (nnuiCPUPlans).

The demo, the tests and the CPU benchmarks ask for these by name; the default planner is
nnU-Net's (trainer.planning.rules). Rules, nnU-Net-like but CPU-sized:

- target spacing: nnU-Net's (median, or the anisotropy rule), no transpose;
- configurations: 2d and 3d_fullres; 2d only for 2D data (one slice), as nnU-Net;
- patch size: the median image shape, shrunk uniformly to a voxel budget small enough
  to train on a CPU (3D 48x64x64, 2D 64x64), then rounded to the pooling divisor;
- topology: pool an axis while its feature map stays >= 4 voxels and its spacing is
  within 2x the finest; kernel 1 on axes whose spacing is still > 2x the finest;
- batch size: 3D 2; 2D from a voxels-per-batch budget; never more than 5 % of the
  dataset's voxels per batch (at least 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import numpy as np

from trainer.planning.plans import (
    ConfigurationPlan,
    NetworkPlan,
    Plans,
    plans_labels,
    regions_order,
    with_identity,
)
from trainer.planning.rules import (
    CPU_PLANNER,
    CPU_PLANS,
    DEFAULT_NET,
    Overrides,
    PlanningError,
    estimate_gb,
    normalization,
    target_spacing,
)
from trainer.planning.topology import feature_map_voxels

MIN_FEATURE_MAP = 4
BASE_FEATURES = 32
MAX_FEATURES = {2: 512, 3: 320}
MAX_STAGES = {2: 7, 3: 6}
PATCH_VOXEL_BUDGET = {2: 64 * 64, 3: 48 * 64 * 64}
BATCH_3D = 2
VOXELS_PER_BATCH_2D = 16 * 64 * 64
MAX_BATCH_2D = 32
MAX_DATASET_FRACTION_PER_BATCH = 0.05
CPU_CONFIGURATIONS = ("2d", "3d_fullres")


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


def _dataset_geometry(fingerprint: dict, spacing_override=None) -> _DatasetGeometry:
    spacings = np.asarray(fingerprint["spacings"], dtype=np.float64)
    shapes = np.asarray(fingerprint["shapes_after_crop"], dtype=np.float64)
    spacing = target_spacing(spacings, shapes)
    if spacing_override is not None:
        spacing = cast("tuple[float, float, float]", tuple(float(s) for s in spacing_override))
    resampled = shapes * spacings / np.asarray(spacing)
    median_shape = tuple(float(v) for v in np.median(resampled, axis=0))
    dataset_voxels = float(resampled.prod(axis=1).sum())
    return _DatasetGeometry(spacing, median_shape, dataset_voxels)


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


def _cpu_configurations(
    asked: tuple[str, ...] | None, median_shape: tuple[float, ...], dataset_name: str
) -> tuple[str, ...]:
    """The configurations to plan: 2d only for 2D data (one slice), as nnU-Net plans."""
    for name in asked or ():
        if name not in CPU_CONFIGURATIONS:
            choices = ", ".join(CPU_CONFIGURATIONS)
            raise PlanningError(f"unknown configuration {name!r} for {CPU_PLANNER}: {choices}")
    flat = median_shape[0] == 1
    if flat and asked and "3d_fullres" in asked:
        raise PlanningError(
            f"{dataset_name} holds 2D images (median shape {[round(v) for v in median_shape]}): "
            "there is no 3d_fullres for 2D data; use -c 2d"
        )
    return ("2d",) if flat else asked or CPU_CONFIGURATIONS


def plan_cpu(
    fingerprint: dict,
    dataset_json: dict,
    dataset_name: str,
    configurations: tuple[str, ...] | None = None,
    overrides: Overrides | None = None,
    plans_name: str = CPU_PLANS,
    spacing_override: tuple[float, ...] | None = None,
) -> Plans:
    """The CPU plans of `configurations` (None: 2d and 3d_fullres)."""
    overrides = overrides or Overrides()
    geometry = _dataset_geometry(fingerprint, spacing_override)
    channel_names = [
        dataset_json["channel_names"][k] for k in sorted(dataset_json["channel_names"], key=int)
    ]
    schemes, use_mask = normalization(fingerprint, channel_names)
    planned = {}
    for name in _cpu_configurations(configurations, geometry.median_shape, dataset_name):
        ndim = 2 if name == "2d" else 3
        patch, network = _checked_patch(name, ndim, geometry, overrides)
        batch = overrides.batch_size.get(name) or _batch_size(ndim, patch, geometry.dataset_voxels)
        planned[name] = ConfigurationPlan(
            name=name,
            data_identifier=f"{plans_name}_{name}",
            patch_size=tuple(int(p) for p in patch),
            batch_size=int(batch),
            spacing=geometry.spacing[-ndim:],
            normalization_schemes=schemes,
            use_mask_for_norm=use_mask,
            network=network,
            median_image_size=tuple(round(v) for v in geometry.median_shape[-ndim:]),
            # nnU-Net's estimate, for the launch form (nothing here is sized by it)
            gpu_memory_gb=round(
                estimate_gb(network, patch, batch, len(dataset_json["labels"]), DEFAULT_NET), 3
            ),
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


# The CPU cost of a training step, measured (bench/history.md, "Network step alone"): 25.4
# CPU-s for batch 2 of 64x80x80 through a 5-stage U-Net (features 32-320), whose patch has
# 109,900,800 feature-map voxels. Other plans scale by their feature-map voxels x batch.
CPU_SECONDS_PER_FEATURE_VOXEL = 25.4 / (2 * 109_900_800)
# A step of at most the CPU planner's 3d budget at batch 2 counts as CPU-sized.
CPU_STEP_VOXELS = 2 * PATCH_VOXEL_BUDGET[3]


def cpu_epoch_note(cplan, num_classes: int, iterations: int, cores: int) -> str | None:
    """One line for training GPU-sized plans on a CPU: the expected time per epoch; None
    for CPU-sized plans."""
    if math.prod(cplan.patch_size) * cplan.batch_size <= CPU_STEP_VOXELS:
        return None
    voxels = feature_map_voxels(cplan.network, cplan.patch_size, num_classes) * cplan.batch_size
    step = voxels * CPU_SECONDS_PER_FEATURE_VOXEL / max(1, cores)
    epoch = step * iterations
    took = f"{epoch / 3600:.1f} h" if epoch >= 3600 else f"{epoch / 60:.0f} min"
    return (
        f"note: {cplan.name} (patch {list(cplan.patch_size)}, batch {cplan.batch_size}) is "
        f"sized for a GPU; on {cores} CPU cores an epoch of {iterations} iterations takes "
        f"about {took} ({step:.0f} s/iteration: 25.4 CPU-s measured for 2x64x80x80, scaled "
        f"by feature-map voxels); CPU-sized plans: nnui-preprocess -pl {CPU_PLANNER}"
    )
