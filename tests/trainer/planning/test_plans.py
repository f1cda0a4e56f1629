"""Planning rules (anisotropy, topology, patch divisibility), plans.json, splits."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.planning.cpu import plan_cpu as plan_experiment  # the CPU planner's rules
from trainer.planning.cpu import plan_network, plan_patch
from trainer.planning.plans import (
    content_to_json,
    load_plans,
    merge_plans,
    plans_content,
    plans_file,
    plans_to_json,
)
from trainer.planning.rules import CPU_PLANS, Overrides, PlanningError, target_spacing
from trainer.planning.splits import SplitsError, create_splits, fold_cases, load_or_create_splits


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
    plans_file(tmp_path, CPU_PLANS).write_text(plans_to_json(plans))
    loaded = load_plans(tmp_path, CPU_PLANS)
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


def test_identity_of_a_configuration_ignores_the_other_configurations():
    a = plan_experiment(FINGERPRINT, DATASET_JSON, "D")
    other_2d = plan_experiment(
        FINGERPRINT, DATASET_JSON, "D", overrides=Overrides(batch_size={"2d": 3})
    )
    other_3d = plan_experiment(
        FINGERPRINT, DATASET_JSON, "D", overrides=Overrides(batch_size={"3d_fullres": 3})
    )
    only_3d = plan_experiment(FINGERPRINT, DATASET_JSON, "D", ("3d_fullres",))
    labels = plan_experiment(FINGERPRINT, dict(DATASET_JSON, labels={"background": 0, "x": 1}), "D")
    assert a.identity_of("3d_fullres") == other_2d.identity_of("3d_fullres")
    assert a.identity_of("3d_fullres") == only_3d.identity_of("3d_fullres")
    assert a.identity_of("2d") != other_2d.identity_of("2d")
    assert a.identity_of("3d_fullres") != other_3d.identity_of("3d_fullres")
    for name in ("2d", "3d_fullres"):  # dataset-level fields count for every configuration
        assert a.identity_of(name) != labels.identity_of(name)
    assert a.identity_of("2d") != a.identity_of("3d_fullres")
    with pytest.raises(ValueError, match="available: 3d_fullres"):
        only_3d.identity_of("2d")


def test_merge_keeps_other_configurations_byte_identical(tmp_path):
    from dataclasses import replace

    full = plan_experiment(FINGERPRINT, DATASET_JSON, "D")
    with_ids = replace(
        full,
        configurations={n: replace(c, case_ids=("a", "b")) for n, c in full.configurations.items()},
    )
    assert with_ids.identity_of("2d") == full.identity_of("2d")  # case list is bookkeeping
    existing = json.loads(plans_to_json(with_ids))
    new_2d = plan_experiment(
        FINGERPRINT, DATASET_JSON, "D", ("2d",), Overrides(batch_size={"2d": 5})
    )
    content, dropped = merge_plans(new_2d, existing)
    assert dropped == [] and list(content["configurations"]) == ["2d", "3d_fullres"]
    old_block = json.dumps(existing["configurations"]["3d_fullres"], indent=1)
    assert json.dumps(content["configurations"]["3d_fullres"], indent=1) == old_block
    plans_file(tmp_path, CPU_PLANS).write_text(content_to_json(content))
    merged = load_plans(tmp_path, CPU_PLANS)
    assert merged.identity_of("3d_fullres") == full.identity_of("3d_fullres")
    assert merged.configuration("2d").batch_size == 5
    assert merged.configuration("3d_fullres").case_ids == ("a", "b")
    # Different raw data (intensity properties) -> the other configuration is dropped.
    changed = json.loads(json.dumps(existing))
    changed["foreground_intensity_properties_per_channel"]["0"]["mean"] = 1234.0
    content, dropped = merge_plans(new_2d, changed)
    assert dropped == ["3d_fullres"] and list(content["configurations"]) == ["2d"]
    assert merge_plans(new_2d, None) == (plans_content(new_2d), [])


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


@pytest.mark.parametrize(
    ("config", "key", "value", "message"),
    [
        ("2d", "patch_size", [0, 32], "patch_size [0, 32] must be 2 or 3 sizes >= 1"),
        ("3d_fullres", "patch_size", [-16, 32, 32], "must be 2 or 3 sizes >= 1"),
        ("3d_fullres", "patch_size", [16, 32], "strides do not match a 2d patch"),
        ("3d_fullres", "patch_size", [17, 32, 32], "not a multiple of the network's"),
        ("2d", "batch_size", 0, "batch_size 0 must be >= 1"),
        ("2d", "spacing", [1.0, 0.0, 1.0], "must be 2 or 3 positive numbers"),
        ("3d_fullres", "spacing", [1.0, 1.0], "spacing [1.0, 1.0] must be 3 positive numbers"),
    ],
)
def test_hand_edited_plans_no_training_could_use_are_refused(tmp_path, config, key, value, message):
    plans = plan_experiment(FINGERPRINT, DATASET_JSON, "Dataset900_NnuiDemo")
    content = json.loads(plans_to_json(plans))
    content["configurations"][config][key] = value
    plans_file(tmp_path).write_text(json.dumps(content))
    with pytest.raises(ValueError, match="not a valid plans file") as error:
        load_plans(tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


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


@pytest.mark.parametrize(
    ("num_cases", "fold", "message"),
    [
        (3, "3", r"fold 3 does not exist in splits_final.json \(3 cases give 3 folds\); "
         r"choose 0-2 or 'all'"),
        (1, "1", r"fold 1 does not exist .*\(1 cases give 1 folds\); choose 0 or 'all'"),
        (12, "5", r"fold 5 does not exist in splits_final.json; choose 0-4 or 'all'"),
    ],
)  # fmt: skip
def test_fold_beyond_the_splits_of_a_small_dataset(tmp_path, num_cases, fold, message):
    ids = IDS[:num_cases]
    splits = load_or_create_splits(tmp_path, ids)
    with pytest.raises(SplitsError, match=message):
        fold_cases(splits, fold, ids)
    assert fold_cases(splits, "all", ids) == (ids, ids)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("", "is not valid JSON"),
        ('{"train": []}', "is not a list of"),
        ("[]", "is not a list of"),
        ('[{"train": ["a"]}]', "is not a list of"),
        ('[{"train": "a", "val": ["a"]}]', "is not a list of"),
        ('[{"train": [1], "val": ["a"]}]', "is not a list of"),
    ],
)
def test_corrupt_splits_file_is_one_clear_error(tmp_path, text, message):
    (tmp_path / "splits_final.json").write_text(text)
    with pytest.raises(SplitsError, match=message) as info:
        load_or_create_splits(tmp_path, IDS)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)
    assert "delete it to recreate it" in str(info.value)
