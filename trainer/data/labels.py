"""dataset.json's `labels` read as nnU-Net 2.8.1 reads them: plain labels, regions, ignore.

A label maps a name to one value; a region maps a name to a list of values (nnU-Net's
region-based training, e.g. BraTS: whole tumour [1, 2, 3], tumour core [2, 3], enhancing
[3]). A dataset has regions when any entry lists more than one value; the network then
has one sigmoid output per foreground region and `regions_class_order` says which value a
voxel gets where region i is predicted (later regions overwrite earlier ones), so labels
that belong to exactly the same regions come back as one value (BraTS's five labels: nnU-Net
accepts this, and so does nnui, with one note at preprocessing). `ignore`
names a value whose voxels carry no annotation: no loss, no metric, never predicted; it
must be the highest value, one above every other label (nnU-Net's rule).

Numpy only: the preprocessing and the CLIs read it without torch (region_masks, the
training's region targets, imports torch when it is called).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

IGNORE = "ignore"
REGIONS_CLASS_ORDER = "regions_class_order"
# class_locations key of every annotated voxel (nnU-Net samples the non-forced patches of an
# ignore-label dataset there, so no patch is drawn in unannotated space only).
ANNOTATED_KEY = "annotated"

Key = int | tuple[int, ...]  # a label value or a region (its values)


class LabelError(ValueError):
    """dataset.json's labels cannot be trained as written (one line)."""


def _values_of(name: str, value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else [value]
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise LabelError(f"label {name!r}: {value!r} must be an int or a list of ints")
    if any(v < 0 for v in items):
        raise LabelError(f"label {name!r}: values must be >= 0, got {value!r}")
    return tuple(int(v) for v in items)


@dataclass(frozen=True)
class LabelSpec:
    """What the network predicts and how it is scored, from dataset.json's labels."""

    names: dict[str, Key]  # every entry but ignore, background included, in file order
    ignore_label: int | None
    regions_class_order: tuple[int, ...] | None  # only with regions

    @property
    def has_regions(self) -> bool:
        return self.regions_class_order is not None

    @property
    def all_labels(self) -> tuple[int, ...]:
        """Every label value but the ignore label, sorted (background included)."""
        values: set[int] = set()
        for key in self.names.values():
            values |= set(key) if isinstance(key, tuple) else {key}
        return tuple(sorted(values))

    @property
    def raw_values(self) -> tuple[int, ...]:
        """The values a reference label file may hold."""
        extra = () if self.ignore_label is None else (self.ignore_label,)
        return tuple(sorted({*self.all_labels, *extra}))

    @property
    def foreground(self) -> list[tuple[str, Key]]:
        """(name, key) per scored class: foreground labels by value, or the regions."""
        if self.has_regions:
            return [(n, k) for n, k in self.names.items() if not _is_background(k)]
        by_value = {_single(k): n for n, k in self.names.items() if _single(k) is not None}
        return [(by_value.get(v, str(v)), v) for v in self.all_labels if v != 0]

    @property
    def foreground_keys(self) -> list[Key]:
        return [key for _, key in self.foreground]

    @property
    def num_heads(self) -> int:
        """Network outputs: one sigmoid per region, else one softmax channel per label."""
        return len(self.foreground) if self.has_regions else len(self.all_labels)

    @property
    def output_values(self) -> tuple[int, ...]:
        """Values a prediction can hold (never the ignore label)."""
        if self.regions_class_order is not None:  # has_regions
            return tuple(sorted({0, *self.regions_class_order}))
        return self.all_labels

    def to_segmentation(self, probabilities: np.ndarray) -> np.ndarray:
        """(K, *shape) probabilities -> label map: argmax, or regions thresholded at 0.5
        written in regions_class_order."""
        values = np.asarray(self.output_values)
        dtype = np.uint8 if values.max() < 256 else np.uint16
        if self.regions_class_order is None:  # not has_regions
            return np.asarray(self.all_labels, dtype=dtype)[np.argmax(probabilities, axis=0)]
        segmentation = np.zeros(probabilities.shape[1:], dtype=dtype)
        for channel, value in enumerate(self.regions_class_order):
            segmentation[probabilities[channel] > 0.5] = value
        return segmentation

    def class_names(self) -> list[str]:
        """Names of the scored classes, in metric order (events, summaries, the board)."""
        return [name for name, _ in self.foreground]


def _single(key: Key) -> int | None:
    """The value of a plain label (an int, or a list of one value); None for a region."""
    if isinstance(key, int):
        return key
    return key[0] if len(key) == 1 else None


def _is_background(key: Key) -> bool:
    return key == 0 or (isinstance(key, tuple) and set(key) == {0})


def metric_key(key: Key) -> str:
    """nnU-Net's summary.json key: "1" for a label, "(1, 2, 3)" for a region."""
    return str(key)


def key_mask(segmentation: np.ndarray, key: Key) -> np.ndarray:
    if isinstance(key, tuple):
        return np.isin(segmentation, key)
    return segmentation == key


def parse_labels(labels: Any, regions_class_order: Any = None) -> LabelSpec:
    """LabelSpec from dataset.json's `labels` (and `regions_class_order`); LabelError."""
    if not isinstance(labels, dict) or not labels:
        raise LabelError("dataset.json 'labels' must map names to label values")
    if labels.get("background") != 0:
        raise LabelError("dataset.json labels must declare background as 0")
    names: dict[str, Key] = {}
    ignore = None
    for name, value in labels.items():
        values = _values_of(str(name), value)
        if name == IGNORE:
            if isinstance(value, (list, tuple)):
                raise LabelError(f"the ignore label must be one int, not a region: {value!r}")
            ignore = values[0]
            continue
        names[str(name)] = values if isinstance(value, (list, tuple)) else values[0]
    has_regions = any(isinstance(k, tuple) and len(k) > 1 for k in names.values())
    spec = LabelSpec(names, ignore, None)
    if ignore is not None and ignore != max(spec.all_labels) + 1:
        raise LabelError(
            f"the ignore label ({ignore}) must be the highest label value, one above the "
            f"others ({max(spec.all_labels) + 1})"
        )
    if not has_regions:
        return spec
    order = _checked_order(regions_class_order, spec)
    return LabelSpec(names, ignore, order)


def _checked_order(order: Any, spec: LabelSpec) -> tuple[int, ...]:
    regions = [k for k in spec.names.values() if not _is_background(k)]
    if order is None:
        raise LabelError("dataset.json has regions (labels with lists) but no regions_class_order")
    if not isinstance(order, (list, tuple)) or not all(isinstance(v, int) for v in order):
        raise LabelError(f"regions_class_order must be a list of ints, got {order!r}")
    if len(order) != len(regions):
        raise LabelError(f"regions_class_order has {len(order)} entries for {len(regions)} regions")
    return tuple(int(v) for v in order)


def _membership(spec: LabelSpec) -> dict[int, tuple[int, ...]]:
    """label value -> the indices of the regions holding it (regions only)."""
    keys = spec.foreground_keys
    return {
        v: tuple(i for i, k in enumerate(keys) if v in (k if isinstance(k, tuple) else (k,)))
        for v in spec.all_labels
        if v != 0
    }


def written_back(spec: LabelSpec, value: int) -> int:
    """The value a prediction holds where the reference holds `value` and every region is
    predicted right: the last region holding it in regions_class_order decides (0: none)."""
    order = spec.regions_class_order or ()
    back = 0
    for key, written in zip(spec.foreground_keys, order, strict=True):
        if value in (key if isinstance(key, tuple) else (key,)):
            back = written
    return back


def region_note(spec: LabelSpec) -> str | None:
    """One informational line where labels belong to exactly the same regions (BraTS's
    five-label layout): nnU-Net accepts them, trains and scores the regions, and writes
    one value for all of them (regions_class_order's); None where nothing is shared."""
    if not spec.has_regions:
        return None
    groups: dict[tuple[int, ...], list[int]] = {}
    for value, regions in _membership(spec).items():
        groups.setdefault(regions, []).append(value)
    names = [name for name, _ in spec.foreground]
    parts = []
    for regions, values in groups.items():
        if len(values) < 2:
            continue
        joined = ", ".join(map(str, values[:-1])) + f" and {values[-1]}"
        where = ", ".join(names[i] for i in regions) or "none"
        parts.append(
            f"labels {joined} belong to the same regions ({where}): predictions write "
            f"{written_back(spec, values[0])} for all of them"
        )
    if not parts:
        return None
    order = list(spec.regions_class_order or ())
    return (
        f"note: {'; '.join(parts)} (regions_class_order {order}); training and evaluation "
        "use the regions, as nnU-Net does"
    )


def check_consecutive(spec: LabelSpec) -> None:
    """nnU-Net's dataset integrity rule: the label values (and the ignore label) are
    0, 1, 2, ... without gaps."""
    missing = sorted(set(range(max(spec.raw_values) + 1)) - set(spec.raw_values))
    if missing:
        raise LabelError(
            f"label values must be consecutive (0, 1, 2, ...): {describe_keys(missing)} "
            f"missing from {list(spec.raw_values)}"
        )


def from_dataset_json(dataset_json: dict) -> LabelSpec:
    return parse_labels(dataset_json.get("labels"), dataset_json.get(REGIONS_CLASS_ORDER))


def location_groups(spec: LabelSpec) -> list[tuple[str, ...]]:
    """Per scored class, the class_locations keys (label values as strings) whose union
    holds its voxels: a region samples its foreground from all of its labels."""
    groups = []
    for key in spec.foreground_keys:
        values = key if isinstance(key, tuple) else (key,)
        groups.append(tuple(str(v) for v in values if v != 0))
    return groups


def label_values_for_checks(spec: LabelSpec) -> dict[str, int]:
    """name -> value of every value a raw label file may hold (the preprocessing's view)."""
    names = {n: k for n, k in spec.names.items() if isinstance(k, int)}
    out = {n: names[n] for n in names}
    for value in spec.raw_values:
        if value not in out.values():
            out[IGNORE if value == spec.ignore_label else f"label_{value}"] = value
    return dict(sorted(out.items(), key=lambda item: item[1]))


def describe_keys(keys: Sequence[Key]) -> str:
    return ", ".join(metric_key(k) for k in keys)


def prediction_labels(spec: LabelSpec) -> dict[str, Any]:
    """The labels a prediction folder records (prediction_info.json): dataset.json's
    entries, and regions_class_order with regions, so an ensemble converts alike."""
    labels: dict[str, Any] = {
        n: list(k) if isinstance(k, tuple) else k for n, k in spec.names.items()
    }
    if spec.ignore_label is not None:
        labels[IGNORE] = spec.ignore_label
    out: dict[str, Any] = {"labels": labels}
    if spec.regions_class_order is not None:  # has_regions
        out[REGIONS_CLASS_ORDER] = list(spec.regions_class_order)
    return out


def is_plain(spec: LabelSpec) -> bool:
    """Plain labels without an ignore label: nnui's original paths apply unchanged."""
    return not spec.has_regions and spec.ignore_label is None


def location_rule(spec: LabelSpec):
    """trainer.data.sampling.LocationRule for these labels (None: plain labels)."""
    from trainer.data.sampling import LocationRule

    if is_plain(spec):
        return None
    annotated = ANNOTATED_KEY if spec.ignore_label is not None else None
    return LocationRule(tuple(location_groups(spec)), annotated)


def region_masks(labels: torch.Tensor, regions: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """Region targets of a batch: (b, R, *spatial) float, 1 where the label map
    (b, *spatial) lies in region r (the regions' loss and validation compare to these)."""
    import torch

    return torch.stack(
        [torch.isin(labels, torch.tensor(r, device=labels.device)) for r in regions], 1
    ).float()
