"""Planning rules (anisotropy, topology, patch divisibility), plans.json, splits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data.planning import (
    Overrides,
    PlanningError,
    plan_experiment,
    plan_network,
    plan_patch,
    target_spacing,
)
from trainer.plans import load_plans, plans_file, plans_to_json
from trainer.splits import create_splits, fold_cases, load_or_create_splits


@pytest.mark.parametrize(
    ("spacings", "shapes", "expected"),
    [
        # isotropic: the median
        ([[1, 1, 1], [1.2, 1, 1], [0.8, 1, 1]], [[100, 100, 100]] * 3, (1.0, 1.0, 1.0)),
        # coarse axis (5 mm vs 1 mm) with few slices (20 * 3 < 200): 10th percentile
        (
            [[5, 1, 1], [4, 1, 1], [6, 1, 1], [3, 1, 1], [7, 1, 1]],
            [[20, 200, 200]] * 5,
            (float(np.percentile([5, 4, 6, 3, 7], 10)), 1.0, 1.0),
        ),
        # coarse axis but many slices: stays the median
        ([[5, 1, 1], [4, 1, 1], [6, 1, 1]], [[100, 200, 200]] * 3, (5.0, 1.0, 1.0)),
        # less than 3x coarser: the median
        ([[2.5, 1, 1], [2, 1, 1], [2.8, 1, 1]], [[20, 200, 200]] * 3, (2.5, 1.0, 1.0)),
    ],
)
def test_target_spacing_anisotropy_rule(spacings, shapes, expected):
    got = target_spacing(np.array(spacings, float), np.array(shapes, float))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("median_shape", "spacing"),
    [
        ((57, 67, 70), (2.3, 0.79, 0.79)),
        ((130, 140, 150), (1.0, 1.0, 1.0)),
        ((20, 300, 300), (5.0, 0.7, 0.7)),
        ((9, 13, 11), (1.0, 1.0, 1.0)),
        ((67, 70), (0.79, 0.79)),
        ((512, 400), (0.5, 0.6)),
    ],
)
def test_patch_is_divisible_by_pooling_and_fits_budget(median_shape, spacing):
    patch = plan_patch(median_shape, spacing)
    network = plan_network(patch, spacing)
    assert all(p % d == 0 for p, d in zip(patch, network.pooling_divisor, strict=True))
    assert np.prod(patch) <= 1.3 * (48 * 64 * 64 if len(patch) == 3 else 64 * 64)
    assert network.strides[0] == (1,) * len(patch)
    assert len(network.kernel_sizes) == network.num_stages == len(network.strides)
    assert len(network.n_conv_per_stage_decoder) == network.num_stages - 1
    assert max(network.features_per_stage) <= (320 if len(patch) == 3 else 512)
    # the deepest feature map is never below 4 voxels on a pooled axis
    for p, d in zip(patch, network.pooling_divisor, strict=True):
        assert d == 1 or p // d >= 4


def test_demo_like_data_gets_the_cpu_sized_patch():
    assert plan_patch((57, 67, 70), (2.3, 0.79, 0.79)) == (48, 64, 64)
    assert plan_patch((67, 70), (0.79, 0.79)) == (64, 64)
    assert plan_patch((30, 40, 40), (1.0, 1.0, 1.0)) == (32, 40, 40)  # small: the median


def test_very_anisotropic_axis_gets_kernel_1_and_no_early_pooling():
    net = plan_network((16, 128, 128), (5.0, 0.7, 0.7))
    assert net.kernel_sizes[0] == (1, 3, 3)
    assert net.strides[1] == (1, 2, 2)
    assert net.features_per_stage[:3] == (32, 64, 128)
    assert plan_network((64, 64), (1.0, 1.0)).features_per_stage[-1] <= 512


FINGERPRINT = {
    "spacings": [[2.0, 0.8, 0.8], [3.0, 0.8, 0.8], [2.5, 0.7, 0.7]],
    "shapes_after_crop": [[60, 80, 80], [50, 90, 90], [55, 85, 85]],
    "median_relative_size_after_cropping": 0.6,
    "foreground_intensity_properties_per_channel": {"0": {"mean": 1.0, "std": 2.0}},
}
DATASET_JSON = {
    "channel_names": {"0": "MRI"},
    "labels": {"background": 0, "organ": 1, "lesion": 2},
    "file_ending": ".nii.gz",
}


def test_plan_experiment_and_json_round_trip(tmp_path):
    plans = plan_experiment(FINGERPRINT, DATASET_JSON, "Dataset900_NnuiDemo")
    assert set(plans.configurations) == {"2d", "3d_fullres"}
    c3 = plans.configuration("3d_fullres")
    assert c3.ndim == 3 and c3.batch_size == 2 and c3.use_mask_for_norm == (True,)
    assert c3.normalization_schemes == ("ZScoreNormalization",)
    assert plans.configuration("2d").ndim == 2 and plans.configuration("2d").batch_size >= 2
    assert plans.num_classes == 3
    plans_file(tmp_path).write_text(plans_to_json(plans))
    loaded = load_plans(tmp_path)
    assert loaded == plans and len(loaded.identity) == 64
    with pytest.raises(
        ValueError, match=r"configuration 'x' not in plans; available: 2d, 3d_fullres"
    ):
        loaded.configuration("x")


def test_identity_is_stable_and_tracks_content():
    a = plan_experiment(FINGERPRINT, DATASET_JSON, "Dataset900_NnuiDemo")
    b = plan_experiment(FINGERPRINT, DATASET_JSON, "Dataset900_NnuiDemo")
    c = plan_experiment(
        FINGERPRINT, DATASET_JSON, "Dataset900_NnuiDemo", overrides=Overrides(batch_size={"2d": 3})
    )
    assert a.identity == b.identity != c.identity


def test_ct_channel_uses_ct_normalisation_without_mask():
    dataset_json = dict(DATASET_JSON, channel_names={"0": "CT"})
    plans = plan_experiment(FINGERPRINT, dataset_json, "Dataset900_NnuiDemo")
    config = plans.configuration("3d_fullres")
    assert config.normalization_schemes == ("CTNormalization",)
    assert config.use_mask_for_norm == (False,)


def test_patch_override_must_be_divisible():
    with pytest.raises(PlanningError, match="not divisible"):
        plan_experiment(
            FINGERPRINT,
            DATASET_JSON,
            "D",
            overrides=Overrides(patch_size={"3d_fullres": (17, 32, 32)}),
        )


def test_load_plans_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nnui-preprocess"):
        load_plans(tmp_path)
    plans_file(tmp_path).write_text("{not json")
    with pytest.raises(ValueError, match="not a valid plans file"):
        load_plans(tmp_path)


IDS = [f"case_{i:02d}" for i in range(12)]


def test_splits_are_five_disjoint_deterministic_folds(tmp_path):
    splits = load_or_create_splits(tmp_path, list(reversed(IDS)))
    assert len(splits) == 5
    vals = [case for fold in splits for case in fold["val"]]
    assert sorted(vals) == IDS
    for fold in splits:
        assert sorted(fold["train"] + fold["val"]) == IDS
    assert splits == create_splits(IDS)  # order of the input does not matter
    assert splits != create_splits(IDS, seed=1)


def test_tiny_datasets_get_one_fold_per_case():
    assert create_splits(["a"]) == [{"train": ["a"], "val": ["a"]}]
    splits = create_splits(["a", "b", "c"])
    assert len(splits) == 3 and sorted(v for f in splits for v in f["val"]) == ["a", "b", "c"]


def test_existing_splits_file_is_kept(tmp_path):
    custom = [{"train": IDS[:10], "val": IDS[10:]}] * 5
    (tmp_path / "splits_final.json").write_text(json.dumps(custom))
    assert load_or_create_splits(tmp_path, IDS) == custom


def test_fold_cases():
    splits = create_splits(IDS)
    train, val = fold_cases(splits, "0", IDS)
    assert val == splits[0]["val"] and set(train).isdisjoint(val)
    assert fold_cases(splits, "all", IDS) == (IDS, IDS)
    for bad in ("5", "x", "-1"):
        with pytest.raises(ValueError, match="does not exist"):
            fold_cases(splits, bad, IDS)
