"""Region and ignore-label runs under the nnU-Net engine (issue 29, item 5): the names nnui's
extension trainer gives the pseudo-Dice entries (run_started's class_names, which name the
board's per-class curves) and its final validation's (validation_finished, read by
`nnui cv`) follow nnU-Net's own LabelManager and summary.json, checked against nnU-Net
2.8.1's code: a single value is a region too (BraTS's "enhancing tumor": 3), the ignore
label is no class, and summary.json's text-sorted keys ("10" before "2") are put back in
nnU-Net's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

nnui_trainers = pytest.importorskip("trainer.nnunet_ext.nnui_trainers")

from nnunetv2.evaluation.evaluate_predictions import (  # noqa: E402
    label_or_region_to_key,
    save_summary_json,
)
from nnunetv2.utilities.label_handling.label_handling import LabelManager  # noqa: E402

from app.services.class_dice import fold_class_dice  # noqa: E402
from trainer.schema.events import encode_event  # noqa: E402
from trainer.schema.nnunet import nnunet_classes  # noqa: E402

BRATS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3}
CASES = [
    (BRATS, [1, 2, 3], ["whole tumor", "tumor core", "enhancing tumor"]),
    ({"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": [3],
      "ignore": 4}, [1, 2, 3], ["whole tumor", "tumor core", "enhancing"]),
    ({"background": 0, "organ": 1, "lesion": 2, "ignore": 3}, None, ["organ", "lesion"]),
    ({"background": 0, **{f"structure {v}": v for v in (11, 2, 10, 1)}}, None,
     ["structure 1", "structure 2", "structure 10", "structure 11"]),
]  # fmt: skip


def _manager(labels: dict, order: list[int] | None) -> LabelManager:
    return LabelManager(labels, order)


def _nnunet_classes(manager: LabelManager) -> list:
    return manager.foreground_regions if manager.has_regions else manager.foreground_labels


@pytest.mark.parametrize(("labels", "order", "names"), CASES)
def test_names_and_keys_follow_nnunets_label_manager(labels, order, names) -> None:
    manager = _manager(labels, order)
    found = nnunet_classes(labels)  # what the app reads from a run's dataset.json too
    assert [name for name, _ in found] == names
    # one name per pseudo-Dice entry, in nnU-Net's order, keyed as its summary.json keys them
    expected = [label_or_region_to_key(c) for c in _nnunet_classes(manager)]
    assert [key for _, key in found] == expected
    heads = manager.num_segmentation_heads - (0 if manager.has_regions else 1)
    assert len(found) == heads


@pytest.mark.parametrize(("labels", "order", "names"), CASES)
def test_validation_finished_is_per_class_in_nnunets_order_with_names(
    tmp_path: Path, labels, order, names
) -> None:
    manager = _manager(labels, order)
    keys = _nnunet_classes(manager)
    dice = [0.1 * (i + 1) for i in range(len(keys))]
    means = {k: {"Dice": d, "IoU": d} for k, d in zip(keys, dice, strict=True)}
    results = {"metric_per_case": [{"metrics": means}] * 2, "mean": means,
               "foreground_mean": {"Dice": float(np.mean(dice))}}  # fmt: skip
    summary = tmp_path / "validation" / "summary.json"
    summary.parent.mkdir()
    save_summary_json(results, str(summary))  # nnU-Net's own writer (keys sorted as text)
    classes = nnunet_classes(labels)
    fields = nnui_trainers._read_summary(str(summary), classes)
    assert fields is not None
    assert fields["class_names"] == names and fields["num_cases"] == 2
    assert fields["dice_per_class"] == pytest.approx(dice)
    # what `nnui cv` and the fold's detail show, by name
    (tmp_path / "events.jsonl").write_text(encode_event("validation_finished", t=1.0, **fields))
    expected = [(n, pytest.approx(d)) for n, d in zip(names, dice, strict=True)]
    assert fold_class_dice(tmp_path) == expected


def test_a_summary_without_known_keys_keeps_its_entries_unnamed(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"mean": {"1": {"Dice": 0.5}, "2": {"Dice": 0.25}},
                                   "foreground_mean": {"Dice": 0.375}}))  # fmt: skip
    fields = nnui_trainers._read_summary(str(summary), [("lesion", "7")])
    assert fields == {"mean_fg_dice": 0.375, "num_cases": 0, "dice_per_class": [0.5, 0.25]}
    assert nnui_trainers._read_summary(str(tmp_path / "none.json"), []) is None
