"""nnU-Net's cascade: 3d_lowres, then 3d_cascade_fullres on the image plus the low-resolution
segmentation, one-hot (one channel per foreground label, background left out).

Where the inputs live (nnU-Net's layout): each 3d_lowres fold's final validation writes its
validation cases' segmentations, in the geometry of the next stage's preprocessed data, to
`<results>/<dataset>/<trainer>__<plans>__3d_lowres/predicted_next_stage/<next stage>/CASE.b2nd`,
a folder the five folds share; a cascade fold trains on its cases' files there, so it
needs the lowres folds that validated them. nnui derives them from the raw-geometry
prediction, as the cascade's inference does with the lowres prediction files (nnU-Net
resamples the lowres logits directly during training): both paths preprocess one file.

Patches: the loader reads one label map per voxel, seg + K * previous (K = number of
label values, at most 16 so it stays uint8), so rotation, scaling and mirroring move both
together; CascadeBatches splits them again on the device and appends the one-hot channels.
nnU-Net's extra cascade augmentations (random morphology and removed components on the
previous segmentation) are not applied.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.blosc_io import OpenArrays
from trainer.data.dataset import PreprocessedCases
from trainer.data.labels import LabelSpec

log = logging.getLogger("trainer")

NEXT_STAGE_DIR = "predicted_next_stage"
MAX_LABELS = 16  # seg + K * previous must fit uint8


class CascadeError(ValueError):
    """The cascade cannot start (one line)."""


def foreground_labels(spec: LabelSpec) -> list[int]:
    return [v for v in spec.all_labels if v != 0]


def input_channels(plans: Any, cplan: Any) -> int:
    """Network input channels: the image's, plus one per foreground label for a cascade."""
    extra = len(foreground_labels(plans.label_spec)) if cplan.previous_stage else 0
    return plans.num_input_channels + extra


def next_stage_folder(run_dir: Path, next_stage: str) -> Path:
    """Where a lowres fold (run_dir .../T__P__3d_lowres/fold_k) writes for `next_stage`."""
    return Path(run_dir).parent / NEXT_STAGE_DIR / next_stage


def previous_stage_folder(run_dir: Path, cplan: Any) -> Path:
    """Where a cascade fold (run_dir .../T__P__C/fold_k) reads its previous stage."""
    config_dir = Path(run_dir).parent
    trainer, plans_name, _ = config_dir.name.split("__", 2)
    lowres = config_dir.parent / f"{trainer}__{plans_name}__{cplan.previous_stage}"
    return lowres / NEXT_STAGE_DIR / cplan.name


def check_inputs(
    folder: Path, case_ids: list[str], splits: list[dict], cplan: Any,
    suffixes: tuple[str, ...] = (".b2nd",),
) -> None:  # fmt: skip
    """CascadeError naming the previous stage's folds whose validation cases are missing
    (a case is there as CASE<suffix>; stock nnU-Net's numpy dataset writes .npz)."""
    wanted = dict.fromkeys(case_ids)  # fold `all` trains and validates on the same cases
    missing = [c for c in wanted if not any((folder / f"{c}{s}").is_file() for s in suffixes)]
    if not missing:
        return
    folds = sorted({i for i, s in enumerate(splits) for c in missing if c in s.get("val", ())})
    names = ", ".join(str(f) for f in folds) or "?"
    raise CascadeError(
        f"{cplan.name} needs {cplan.previous_stage}'s segmentations of {len(missing)} case(s) "
        f"({missing[0]} ...) in {folder}: train {cplan.previous_stage} fold(s) {names} first"
    )


def combine_factor(spec: LabelSpec) -> int:
    k = max(spec.raw_values) + 1
    if k > MAX_LABELS:
        raise CascadeError(f"the cascade supports up to {MAX_LABELS} label values, not {k}")
    return k


def one_hot(previous: np.ndarray, labels: list[int]) -> np.ndarray:
    """(L, *shape) float32 channels of a label map (Z, Y, X), one per foreground label."""
    return np.stack([previous == v for v in labels]).astype(np.float32)


class _Combined:
    """seg + K * previous over the same box, for trainer.data.blosc_io.read_padded."""

    def __init__(self, seg: Any, previous: Any, factor: int) -> None:
        self.seg, self.previous, self.factor = seg, previous, factor
        self.shape, self.ndim, self.dtype = seg.shape, seg.ndim, np.dtype(np.uint8)

    def __getitem__(self, key: Any) -> np.ndarray:
        seg = np.asarray(self.seg[key], dtype=np.uint8)
        return seg + np.uint8(self.factor) * np.asarray(self.previous[key], dtype=np.uint8)


class CascadeCases(PreprocessedCases):
    """The full-resolution cases with the previous stage's segmentations beside them."""

    def __init__(self, folder: Path, previous_folder: Path, spec: LabelSpec) -> None:
        super().__init__(folder)
        self.previous_folder = Path(previous_folder)
        self.factor = combine_factor(spec)
        self.labels = foreground_labels(spec)
        self._previous = OpenArrays()

    def load_previous(self, case_id: str):
        return self._previous.get(self.previous_folder / f"{case_id}.b2nd")

    def load_seg(self, case_id: str):
        """seg + K * previous: patches read both in one box (see the module docstring)."""
        return _Combined(super().load_seg(case_id), self.load_previous(case_id), self.factor)

    def load_case(self, case_id: str) -> tuple[np.ndarray, np.ndarray, dict]:
        """The image with the one-hot previous segmentation appended (final validation)."""
        image = self.load_image(case_id)[...]
        seg = PreprocessedCases.load_seg(self, case_id)[...]
        previous = self.load_previous(case_id)[...][0]
        data = np.concatenate([image, one_hot(previous, self.labels)])
        return data, seg, self.properties(case_id)


class CascadeBatches:
    """Splits a PatchLoader's combined targets: target = seg, data += one-hot previous."""

    def __init__(self, batches: Iterator[Any], factor: int, labels: list[int]) -> None:
        self.batches, self.factor, self.labels = batches, factor, labels

    @property
    def wait_s(self) -> float:
        return getattr(self.batches, "wait_s", 0.0)

    def __iter__(self) -> CascadeBatches:
        return self

    def __next__(self) -> Any:
        import dataclasses

        import torch

        batch = next(self.batches)
        combined = batch.target
        seg, previous = combined % self.factor, combined // self.factor
        channels = torch.cat([(previous == v) for v in self.labels], 1).to(batch.data.dtype)
        return dataclasses.replace(batch, data=torch.cat((batch.data, channels), 1), target=seg)


def export_next_stage(
    config: Any, plans: Any, cplan: Any, case_id: str, raw_seg: np.ndarray
) -> None:
    """Rank 0, per validation case of a stage with a next stage: the raw-geometry
    segmentation cropped and resampled as preprocessing does for the next stage's data."""
    from trainer.data.blosc_io import write_array
    from trainer.data.case_ops import crop, resample_seg

    dataset_dir = Path(config.preprocessed_dataset_dir)
    for name in cplan.next_stage:
        nxt = plans.configurations.get(name)
        if nxt is None:
            continue
        props_path = dataset_dir / nxt.data_identifier / f"{case_id}.json"
        try:
            props = json.loads(props_path.read_text())
        except (OSError, ValueError):
            log.warning("no %s for %s's next stage: preprocess %s first", props_path, name, name)
            continue
        target = tuple(int(n) for n in props["shape_after_resampling"])
        # raw_seg is in the raw image's axes; the next stage's data in the plans' order
        stored = raw_seg.transpose(plans.transpose[0])
        cropped = crop(stored, props["bbox_used_for_cropping"])
        spacings = (props["spacing"], props["spacing_after_resampling"])
        seg = resample_seg(cropped, target, *spacings).astype(np.uint8)
        folder = next_stage_folder(Path(config.run_dir), name)
        folder.mkdir(parents=True, exist_ok=True)
        write_array(folder / f"{case_id}.b2nd", seg[None], tuple(nxt.patch_size))
