"""Plans: what preprocessing produced and what the network looks like (nnuiPlans.json).

The typed view the trainer reads (`load_plans`) lives here; the rules that make a plan
from a dataset fingerprint live in `trainer.planning.rules`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainer import legacy
from trainer.data.labels import LabelSpec, parse_labels
from trainer.schema.tree import DEFAULT_PLANS, plans_file_name

PLANS_FORMAT_VERSION = 1
PLAIN = "PlainConvUNet"
# nnU-Net's ResidualEncoderUNet: n_conv_per_stage_encoder then counts residual blocks (two
# convs each), written as `n_blocks_per_stage` in the plans file.
RESIDUAL_ENCODER = "ResidualEncoderUNet"
ARCHITECTURES = (PLAIN, RESIDUAL_ENCODER)


@dataclass(frozen=True)
class NetworkPlan:
    features_per_stage: tuple[int, ...]
    kernel_sizes: tuple[tuple[int, ...], ...]  # per stage
    strides: tuple[tuple[int, ...], ...]  # per stage; first is all 1
    n_conv_per_stage_encoder: tuple[int, ...]
    n_conv_per_stage_decoder: tuple[int, ...]  # len = num_stages - 1
    architecture: str = PLAIN  # one of ARCHITECTURES

    @property
    def num_stages(self) -> int:
        return len(self.features_per_stage)

    @property
    def pooling_divisor(self) -> tuple[int, ...]:
        """Per axis, the product of the strides: patch sizes must be multiples of it."""
        out = [1] * len(self.strides[0])
        for stride in self.strides:
            out = [o * s for o, s in zip(out, stride, strict=True)]
        return tuple(out)


@dataclass(frozen=True)
class ConfigurationPlan:
    name: str  # "2d" | "3d_fullres"
    data_identifier: str  # folder under the dataset, e.g. "nnuiPlans_3d_fullres"
    patch_size: tuple[int, ...]  # 2 or 3 ints
    batch_size: int  # GLOBAL batch size G
    # (z, y, x) target spacing of the stored data; 2d: (y, x) as nnU-Net (each case keeps
    # its own slice spacing); plans written before hold three, the first unused
    spacing: tuple[float, ...]
    normalization_schemes: tuple[str, ...]
    use_mask_for_norm: tuple[bool, ...]
    network: NetworkPlan
    median_image_size: tuple[float, ...] = ()  # at `spacing`, after the transpose; 2d: (y, x)
    # The cases preprocessing wrote for this configuration: a deleted file is then noticed
    # (trainer.data.dataset). Not part of any identity: the splits decide what is trained on.
    case_ids: tuple[str, ...] = ()
    # nnU-Net's cascade: 3d_lowres names its next stage(s), 3d_cascade_fullres its previous
    # one, whose segmentations it takes as extra input channels (trainer.data.cascade).
    previous_stage: str | None = None
    next_stage: tuple[str, ...] = ()
    # Written by the nnU-Net-equal planners (None: absent from older plans files, whose
    # bytes and identity stay as they were).
    batch_dice_planned: bool | None = None
    resampling: dict | None = None  # nnU-Net's resampling_fn_* keys and kwargs
    gpu_memory_gb: float | None = None  # nnU-Net's estimate for patch x batch

    @property
    def ndim(self) -> int:
        return len(self.patch_size)

    @property
    def batch_dice(self) -> bool:
        """The plans' batch_dice; older plans: nnU-Net's rule without a 3d_lowres (2d
        pools the batch, a 3D patch is scored on its own)."""
        return self.batch_dice_planned if self.batch_dice_planned is not None else self.ndim == 2


@dataclass(frozen=True)
class Plans:
    dataset_name: str
    plans_name: str  # "nnuiPlans"
    configurations: dict[str, ConfigurationPlan]
    num_input_channels: int
    # From dataset.json, includes background: an int per label, a list per region
    # (trainer.data.labels), and `ignore` when the dataset has one.
    labels: dict[str, Any]
    identity: str  # sha256 hex of the canonical JSON of the whole content (all configurations)
    foreground_intensity_properties: dict[str, dict[str, float]] = field(default_factory=dict)
    regions_class_order: tuple[int, ...] | None = None  # with regions only
    # nnU-Net's axis order of the stored data (None: identity, plans written before it).
    transpose_forward: tuple[int, ...] | None = None
    transpose_backward: tuple[int, ...] | None = None
    # nnU-Net's plan-level medians of the raw cases (before resampling), transposed: written
    # as nnU-Net writes them, for tools that read them; nothing in training depends on them.
    original_median_spacing_after_transp: tuple[float, ...] | None = None
    original_median_shape_after_transp: tuple[int, ...] | None = None
    # nnU-Net's entries that inherit another (3d_cascade_fullres), as the file holds them:
    # written back unchanged; `configurations` holds them resolved, ready to train.
    cascades: dict[str, dict] = field(default_factory=dict)

    @property
    def label_spec(self) -> LabelSpec:
        return parse_labels(self.labels, self.regions_class_order)

    @property
    def transpose(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(forward, backward); the identity for plans without a transpose."""
        identity = (0, 1, 2)
        return (self.transpose_forward or identity, self.transpose_backward or identity)

    @property
    def num_classes(self) -> int:
        """Network outputs: a softmax channel per label, or a sigmoid per region."""
        return self.label_spec.num_heads

    def configuration(self, name: str) -> ConfigurationPlan:
        if name not in self.configurations:
            available = ", ".join(sorted(self.configurations))
            raise ValueError(f"configuration {name!r} not in plans; available: {available}")
        return self.configurations[name]

    def identity_of(self, configuration: str) -> str:
        """sha256 hex of what a model trained on one configuration depends on: the
        dataset-level fields (labels, channels, intensity properties) and that configuration's
        block. Re-planning another configuration leaves it unchanged."""
        self.configuration(configuration)  # ValueError naming the available ones
        return configuration_identity(plans_content(self), configuration)


# ---- JSON round trip ------------------------------------------------------------------


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _encoder_key(architecture: str) -> str:
    return "n_blocks_per_stage" if architecture == RESIDUAL_ENCODER else "n_conv_per_stage_encoder"


def _network_from_dict(d: dict) -> NetworkPlan:
    architecture = d.get("architecture", PLAIN)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"network architecture {architecture!r} is not one of {ARCHITECTURES}")
    encoder_key = _encoder_key(architecture)
    return NetworkPlan(
        features_per_stage=_tuples(d["features_per_stage"]),
        kernel_sizes=_tuples(d["kernel_sizes"]),
        strides=_tuples(d["strides"]),
        n_conv_per_stage_encoder=_tuples(d[encoder_key]),
        n_conv_per_stage_decoder=_tuples(d["n_conv_per_stage_decoder"]),
        architecture=architecture,
    )


def _network_to_dict(n: NetworkPlan) -> dict:
    # The plain U-Net's block has no `architecture` key: plans written before it keep
    # their bytes and identity.
    out = {"architecture": n.architecture} if n.architecture != PLAIN else {}
    encoder_key = _encoder_key(n.architecture)
    return {
        **out,
        "features_per_stage": list(n.features_per_stage),
        "kernel_sizes": [list(k) for k in n.kernel_sizes],
        "strides": [list(s) for s in n.strides],
        encoder_key: list(n.n_conv_per_stage_encoder),
        "n_conv_per_stage_decoder": list(n.n_conv_per_stage_decoder),
    }


def _configuration_to_dict(c: ConfigurationPlan) -> dict:
    out = {
        "data_identifier": c.data_identifier,
        "patch_size": list(c.patch_size),
        "batch_size": c.batch_size,
        "spacing": list(c.spacing),
        "normalization_schemes": list(c.normalization_schemes),
        "use_mask_for_norm": list(c.use_mask_for_norm),
        "median_image_size_in_voxels": list(c.median_image_size),
        "network": _network_to_dict(c.network),
    }
    if c.case_ids:
        out["case_ids"] = list(c.case_ids)
    if c.batch_dice_planned is not None:
        out["batch_dice"] = c.batch_dice_planned
    if c.resampling is not None:
        out.update(c.resampling)
    if c.gpu_memory_gb is not None:
        out["gpu_memory_estimate_gb"] = c.gpu_memory_gb
    # Written only for cascade stages: other blocks keep their bytes and identity. nnU-Net
    # writes one next stage as a name.
    if c.previous_stage:
        out["previous_stage"] = c.previous_stage
    if c.next_stage:
        out["next_stage"] = c.next_stage[0] if len(c.next_stage) == 1 else list(c.next_stage)
    return out


def _configuration_from_dict(name: str, d: dict) -> ConfigurationPlan:
    return _checked(_configuration_plan(name, d))


def _checked(c: ConfigurationPlan) -> ConfigurationPlan:
    """ValueError (one line) for a hand-edited plan no training could run with."""
    where = f"configuration {c.name!r}"
    if len(c.patch_size) not in (2, 3) or any(v < 1 for v in c.patch_size):
        raise ValueError(f"{where}: patch_size {list(c.patch_size)} must be 2 or 3 sizes >= 1")
    if c.batch_size < 1:
        raise ValueError(f"{where}: batch_size {c.batch_size} must be >= 1")
    # 2d: nnU-Net's two in-plane spacings (plans written before: three, slice axis first)
    sizes = (2, 3) if c.name == "2d" else (3,)
    if len(c.spacing) not in sizes or not all(math.isfinite(v) and v > 0 for v in c.spacing):
        raise ValueError(
            f"{where}: spacing {list(c.spacing)} must be {' or '.join(map(str, sizes))} "
            "positive numbers"
        )
    strides = c.network.strides
    if not strides or any(len(s) != len(c.patch_size) for s in strides):
        raise ValueError(f"{where}: the network's strides do not match a {c.ndim}d patch")
    divisor = c.network.pooling_divisor
    if any(v % d for v, d in zip(c.patch_size, divisor, strict=True)):
        raise ValueError(
            f"{where}: patch_size {list(c.patch_size)} is not a multiple of the network's "
            f"downsampling {list(divisor)}"
        )
    return c


def _configuration_plan(name: str, d: dict) -> ConfigurationPlan:
    return ConfigurationPlan(
        name=name,
        data_identifier=d["data_identifier"],
        patch_size=tuple(int(v) for v in d["patch_size"]),
        batch_size=int(d["batch_size"]),
        spacing=tuple(float(v) for v in d["spacing"]),
        normalization_schemes=tuple(d["normalization_schemes"]),
        use_mask_for_norm=tuple(bool(v) for v in d["use_mask_for_norm"]),
        network=_network_from_dict(d["network"]),
        # as written: nnU-Net's planner gives floats (a median may be x.5), older plans ints
        median_image_size=tuple(d.get("median_image_size_in_voxels", ())),
        case_ids=tuple(str(v) for v in d.get("case_ids", ())),
        previous_stage=d.get("previous_stage") or None,
        next_stage=_stage_names(d.get("next_stage")),
        batch_dice_planned=bool(d["batch_dice"]) if "batch_dice" in d else None,
        resampling={k: v for k, v in d.items() if k.startswith("resampling_fn_")} or None,
        gpu_memory_gb=float(d["gpu_memory_estimate_gb"]) if "gpu_memory_estimate_gb" in d else None,
    )


def _stage_names(value: Any) -> tuple[str, ...]:
    """nnU-Net writes next_stage as one name or a list of names."""
    if not value:
        return ()
    return (str(value),) if isinstance(value, str) else tuple(str(v) for v in value)


def resolve_inheritance(configurations: dict) -> dict:
    """Blocks with nnU-Net's `inherits_from` completed from their parent (the parent's
    keys, then the block's own): 3d_cascade_fullres inherits 3d_fullres's data and network."""
    resolved: dict = {}

    def block(name: str, seen: tuple[str, ...]) -> dict:
        if name in resolved:
            return resolved[name]
        own = configurations[name]
        parent = own.get("inherits_from") if isinstance(own, dict) else None
        if parent is None:
            resolved[name] = own
            return own
        if parent not in configurations or parent in seen:
            raise ValueError(
                f"configuration {name!r} inherits from {parent!r}, which is not usable"
            )
        merged = {**block(parent, (*seen, name)), **own}
        merged.pop("inherits_from")
        if "next_stage" not in own:  # the parent's next stage is not the child's
            merged.pop("next_stage", None)
        resolved[name] = merged
        return merged

    for name in configurations:
        block(name, ())
    return resolved


def plans_content(plans: Plans) -> dict:
    """Everything that defines the plans, without the identity itself."""
    configurations = {
        n: _configuration_to_dict(c)
        for n, c in plans.configurations.items()
        if n not in plans.cascades
    }
    configurations.update(plans.cascades)
    # regions_class_order only where there are regions: other plans keep their identity.
    regions = (
        {}
        if plans.regions_class_order is None
        else {"regions_class_order": list(plans.regions_class_order)}
    )
    content = {
        **regions,
        "format_version": PLANS_FORMAT_VERSION,
        "dataset_name": plans.dataset_name,
        "plans_name": plans.plans_name,
        "num_input_channels": plans.num_input_channels,
        "labels": dict(plans.labels),
        "foreground_intensity_properties_per_channel": plans.foreground_intensity_properties,
        "configurations": dict(sorted(configurations.items())),
    }
    if plans.transpose_forward is not None:
        content["transpose_forward"] = list(plans.transpose_forward)
        content["transpose_backward"] = list(plans.transpose_backward or ())
    for key in ORIGINAL_MEDIAN_KEYS:
        value = getattr(plans, key)
        if value is not None:
            content[key] = list(value)
    return content


# Plans-level fields a trained model depends on (with its configuration block).
DATASET_LEVEL_KEYS = (
    "format_version",
    "plans_name",
    "num_input_channels",
    "labels",
    "foreground_intensity_properties_per_channel",
)
# Also dataset-level, but only in plans that have them (older identities stay).
OPTIONAL_DATASET_LEVEL_KEYS = ("transpose_forward", "transpose_backward")
ORIGINAL_MEDIAN_KEYS = (
    "original_median_spacing_after_transp",
    "original_median_shape_after_transp",
)
_NOT_IDENTITY = ("case_ids",)  # bookkeeping, not a training input


def _hash(content: dict) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _block_for_identity(block: dict) -> dict:
    return {k: v for k, v in block.items() if k not in _NOT_IDENTITY}


def dataset_level(content: dict) -> dict:
    """The plans-level fields every configuration depends on."""
    out = {key: content.get(key) for key in DATASET_LEVEL_KEYS}
    if content.get("regions_class_order") is not None:  # absent: identities stay as they were
        out["regions_class_order"] = content["regions_class_order"]
    out.update({k: content[k] for k in OPTIONAL_DATASET_LEVEL_KEYS if k in content})
    return out


def compute_identity(content: dict) -> str:
    """Identity of the whole plans (every configuration)."""
    configurations = {
        name: _block_for_identity(block) for name, block in content["configurations"].items()
    }
    return _hash({**content, "configurations": configurations})


def configuration_identity(content: dict, configuration: str) -> str:
    """Identity of one configuration: dataset-level fields + its own block only."""
    block = _block_for_identity(content["configurations"][configuration])
    return _hash({**dataset_level(content), "configuration": configuration, "block": block})


def with_identity(plans: Plans) -> Plans:
    return replace(plans, identity=compute_identity(plans_content(plans)))


def plans_to_json(plans: Plans) -> str:
    return content_to_json(plans_content(plans))


def _dataset_level_json(content: dict) -> str:
    return json.dumps(dataset_level(content), sort_keys=True, allow_nan=True)


def merge_plans(new: Plans, existing: dict | None) -> tuple[dict, list[str]]:
    """plans.json content: `new`'s configurations plus the other ones of `existing`, kept
    as they were (same bytes, same `identity_of`). Returns (content, dropped names).

    Another configuration is kept only when the dataset-level fields are unchanged: its
    data was normalised with them, so when they differ (the raw data changed) it is dropped
    and must be preprocessed again.
    """
    content = plans_content(new)
    dropped: list[str] = []
    if existing and isinstance(existing.get("configurations"), dict):
        others = {
            k: v for k, v in existing["configurations"].items() if k not in new.configurations
        }
        if _dataset_level_json(existing) == _dataset_level_json(content):
            content["configurations"] = dict(
                sorted({**others, **content["configurations"]}.items())
            )
        else:
            dropped = sorted(others)
    return content, dropped


def content_to_json(content: dict) -> str:
    return (
        json.dumps({**content, "identity": compute_identity(content)}, indent=1, allow_nan=True)
        + "\n"
    )


def read_plans_json(path: Path) -> dict | None:
    """The raw content of a plans file, or None when absent or unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def plans_from_dict(data: dict) -> Plans:
    blocks = resolve_inheritance(data["configurations"])
    configurations = {name: _configuration_from_dict(name, d) for name, d in blocks.items()}
    cascades = {n: dict(d) for n, d in data["configurations"].items() if _is_cascade(d)}
    forward, backward = data.get("transpose_forward"), data.get("transpose_backward")
    plans = Plans(
        dataset_name=data["dataset_name"],
        plans_name=data["plans_name"],
        configurations=configurations,
        num_input_channels=int(data["num_input_channels"]),
        labels=plans_labels(data["labels"]),
        identity="",
        foreground_intensity_properties=data.get("foreground_intensity_properties_per_channel", {}),
        regions_class_order=regions_order(data.get("regions_class_order")),
        transpose_forward=tuple(int(a) for a in forward) if forward is not None else None,
        transpose_backward=tuple(int(a) for a in backward) if backward is not None else None,
        cascades=cascades,
    )
    spacing, shape = (data.get(key) for key in ORIGINAL_MEDIAN_KEYS)
    if isinstance(spacing, list) and isinstance(shape, list):
        plans = replace(
            plans,
            original_median_spacing_after_transp=tuple(float(v) for v in spacing),
            original_median_shape_after_transp=tuple(int(v) for v in shape),
        )
    return with_identity(plans)


def plans_labels(labels: dict) -> dict[str, Any]:
    """dataset.json's labels as plans hold them: ints, and lists for regions."""
    return {str(k): list(v) if isinstance(v, (list, tuple)) else int(v) for k, v in labels.items()}


def regions_order(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(int(v) for v in value)


def _is_cascade(block: dict) -> bool:
    """nnU-Net's 3d_cascade_fullres entry: `inherits_from` another, no data of its own."""
    return isinstance(block, dict) and "inherits_from" in block and "patch_size" not in block


def plans_file(preprocessed_dataset_dir: Path, plans_name: str = DEFAULT_PLANS) -> Path:
    """`<plans_name>.json` (docs/formats-and-plans.md); nnui 0.1's `nnUNetPlans`: `plans.json`."""
    return Path(preprocessed_dataset_dir) / plans_file_name(plans_name)


def existing_plans(preprocessed_dataset_dir: Path) -> list[str]:
    """The nnui plans identifiers written in a preprocessed dataset folder, sorted."""
    found = []
    for path in sorted(preprocessed_dataset_dir.glob("*.json")):
        data = read_plans_json(path) if not path.name.startswith("nnUNet") else None
        if isinstance(data, dict) and isinstance(data.get("configurations"), dict):
            found.append(str(data.get("plans_name") or path.stem))
    return found


def load_plans(preprocessed_dataset_dir: Path, plans_name: str = DEFAULT_PLANS) -> Plans:
    if plans_name.startswith("nnUNet") and not legacy.is_plans(plans_name):
        raise ValueError(
            f"{plans_name!r} is not an nnui plans identifier: nnU-Net's plans are trained by "
            f"nnUNetv2_train; nnui's are {DEFAULT_PLANS} (the default) and others that "
            f"nnui-preprocess wrote"
        )
    path = plans_file(preprocessed_dataset_dir, plans_name)
    if not path.is_file():
        found = existing_plans(Path(preprocessed_dataset_dir))
        if found:
            raise FileNotFoundError(
                f"no plans at {path}; it has {', '.join(found)}: pick one with -p {found[0]}"
            )
        raise FileNotFoundError(
            f"no plans at {path}; run `nnui-preprocess {Path(preprocessed_dataset_dir).name}` first"
        )
    try:
        data = json.loads(path.read_text())
        plans = plans_from_dict(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a valid plans file ({exc}); re-run nnui-preprocess"
        ) from None
    if plans.plans_name != plans_name:
        raise ValueError(f"{path} holds plans {plans.plans_name!r}, expected {plans_name!r}")
    # The identity is recomputed from the content, so a hand-edited plans file (e.g. a
    # new batch size) gets a new identity and old checkpoints notice.
    return plans
