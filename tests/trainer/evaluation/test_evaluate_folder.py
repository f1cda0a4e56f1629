"""nnui-evaluate: exact numbers on known arrays, nnU-Net's summary.json layout (and its
values, where nnU-Net is installed), and one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainer.data.image_io import write_nifti
from trainer.evaluation.evaluate import evaluate_folders, main

# Case a: label 1 TP 1 FP 1 FN 1 TN 5, label 2 TP 2 FP 1 FN 0 TN 5.
# Case b: label 1 perfect (TP 2), label 2 absent from both (Dice and IoU undefined).
CASES = {
    "a": ([1, 1, 0, 0, 2, 2, 0, 0], [1, 0, 1, 0, 2, 2, 2, 0]),
    "b": ([1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]),
}


def _write(folder: Path, ending: str = ".nii.gz") -> tuple[Path, Path]:
    ref, pred = folder / "ref", folder / "pred"
    ref.mkdir()
    pred.mkdir()
    for case, (r, p) in CASES.items():
        for target, values in ((ref, r), (pred, p)):
            array = np.asarray(values, dtype=np.uint8).reshape(2, 2, 2)
            if ending == ".npy":
                np.save(target / f"{case}.npy", array)
            else:
                write_nifti(target / f"{case}{ending}", array, (1.0, 1.0, 1.0))
    return ref, pred


@pytest.mark.parametrize("ending", [".nii.gz", ".npy"])
def test_known_arrays_give_exact_numbers(tmp_path, ending):
    ref, pred = _write(tmp_path, ending)
    assert main([str(ref), str(pred), "-l", "1", "2", "-o", str(tmp_path / "s.json")]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary) == ["foreground_mean", "mean", "metric_per_case"]
    a, b = (c["metrics"] for c in summary["metric_per_case"])
    assert summary["metric_per_case"][0]["prediction_file"] == str(pred / f"a{ending}")
    assert summary["metric_per_case"][0]["reference_file"] == str(ref / f"a{ending}")
    assert a["1"] == {"Dice": 0.5, "IoU": 1 / 3, "TP": 1, "FP": 1, "FN": 1, "TN": 5,
                      "n_pred": 2, "n_ref": 2}  # fmt: skip
    assert a["2"] == {"Dice": 0.8, "IoU": 2 / 3, "TP": 2, "FP": 1, "FN": 0, "TN": 5,
                      "n_pred": 3, "n_ref": 2}  # fmt: skip
    assert b["1"]["Dice"] == 1.0 and b["1"]["TN"] == 6
    assert b["2"]["Dice"] is None and b["2"]["IoU"] is None and b["2"]["TN"] == 8
    mean = summary["mean"]
    assert mean["1"]["Dice"] == 0.75 and mean["1"]["TP"] == 1.5
    assert mean["2"]["Dice"] == 0.8  # the undefined case is skipped
    assert mean["2"]["FP"] == 0.5
    assert summary["foreground_mean"]["Dice"] == pytest.approx(0.775, abs=1e-15)
    assert summary["foreground_mean"]["IoU"] == pytest.approx(((1 / 3 + 1) / 2 + 2 / 3) / 2)


def test_labels_default_to_dataset_json_next_to_the_references(tmp_path):
    ref, pred = _write(tmp_path)
    (tmp_path / "dataset.json").write_text(json.dumps({"labels": {"background": 0, "x": 1}}))
    summary = evaluate_folders(ref, pred)
    assert list(summary["mean"]) == ["1"]
    assert summary["foreground_mean"]["Dice"] == 0.75


def test_the_dice_line_is_rounded_and_a_region_listed_twice_counts_once(tmp_path, capsys):
    ref, pred = _write(tmp_path)
    assert main([str(ref), str(pred), "-l", "1", "2", "-o", str(tmp_path / "s.json")]) == 0
    assert "foreground mean Dice 0.7750 -> " in capsys.readouterr().out
    # nnU-Net keys its means by region: the same region twice is one entry, one mean.
    twice = evaluate_folders(ref, pred, [(1, 2), (1, 2), 1])
    once = evaluate_folders(ref, pred, [(1, 2), 1])
    assert sorted(twice["mean"]) == ["(1, 2)", "1"]
    assert twice["foreground_mean"] == once["foreground_mean"]


def test_a_label_never_present_makes_the_foreground_mean_undefined(tmp_path):
    ref, pred = _write(tmp_path)
    summary = evaluate_folders(ref, pred, [1, 7])
    assert summary["mean"]["7"]["Dice"] is None and summary["foreground_mean"]["Dice"] is None
    assert summary["foreground_mean"]["TP"] == (1.5 + 0) / 2


def test_errors_are_one_line(tmp_path, capsys):
    ref, _ = _write(tmp_path)
    extra = tmp_path / "extra"
    extra.mkdir()
    write_nifti(extra / "a.nii.gz", np.zeros((2, 2, 2), np.uint8), (1, 1, 1))
    write_nifti(extra / "zz.nii.gz", np.zeros((2, 2, 2), np.uint8), (1, 1, 1))
    odd = tmp_path / "odd"
    odd.mkdir()
    write_nifti(odd / "a.nii.gz", np.zeros((2, 2, 3), np.uint8), (1, 1, 1))
    for argv, message in (
        ([str(ref), str(extra)], "zz.nii.gz has no reference"),
        ([str(ref), str(odd)], "without prediction"),
        ([str(ref), str(odd), "--chill"], "shapes differ"),
        ([str(ref), str(tmp_path / "nope")], "is not a folder"),
    ):
        capsys.readouterr()
        assert main([*argv, "-l", "1"]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and message in err, err
    assert main([str(ref), str(odd), "--chill", "-l", "1", "-o", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_equals_nnunet_evaluation(tmp_path):
    """Same values as nnU-Net 2.8.1's compute_metrics_on_folder_simple (NaN -> null)."""
    evaluation = pytest.importorskip("nnunetv2.evaluation.evaluate_predictions")
    ref, pred = _write(tmp_path)
    evaluation.compute_metrics_on_folder_simple(
        str(ref), str(pred), [1, 2], str(tmp_path / "theirs.json"), num_processes=1
    )
    theirs = evaluation.load_summary_json(str(tmp_path / "theirs.json"))
    ours = evaluate_folders(ref, pred, [1, 2])

    def same(x, y):
        if isinstance(x, float) and math.isnan(x):
            return y is None
        return x == pytest.approx(y, abs=1e-12)

    for mine, their in zip(ours["metric_per_case"], theirs["metric_per_case"], strict=True):
        for label in (1, 2):
            for metric, value in their["metrics"][label].items():
                assert same(value, mine["metrics"][str(label)][metric]), (label, metric)
    for label in (1, 2):
        for metric, value in theirs["mean"][label].items():
            assert same(value, ours["mean"][str(label)][metric]), (label, metric)
    for metric, value in theirs["foreground_mean"].items():
        assert same(value, ours["foreground_mean"][metric]), metric
