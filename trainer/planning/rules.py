"""The default planner: nnU-Net 2.8.1's ExperimentPlanner rules (plans nnuiPlans).

For the same fingerprint and dataset.json, `nnui-preprocess D` plans what
`nnUNetv2_plan_experiment -d D` writes to nnUNetPlans.json:

- target spacing: the median spacing; when one axis is > 3x coarser than the others and
  has < 1/3 of their voxels, its 10th percentile instead (never finer than the others);
- transpose: the coarsest axis of the target spacing goes first; spacing, shapes, patch
  and network are planned in that order (and the data is stored in it);
- per configuration (3d_fullres at that spacing; 2d on its last two axes; 3d_lowres at a
  spacing grown by 3 % steps, coarsest axes first, until the 3d_fullres-sized patch covers
  >= 25 % of the median image, kept only if that halves the voxels): the initial patch
  has the spacing's aspect ratio at 256^3 (2d 2048^2) voxels, clipped to the median shape;
  trainer.planning.topology gives the network; while the network's feature-map voxels at
  batch 2 exceed the reference for the memory target, the axis largest relative to the
  median shape shrinks by one divisor step; the batch uses the remaining headroom, covers
  at most 5 % of the dataset's voxels, and is at least 2;
- batch Dice: on for 2d, and for 3d_fullres when a 3d_lowres exists;
- normalisation by channel name (CT, noNorm, zscore, rescale_to_0_1, rgb_to_0_1, else
  z-score), with the nonzero mask when cropping shrank the median image below 3/4 and
  the scheme leaves the outside at zero (z-score only).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from trainer.planning.plans import (
    PLAIN,
    ConfigurationPlan,
    NetworkPlan,
    Plans,
    plans_labels,
    regions_order,
    with_identity,
)
from trainer.planning.topology import Topology, feature_map_voxels, topology
from trainer.schema.tree import DEFAULT_PLANS

DEFAULT_PLANNER = "ExperimentPlanner"  # nnU-Net's name for its default planner
# The small plans a CPU trains in minutes (the demo, tests, CPU benchmarks): a named
# choice, never the default. Other tools rely on these two names.
CPU_PLANNER = "nnuiCPUPlanner"
CPU_PLANS = "nnuiCPUPlans"
CONFIGURATIONS = ("2d", "3d_fullres", "3d_lowres")
CASCADE = "3d_cascade_fullres"
ANISO_THRESHOLD = 3.0
BASE_FEATURES = 32
MAX_FEATURES = {2: 512, 3: 320}
MIN_BATCH = 2
REFERENCE_BATCH = {2: 12, 3: 2}
DEFAULT_GPU_MEMORY_GB = 8.0
LOWRES_THRESHOLD = 0.25  # a 3d_lowres when the fullres patch covers less of the median
LOWRES_STEP = 1.03
NORMALIZATION = {  # dataset.json channel name (casefolded) -> nnU-Net's scheme
    "ct": "CTNormalization",
    "nonorm": "NoNormalization",
    "zscore": "ZScoreNormalization",
    "rescale_to_0_1": "RescaleTo01Normalization",
    "rgb_to_0_1": "RGBTo01Normalization",
}
ZSCORE = "ZScoreNormalization"
# nnU-Net's resampling settings (the functions are nnui's equivalents in case_ops).
RESAMPLING = {
    "resampling_fn_data": "resample_data_or_seg_to_shape",
    "resampling_fn_seg": "resample_data_or_seg_to_shape",
    "resampling_fn_data_kwargs": {"is_seg": False, "order": 3, "order_z": 0,
                                  "force_separate_z": None},
    "resampling_fn_seg_kwargs": {"is_seg": True, "order": 1, "order_z": 0,
                                 "force_separate_z": None},
    "resampling_fn_probabilities": "resample_data_or_seg_to_shape",
    "resampling_fn_probabilities_kwargs": {"is_seg": False, "order": 1, "order_z": 0,
                                           "force_separate_z": None},
}  # fmt: skip


class PlanningError(ValueError):
    """A user override that cannot work (message is one line)."""


@dataclass(frozen=True)
class Overrides:
    patch_size: dict[str, tuple[int, ...]] = field(default_factory=dict)  # per configuration
    batch_size: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlannerOptions:
    """nnU-Net's planner flags: -pl, -overwrite_plans_name, -gpu_memory_target,
    -overwrite_target_spacing (z, y, x before the transpose)."""

    planner: str = DEFAULT_PLANNER
    plans_name: str | None = None
    gpu_memory_gb: float | None = None
    target_spacing: tuple[float, ...] | None = None


@dataclass(frozen=True)
class NetSpec:
    """What a planner sizes: the architecture and its memory reference (feature-map voxels
    that fill `reference_gb` at REFERENCE_BATCH)."""

    architecture: str
    reference_3d: float
    reference_2d: float
    reference_gb: float
    blocks_encoder: tuple[int, ...]
    blocks_decoder: tuple[int, ...]
    max_dataset_covered: float
    # nnU-Net's default planner shrinks the patch until a batch of 2 fits; its
    # residual-encoder presets until the reference batch fits.
    fit_min_batch: bool = True

    def reference(self, ndim: int, gpu_memory_gb: float) -> float:
        ref = self.reference_2d if ndim == 2 else self.reference_3d
        return ref * gpu_memory_gb / self.reference_gb


DEFAULT_NET = NetSpec(PLAIN, 560_000_000, 85_000_000, 8, (2,) * 14, (2,) * 13, 0.05)


def target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> tuple[float, float, float]:
    """Median spacing, with nnU-Net's rule for one very coarse axis of few voxels."""
    spacing = np.percentile(np.asarray(spacings, dtype=np.float64), 50, axis=0)
    size = np.percentile(np.asarray(shapes, dtype=np.float64), 50, axis=0)
    worst = int(np.argmax(spacing))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = spacing[worst] > ANISO_THRESHOLD * max(spacing[others])
    aniso_voxels = size[worst] * ANISO_THRESHOLD < min(size[others])
    if aniso_spacing and aniso_voxels:
        tenth = float(np.percentile(np.asarray(spacings)[:, worst], 10))
        # Never finer than the other axes: that would only invent slices.
        if tenth < max(spacing[others]):
            tenth = float(max(spacing[others])) + 1e-5
        spacing[worst] = tenth
    z, y, x = (float(s) for s in spacing)
    return z, y, x


def transpose_for(spacing) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward, backward): the coarsest axis first, the others in their order."""
    coarsest = int(np.argmax(spacing))
    forward = (coarsest, *(a for a in range(3) if a != coarsest))
    backward = tuple(forward.index(a) for a in range(3))
    return forward, backward


def normalization(
    fingerprint: dict, channel_names: list[str]
) -> tuple[tuple[str, ...], tuple[bool, ...]]:
    """(scheme per channel, use the nonzero mask per channel)."""
    schemes = tuple(NORMALIZATION.get(name.casefold(), ZSCORE) for name in channel_names)
    shrank = fingerprint["median_relative_size_after_cropping"] < 0.75
    return schemes, tuple(shrank and scheme == ZSCORE for scheme in schemes)


def network_plan(top: Topology, spec: NetSpec) -> NetworkPlan:
    ndim, num_stages = len(top.patch_size), len(top.strides)
    return NetworkPlan(
        features_per_stage=tuple(
            min(MAX_FEATURES[ndim], BASE_FEATURES * 2**i) for i in range(num_stages)
        ),
        kernel_sizes=top.kernel_sizes,
        strides=top.strides,
        n_conv_per_stage_encoder=spec.blocks_encoder[:num_stages],
        n_conv_per_stage_decoder=spec.blocks_decoder[: num_stages - 1],
        architecture=spec.architecture,
    )


def estimate_gb(net: NetworkPlan, patch, batch: int, num_classes: int, spec: NetSpec) -> float:
    """GPU memory of a training step by nnU-Net's rule: feature-map voxels scale linearly
    to the reference (REFERENCE_BATCH patches fill `reference_gb`)."""
    ndim = len(patch)
    voxels = feature_map_voxels(net, patch, num_classes) * batch / REFERENCE_BATCH[ndim]
    return voxels / spec.reference(ndim, spec.reference_gb) * spec.reference_gb


@dataclass(frozen=True)
class Sized:
    """One configuration's planned patch, network and batch."""

    top: Topology
    net: NetworkPlan
    batch: int
    estimate_voxels: int


def _initial_patch(spacing, median_shape) -> list:
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


def size_configuration(spec: NetSpec, spacing, median_shape, num_classes: int,
                       dataset_voxels: float, gpu_memory_gb: float) -> Sized:  # fmt: skip
    """Patch, network and batch for one configuration (nnU-Net's loop)."""
    ndim = len(spacing)
    reference, ref_batch = spec.reference(ndim, gpu_memory_gb), REFERENCE_BATCH[ndim]
    top = topology(spacing, _initial_patch(spacing, median_shape))
    estimate = feature_map_voxels(network_plan(top, spec), top.patch_size, num_classes)
    limit = ref_batch / MIN_BATCH if spec.fit_min_batch else 1
    while estimate / limit > reference:
        smaller = _shrink(spacing, median_shape, top)
        if min(smaller.patch_size) < 1:
            needed = estimate / limit / reference * gpu_memory_gb
            raise PlanningError(
                f"no {ndim}d patch fits -gpu_memory_target {gpu_memory_gb:g} GB: the smallest, "
                f"{list(top.patch_size)}, needs about {needed:.2g} GB"
            )
        top = smaller
        estimate = feature_map_voxels(network_plan(top, spec), top.patch_size, num_classes)
    batch = round(reference / estimate * ref_batch)
    cap = round(dataset_voxels * spec.max_dataset_covered / np.prod(top.patch_size, dtype=float))
    return Sized(top, network_plan(top, spec), max(min(batch, cap), MIN_BATCH), estimate)


@dataclass(frozen=True)
class Geometry:
    """What every configuration plans from, in the transposed axis order."""

    spacing: tuple[float, ...]  # 3d_fullres target spacing
    median_shape: tuple[float, ...]  # median of the per-case resampled shapes
    transpose_forward: tuple[int, ...]
    transpose_backward: tuple[int, ...]
    num_training: int

    @property
    def dataset_voxels(self) -> float:
        return float(np.prod(self.median_shape, dtype=np.float64) * self.num_training)


def plan_geometry(fingerprint: dict, dataset_json: dict, spacing_override=None) -> Geometry:
    spacings = np.asarray(fingerprint["spacings"], dtype=np.float64)
    shapes = np.asarray(fingerprint["shapes_after_crop"], dtype=np.float64)
    if spacing_override is not None:
        spacing = tuple(float(s) for s in spacing_override)
    else:
        spacing = target_spacing(spacings, shapes)
    forward, backward = transpose_for(spacing)
    resampled = [
        [round(s / t * n) for s, t, n in zip(sp, spacing, sh, strict=True)]
        for sp, sh in zip(spacings.tolist(), shapes.tolist(), strict=True)
    ]
    median = np.median(np.asarray(resampled, dtype=np.float64), axis=0)
    num_training = int(dataset_json.get("numTraining") or len(spacings))
    return Geometry(
        tuple(float(spacing[a]) for a in forward), tuple(float(median[a]) for a in forward),
        forward, backward, num_training,
    )  # fmt: skip


@dataclass(frozen=True)
class _Planned:
    spacing: tuple[float, ...]
    median_shape: tuple[float, ...]
    sized: Sized


def _lowres(geometry: Geometry, full: _Planned, size) -> _Planned | None:
    """nnU-Net's 3d_lowres search: coarser spacing until the patch covers >= 25 % of the
    median image; None when not needed or when it would not halve the voxels."""
    full_spacing = np.asarray(full.spacing, dtype=np.float64)
    median = np.asarray(geometry.median_shape, dtype=np.float64)
    lowres_spacing = full_spacing.copy()
    patch_voxels = np.prod(full.sized.top.patch_size, dtype=np.float64)
    median_voxels = np.prod(median, dtype=np.float64)
    planned = None
    while patch_voxels / median_voxels < LOWRES_THRESHOLD:
        coarser = lowres_spacing.max() / lowres_spacing > 2
        if np.any(coarser):
            lowres_spacing[coarser] *= LOWRES_STEP
        else:
            lowres_spacing *= LOWRES_STEP
        shape = full_spacing / lowres_spacing * median
        median_voxels = np.prod(shape, dtype=np.float64)
        rounded = tuple(round(v) for v in shape)
        sized = size(tuple(lowres_spacing), rounded, float(median_voxels * geometry.num_training))
        planned = _Planned(tuple(float(v) for v in lowres_spacing), rounded, sized)
        patch_voxels = np.prod(sized.top.patch_size, dtype=np.float64)
    if planned is None or np.prod(median, dtype=np.float64) / median_voxels < 2:
        return None
    return planned


def _overridden(name: str, planned: _Planned, spec: NetSpec, overrides: Overrides,
                num_classes: int) -> Sized:  # fmt: skip
    """The planned size, or the user's --patch-size/--batch-size (PlanningError with a
    divisible suggestion when the patch does not fit the network's pooling)."""
    sized, patch = planned.sized, overrides.patch_size.get(name)
    if patch is not None:
        ndim = len(planned.spacing)
        top = topology(planned.spacing, patch) if len(patch) == ndim else None
        if top is None or top.patch_size != tuple(patch):
            divisor = list(top.divisor) if top else f"{ndim} sizes"
            hint = f"; try --patch-size {' '.join(map(str, top.patch_size))}" if top else ""
            raise PlanningError(
                f"patch size {list(patch)} for {name} is not divisible by the network's "
                f"pooling {divisor}{hint}"
            )
        net = network_plan(top, spec)
        sized = Sized(top, net, sized.batch, feature_map_voxels(net, top.patch_size, num_classes))
    batch = overrides.batch_size.get(name)
    return Sized(sized.top, sized.net, batch, sized.estimate_voxels) if batch else sized


def plan_configurations(
    fingerprint: dict, dataset_json: dict, spec: NetSpec, options: PlannerOptions
) -> tuple[Geometry, dict[str, _Planned]]:
    """Every configuration nnU-Net's plan_experiment makes, by name."""
    geometry = plan_geometry(fingerprint, dataset_json, options.target_spacing)
    gpu_gb = options.gpu_memory_gb or spec.reference_gb
    num_classes = len(dataset_json["labels"])

    def size(spacing, median, voxels) -> Sized:
        return size_configuration(spec, spacing, median, num_classes, voxels, gpu_gb)

    planned = {}
    if geometry.median_shape[0] != 1:  # a 2D dataset has no 3d configuration
        spacing, median = geometry.spacing, geometry.median_shape
        full = _Planned(spacing, median, size(spacing, median, geometry.dataset_voxels))
        lowres = _lowres(geometry, full, size)
        planned["3d_fullres"] = full
        if lowres is not None:
            planned["3d_lowres"] = lowres
    in_plane, median_2d = geometry.spacing[1:], geometry.median_shape[1:]
    sized_2d = size(in_plane, median_2d, geometry.dataset_voxels)
    planned["2d"] = _Planned(in_plane, median_2d, sized_2d)
    return geometry, planned


def _config_plan(name: str, planned: _Planned, geometry: Geometry, sized: Sized,
                 common: dict, lowres: bool) -> ConfigurationPlan:  # fmt: skip
    spacing, median = planned.spacing, planned.median_shape  # 2d: in-plane only, as nnU-Net
    batch_dice = name == "2d" or (name == "3d_fullres" and lowres)
    gpu = estimate_gb(sized.net, sized.top.patch_size, sized.batch, common["num_classes"],
                      common["spec"])  # fmt: skip
    return ConfigurationPlan(
        name=name, data_identifier=f"{common['plans_name']}_{name}",
        patch_size=sized.top.patch_size, batch_size=int(sized.batch),
        spacing=tuple(float(s) for s in spacing), normalization_schemes=common["schemes"],
        use_mask_for_norm=common["use_mask"], network=sized.net,
        median_image_size=tuple(float(v) for v in median), batch_dice_planned=batch_dice,
        resampling=RESAMPLING, gpu_memory_gb=round(gpu, 3),
        next_stage=(CASCADE,) if name == "3d_lowres" else (),
    )  # fmt: skip


def plan_experiment(fingerprint: dict, dataset_json: dict, dataset_name: str,
                    configurations: tuple[str, ...] | None = None,
                    overrides: Overrides | None = None, plans_name: str | None = None,
                    options: PlannerOptions | None = None, spec: NetSpec = DEFAULT_NET,
                    data_plans: str | None = None) -> Plans:  # fmt: skip
    """nnU-Net's plans for `configurations` (None: all it makes). `data_plans` names the
    plans whose data the 2d/3d_fullres configurations read (the presets share it)."""
    options, overrides = options or PlannerOptions(), overrides or Overrides()
    check_options(options)
    plans_name = plans_name or options.plans_name or DEFAULT_PLANS
    for name in configurations or ():
        if name not in CONFIGURATIONS:
            choices = ", ".join(CONFIGURATIONS)
            raise PlanningError(f"unknown configuration {name!r}; choose from {choices}")
    geometry, planned = plan_configurations(fingerprint, dataset_json, spec, options)
    names = dataset_json["channel_names"]
    channels = [names[k] for k in sorted(names, key=int)]
    schemes, use_mask = normalization(fingerprint, channels)
    common: dict[str, Any] = {"plans_name": plans_name, "schemes": schemes, "use_mask": use_mask,
              "num_classes": len(dataset_json["labels"]), "spec": spec}  # fmt: skip
    lowres = "3d_lowres" in planned
    wanted = [n for n in planned if configurations is None or n in configurations]
    configs = {}
    for name in sorted(wanted):
        sized = _overridden(name, planned[name], spec, overrides, common["num_classes"])
        plan = _config_plan(name, planned[name], geometry, sized, common, lowres)
        if data_plans and name != "3d_lowres":
            plan = replace(plan, data_identifier=f"{data_plans}_{name}")
        configs[name] = plan
    plans = Plans(
        dataset_name=dataset_name, plans_name=plans_name, configurations=configs,
        num_input_channels=len(channels),
        labels=plans_labels(dataset_json["labels"]), identity="",
        regions_class_order=regions_order(dataset_json.get("regions_class_order")),
        foreground_intensity_properties=fingerprint["foreground_intensity_properties_per_channel"],
        transpose_forward=geometry.transpose_forward,
        transpose_backward=geometry.transpose_backward,
        original_median_spacing_after_transp=_original_median(fingerprint, "spacings", geometry),
        original_median_shape_after_transp=tuple(
            round(v) for v in _original_median(fingerprint, "shapes_after_crop", geometry)
        ),
        # with either 3d configuration: merged plans files then hold it as nnU-Net's do
        cascades={CASCADE: {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}}
        if lowres and ("3d_fullres" in configs or "3d_lowres" in configs) else {},
    )  # fmt: skip
    return with_identity(plans)


def _original_median(fingerprint: dict, key: str, geometry: Geometry) -> tuple[float, ...]:
    """nnU-Net's plan-level median of the cases' spacings or shapes, in the transposed order."""
    median = np.median(np.asarray(fingerprint[key], dtype=np.float64), axis=0)
    return tuple(float(median[axis]) for axis in geometry.transpose_forward)


def check_options(options: PlannerOptions) -> None:
    """PlanningError (one line) for a memory target or target spacing no plan can use."""
    if options.gpu_memory_gb is not None and not options.gpu_memory_gb > 0:
        raise PlanningError(f"-gpu_memory_target {options.gpu_memory_gb:g}: must be > 0 (GB)")
    spacing = options.target_spacing
    if spacing is not None and (len(spacing) != 3 or not all(s > 0 for s in spacing)):
        shown = " ".join(f"{s:g}" for s in spacing)
        raise PlanningError(f"-overwrite_target_spacing {shown}: three spacings > 0 (z y x, mm)")


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
