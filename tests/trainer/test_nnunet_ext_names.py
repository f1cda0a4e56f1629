"""Stock nnU-Net runs (--engine nnunet) name their pseudo-Dice entries in run_started, as
nnui's trainer does: nnU-Net's foreground labels by value, or its regions in dataset.json's
order (what the board's per-class curves are labelled with)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

nnui_trainers = pytest.importorskip("trainer.nnunet_ext.nnui_trainers")


@pytest.mark.parametrize(
    ("labels", "regions", "ignore", "names"),
    [
        ({"background": 0, "lesion": 2, "organ": 1}, False, None, ["organ", "lesion"]),
        ({"background": 0, "organ": 1, "lesion": 2, "ignore": 3}, False, 3, ["organ", "lesion"]),
        ({"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": [3]},
         True, None, ["whole tumor", "tumor core", "enhancing"]),
    ],
)  # fmt: skip
def test_class_names_follow_nnunets_label_manager(labels, regions, ignore, names):
    trainer = SimpleNamespace(
        dataset_json={"labels": labels},
        label_manager=SimpleNamespace(has_regions=regions, ignore_label=ignore),
    )
    assert nnui_trainers.NnuiHooks._nnui_class_names(trainer) == names
