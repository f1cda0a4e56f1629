"""Residual-encoder U-Net presets (nnU-Net 2.8's `nnUNetPlannerResEnc{M,L,XL}`).

A preset is a GPU-memory target. Planning follows nnU-Net's rules so that its users get the
same patch, batch and network for the same fingerprint:

- the patch starts with the aspect ratio of the target spacing at 256^3 (2d: 2048^2)
  voxels, clipped to the median image shape, and is padded to the network's divisor;
- the topology pools an axis while its feature map stays >= 8 voxels (4 after the last
  pool) and its spacing is within 2x the finest poolable one;
- the memory a patch needs is estimated as the number of feature-map voxels the network
  produces (the same count nnU-Net's `compute_conv_feature_map_size` makes); while it
  exceeds the preset's reference, the axis largest relative to the median shape shrinks
  by one divisor step;
- batch size from the remaining headroom, at most as many patches as the dataset has
  voxels (the presets cover up to 100 % of the dataset per batch), at least 2.

nnU-Net first moves the coarsest axis to the front; nnui plans in the stored (z, y, x) order,
which is the same whenever the coarsest axis is z (as in the demo and most MRI/CT data).
Only the 2d and 3d_fullres configurations are planned; their data is the default plans'
data (same spacing and normalisation), as nnU-Net's presets reuse `nnUNetPlans_<config>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainer.data.planning import (
    CONFIGURATIONS,
    MAX_FEATURES,
    Overrides,
    PlanningError,
    _normalization,
    target_spacing,
)
from trainer.plans import (
    RESIDUAL_ENCODER,
    ConfigurationPlan,
    NetworkPlan,
    Plans,
    plans_labels,
    regions_order,
    with_identity,
)
from trainer.schema import DEFAULT_PLANS

BASE_FEATURES = 32
MIN_FEATURE_MAP = 4
MIN_BATCH = 2
REFERENCE_BATCH = {2: 12, 3: 2}
BLOCKS_PER_STAGE_ENCODER = (1, 3, 4, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6)
CONVS_PER_STAGE_DECODER = 1
NO_POOL_LIMIT = 999999  # nnU-Net plans without a cap on the poolings per axis


@dataclass(frozen=True)
class Preset:
    """A GPU-memory target: the feature-map voxels that fit it per configuration."""

    plans_name: str
    vram_target_gb: int
    reference_3d: int  # feature-map voxels of a patch that fills the target at batch 2
    reference_2d: int  # ... at batch 12
    max_dataset_covered: float = 1.0

    def reference(self, ndim: int) -> int:
        return self.reference_2d if ndim == 2 else self.reference_3d


PRESETS = {
    "nnUNetPlannerResEncM": Preset("nnuiResEncUNetMPlans", 8, 680_000_000, 135_000_000),
    "nnUNetPlannerResEncL": Preset("nnuiResEncUNetLPlans", 24, 2_100_000_000, 380_000_000),
    "nnUNetPlannerResEncXL": Preset("nnuiResEncUNetXLPlans", 40, 3_600_000_000, 560_000_000),
}


@dataclass(frozen=True)
class Topology:
    strides: tuple[tuple[int, ...], ...]
    kernel_sizes: tuple[tuple[int, ...], ...]
    patch_size: tuple[int, ...]  # padded to `divisor`
    divisor: tuple[int, ...]


def _pad(shape, divisor) -> tuple[int, ...]:
    """The next multiple of `divisor` per axis (a multiple stays); float sizes allowed."""
    out = []
    for size, d in zip(shape, divisor, strict=True):
        padded = size + d - size % d
        out.append(int(padded - d if size % d == 0 else padded))
    return tuple(out)


def topology(spacing, patch_size) -> Topology:
    """Strides, kernels and the padded patch for a (possibly float) patch size."""
    ndim = len(spacing)
    current_spacing, size = [float(s) for s in spacing], [float(p) for p in patch_size]
    strides, kernels = [(1,) * ndim], []
    num_pool, kernel = [0] * ndim, [1] * ndim
    while True:
        axes = [a for a in range(ndim) if size[a] >= 2 * MIN_FEATURE_MAP]
        if not axes:
            break
        finest = min(current_spacing[a] for a in axes)
        axes = [a for a in axes if current_spacing[a] / finest < 2 and num_pool[a] < NO_POOL_LIMIT]
        # One axis alone is pooled only while it stays >= 3 * the minimum afterwards.
        if not axes or (len(axes) == 1 and size[axes[0]] < 3 * MIN_FEATURE_MAP):
            break
        overall_finest = min(current_spacing)
        kernel = [
            3 if k == 3 or s / overall_finest < 2 else 1
            for k, s in zip(kernel, current_spacing, strict=True)
        ]
        for a in axes:
            num_pool[a] += 1
            current_spacing[a] *= 2
            size[a] = math.ceil(size[a] / 2)
        strides.append(tuple(2 if a in axes else 1 for a in range(ndim)))
        kernels.append(tuple(kernel))
    kernels.append((3,) * ndim)  # the bottleneck always convolves every axis
    divisor = tuple(2**n for n in num_pool)
    return Topology(tuple(strides), tuple(kernels), _pad(patch_size, divisor), divisor)


def _features(num_stages: int, ndim: int) -> tuple[int, ...]:
    return tuple(min(MAX_FEATURES[ndim], BASE_FEATURES * 2**i) for i in range(num_stages))


def network_plan(top: Topology, ndim: int) -> NetworkPlan:
    num_stages = len(top.strides)
    return NetworkPlan(
        features_per_stage=_features(num_stages, ndim),
        kernel_sizes=top.kernel_sizes,
        strides=top.strides,
        n_conv_per_stage_encoder=BLOCKS_PER_STAGE_ENCODER[:num_stages],
        n_conv_per_stage_decoder=(CONVS_PER_STAGE_DECODER,) * (num_stages - 1),
        architecture=RESIDUAL_ENCODER,
    )


def feature_map_voxels(net: NetworkPlan, patch_size, num_classes: int) -> int:
    """Voxels of every conv output of the residual-encoder U-Net on one patch (encoder:
    stem, two convs per block, the projection of a block that changes shape; decoder:
    upsampling, its convs, the final segmentation head) — nnU-Net's memory estimate."""
    features = net.features_per_stage
    size = [int(p) for p in patch_size]
    total = features[0] * math.prod(size)  # stem
    in_features = features[0]
    skip_sizes = []
    for s, stride in enumerate(net.strides):
        after = [n // st for n, st in zip(size, stride, strict=True)]
        voxels = features[s] * math.prod(after)
        total += 2 * voxels * net.n_conv_per_stage_encoder[s]
        if in_features != features[s] or after != size:
            total += voxels  # the 1x1 projection of the skip
        in_features, size = features[s], after
        skip_sizes.append(after)
    for d in range(net.num_stages - 1):
        level = net.num_stages - 2 - d  # the encoder stage this decoder stage refines to
        voxels = math.prod(skip_sizes[level])
        total += features[level] * voxels * (net.n_conv_per_stage_decoder[d] + 1)
    return total + num_classes * math.prod(skip_sizes[0])


def _initial_patch(spacing, median_shape) -> list[float]:
    inverse = 1 / np.asarray(spacing, dtype=np.float64)
    edge = 256**3 if len(spacing) == 3 else 2048**2
    scaled = inverse * (edge / np.prod(inverse)) ** (1 / len(spacing))
    return [min(round(p), m) for p, m in zip(scaled, median_shape, strict=True)]


def _shrink(spacing, median_shape, top: Topology) -> Topology:
    """One step smaller along the axis largest relative to the median shape. The step is
    the divisor of the smaller patch (a step of the current divisor could skip sizes)."""
    patch = list(top.patch_size)
    axis = int(np.argsort([p / m for p, m in zip(patch, median_shape, strict=True)])[-1])
    probe = list(patch)
    probe[axis] -= top.divisor[axis]
    patch[axis] -= topology(spacing, probe).divisor[axis]
    return topology(spacing, patch)


def plan_patch_and_batch(preset: Preset, spacing, median_shape, num_classes: int,
                         dataset_voxels: float) -> tuple[Topology, int]:  # fmt: skip
    ndim = len(spacing)
    top = topology(spacing, _initial_patch(spacing, median_shape))
    reference = preset.reference(ndim)
    estimate = feature_map_voxels(network_plan(top, ndim), top.patch_size, num_classes)
    while estimate > reference:
        top = _shrink(spacing, median_shape, top)
        estimate = feature_map_voxels(network_plan(top, ndim), top.patch_size, num_classes)
    batch = round(reference / estimate * REFERENCE_BATCH[ndim])
    cap = round(dataset_voxels * preset.max_dataset_covered / math.prod(top.patch_size))
    return top, max(min(batch, cap), MIN_BATCH)


def _overridden(name: str, spacing, overrides: Overrides) -> Topology | None:
    patch = overrides.patch_size.get(name)
    if patch is None:
        return None
    top = topology(spacing, patch)
    if len(patch) != len(spacing) or top.patch_size != tuple(patch):
        raise PlanningError(
            f"patch size {list(patch)} for {name} is not divisible by the network's pooling "
            f"{list(top.divisor)}; try --patch-size {' '.join(map(str, top.patch_size))}"
        )
    return top


@dataclass(frozen=True)
class _Geometry:
    spacing: tuple[float, ...]
    median_shape: tuple[float, ...]  # median of the per-case resampled shapes (rounded)
    dataset_voxels: float


def _geometry(fingerprint: dict, num_training: int) -> _Geometry:
    spacings = np.asarray(fingerprint["spacings"], dtype=np.float64)
    shapes = np.asarray(fingerprint["shapes_after_crop"], dtype=np.float64)
    spacing = target_spacing(spacings, shapes)
    # nnU-Net rounds each case's resampled shape before taking the median
    resampled = [
        [round(s / t * n) for s, t, n in zip(sp, spacing, sh, strict=True)]
        for sp, sh in zip(spacings, shapes, strict=True)
    ]
    median = tuple(float(v) for v in np.median(np.asarray(resampled, dtype=np.float64), axis=0))
    return _Geometry(spacing, median, float(np.prod(median, dtype=np.float64) * num_training))


def _configuration(name: str, preset: Preset, geometry: _Geometry, num_classes: int,
                   overrides: Overrides) -> tuple[Topology, int]:  # fmt: skip
    ndim = 2 if name == "2d" else 3
    spacing, median = geometry.spacing[-ndim:], geometry.median_shape[-ndim:]
    top, batch = plan_patch_and_batch(preset, spacing, median, num_classes, geometry.dataset_voxels)
    top = _overridden(name, spacing, overrides) or top
    return top, overrides.batch_size.get(name) or batch


def plan_preset(fingerprint: dict, dataset_json: dict, dataset_name: str, planner: str,
                configurations: tuple[str, ...] = CONFIGURATIONS,
                overrides: Overrides | None = None) -> Plans:  # fmt: skip
    """The plans of one preset (PRESETS key); data identifiers are the default plans'."""
    preset, overrides = PRESETS[planner], overrides or Overrides()
    num_training = int(dataset_json.get("numTraining") or len(fingerprint["spacings"]))
    geometry = _geometry(fingerprint, num_training)
    names = dataset_json["channel_names"]
    channels = [names[k] for k in sorted(names, key=int)]
    schemes, use_mask = _normalization(fingerprint, channels)
    num_classes = len(dataset_json["labels"])
    planned = {}
    for name in configurations:
        if name not in CONFIGURATIONS:
            choices = ", ".join(CONFIGURATIONS)
            raise PlanningError(f"unknown configuration {name!r}; choose from {choices}")
        if name == "3d_fullres" and geometry.median_shape[0] == 1:
            continue  # a 2d dataset: nnU-Net plans no 3d configuration either
        top, batch = _configuration(name, preset, geometry, num_classes, overrides)
        planned[name] = ConfigurationPlan(
            name=name, data_identifier=f"{DEFAULT_PLANS}_{name}", patch_size=top.patch_size,
            batch_size=int(batch), spacing=geometry.spacing, normalization_schemes=schemes,
            use_mask_for_norm=use_mask, network=network_plan(top, 2 if name == "2d" else 3),
            median_image_size=tuple(round(v) for v in geometry.median_shape),
        )  # fmt: skip
    plans = Plans(
        dataset_name=dataset_name, plans_name=preset.plans_name, configurations=planned,
        num_input_channels=len(channels),
        labels=plans_labels(dataset_json["labels"]), identity="",
        regions_class_order=regions_order(dataset_json.get("regions_class_order")),
        foreground_intensity_properties=fingerprint["foreground_intensity_properties_per_channel"],
    )  # fmt: skip
    return with_identity(plans)
