"""`nnui cv` names the Dice of each region (issue 29): the fold's validation_finished event
carries class_names beside dice_per_class; folds without names fall back to summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.services.class_dice import class_dice_text, fold_class_dice, fold_dirs, mean_class_dice
from trainer.schema.tree import EVENTS_FILE, SUMMARY_FILE, VALIDATION_DIR

NAMES = ["whole tumor", "tumor core", "enhancing"]


def _fold(root: Path, fold: str, dice: list[float | None], names=NAMES) -> Path:
    folder = root / "nnuiTrainer__nnuiPlans__2d" / f"fold_{fold}"
    folder.mkdir(parents=True)
    records = [
        {"v": 1, "t": 1.0, "kind": "run_started", "num_epochs": 1, "class_names": names},
        {"v": 1, "t": 2.0, "kind": "validation_finished", "mean_fg_dice": 0.5,
         "dice_per_class": dice, **({"class_names": names} if names else {})},
    ]  # fmt: skip
    (folder / EVENTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_mean_dice_per_region_by_name(tmp_path):
    first = _fold(tmp_path, "0", [0.9, 0.8, None])
    _fold(tmp_path, "1", [0.7, 0.6, 0.5])
    per_class, num = mean_class_dice(fold_dirs(first, ["0", "1", "2"]))
    assert num == 2
    assert [n for n, _ in per_class] == NAMES
    assert [d for _, d in per_class] == pytest.approx([0.8, 0.7, 0.5])
    assert class_dice_text(per_class) == "whole tumor 0.8000, tumor core 0.7000, enhancing 0.5000"


def test_fold_without_names_reads_summary_keys(tmp_path):
    folder = _fold(tmp_path, "0", [0.9], names=None)
    (folder / VALIDATION_DIR).mkdir()
    summary = {"mean": {"(1, 2, 3)": {"Dice": 0.9}, "(3,)": {"Dice": None}}}
    (folder / VALIDATION_DIR / SUMMARY_FILE).write_text(json.dumps(summary))
    assert fold_class_dice(folder) == [("(1, 2, 3)", 0.9), ("(3,)", None)]
    assert fold_class_dice(tmp_path / "nowhere") is None


def test_launch_form_lists_the_cascade_and_marks_its_dependency(tmp_path):
    """nnU-Net's plans write 3d_cascade_fullres as `inherits_from` 3d_fullres: the form lists
    it (its patch and batch are 3d_fullres's) and says it runs after 3d_lowres's folds."""
    from app.services.launch.catalog import DatasetInfo, read_configurations
    from app.widgets.dataset_picker import choices_of

    full = {"patch_size": [16, 32, 32], "batch_size": 2}
    plans = {"configurations": {
        "3d_fullres": full,
        "3d_lowres": {**full, "patch_size": [16, 16, 16], "next_stage": "3d_cascade_fullres"},
        "3d_cascade_fullres": {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"},
    }}  # fmt: skip
    (tmp_path / "nnuiPlans.json").write_text(json.dumps(plans))
    configurations = read_configurations(tmp_path)
    assert [(c.name, c.patch_size, c.batch_size, c.previous_stage) for c in configurations] == [
        ("3d_fullres", (16, 32, 32), 2, None),
        ("3d_lowres", (16, 16, 16), 2, None),
        ("3d_cascade_fullres", (16, 32, 32), 2, "3d_lowres"),
    ]
    choices = choices_of([DatasetInfo("Dataset900_X", configurations, {})])
    assert [c.configuration_text for c in choices][-1] == (
        "3d_cascade_fullres (after 3d_lowres folds 0-4)"
    )
