"""The CPU planner plans what nnU-Net plans for 2D data (2d only), and 2d entries hold
nnU-Net's two in-plane spacings and median sizes; plans written before (three values)
still load."""

from __future__ import annotations

import json

import pytest

from trainer.planning.cpu import plan_cpu
from trainer.planning.plans import plans_content, plans_from_dict
from trainer.planning.rules import PlanningError

PROPS = {"mean": 1.0, "median": 1.0, "std": 1.0, "min": 0.0, "max": 2.0,
         "percentile_00_5": 0.0, "percentile_99_5": 2.0}  # fmt: skip
DATASET_JSON = {"channel_names": {"0": "R", "1": "G", "2": "B"},
                "labels": {"background": 0, "vessel": 1}, "file_ending": ".png"}  # fmt: skip


def _fingerprint(shapes, spacings):
    props = {str(c): PROPS for c in range(3)}
    return {"spacings": spacings, "shapes_after_crop": shapes,
            "median_relative_size_after_cropping": 1.0,
            "foreground_intensity_properties_per_channel": props}  # fmt: skip


PHOTOS = _fingerprint([[1, 584, 565]] * 3, [[999.0, 1.0, 1.0]] * 3)


def test_2d_photos_get_2d_only_with_two_element_spacing_and_median():
    plans = plan_cpu(PHOTOS, DATASET_JSON, "Dataset701_DRIVE")
    assert list(plans.configurations) == ["2d"]
    config = plans.configurations["2d"]
    assert config.spacing == (1.0, 1.0) and config.median_image_size == (584, 565)
    block = json.loads(json.dumps(plans_content(plans)))["configurations"]["2d"]
    assert block["spacing"] == [1.0, 1.0] and block["median_image_size_in_voxels"] == [584, 565]


def test_3d_fullres_asked_for_2d_data_is_one_line():
    with pytest.raises(PlanningError, match="there is no 3d_fullres for 2D data; use -c 2d"):
        plan_cpu(PHOTOS, DATASET_JSON, "Dataset701_DRIVE", ("2d", "3d_fullres"))


def test_3d_data_keeps_both_and_old_three_value_2d_entries_load():
    volumes = _fingerprint([[40, 64, 60]] * 3, [[2.0, 1.0, 1.0]] * 3)
    plans = plan_cpu(volumes, DATASET_JSON, "Dataset900_Demo")
    assert sorted(plans.configurations) == ["2d", "3d_fullres"]
    assert plans.configurations["2d"].spacing == (1.0, 1.0)
    assert plans.configurations["3d_fullres"].spacing == (2.0, 1.0, 1.0)
    content = plans_content(plans)
    content["configurations"]["2d"]["spacing"] = [2.0, 1.0, 1.0]  # as plans were written
    assert plans_from_dict(content).configurations["2d"].spacing == (2.0, 1.0, 1.0)
