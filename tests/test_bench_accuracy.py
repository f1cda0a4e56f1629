"""bench/accuracy.py: what it reads from each side and how it reports (no training here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import accuracy


def _args(**overrides) -> accuracy.AccuracyArgs:
    values = dict(
        work=Path("/tmp/x"), cases=20, shape_scale=0.5, configuration="2d", epochs=3,
        iterations=2, val_iterations=1, folds=["0", "1"], repeats=1, num_workers=2,
        order="alternate", nnui_args=[],
    )  # fmt: skip
    values.update(overrides)
    return accuracy.AccuracyArgs(**values)


def test_read_summary_takes_foreground_mean_and_per_label_dice(tmp_path):
    path = tmp_path / "summary.json"
    summary = {
        "foreground_mean": {"Dice": 0.75, "IoU": 0.6},
        "mean": {"1": {"Dice": 0.9, "IoU": 0.8}, "2": {"Dice": 0.6, "IoU": 0.4}},
        "metric_per_case": [],
    }
    path.write_text(json.dumps(summary))
    assert accuracy.read_summary(path) == (0.75, {"1": 0.9, "2": 0.6})


def test_read_summary_of_a_missing_file_is_nan(tmp_path):
    fg, labels = accuracy.read_summary(tmp_path / "absent.json")
    assert fg != fg and labels == {}


def test_nnunet_pseudo_dice_reads_numpy_reprs_from_its_log(tmp_path):
    (tmp_path / "training_log_2026_1_1_00_00_00.txt").write_text(
        "2026-12-01 18:57:21.273432: Pseudo dice [np.float32(0.2), np.float32(0.4)]\n"
        "2026-12-01 18:57:33.729146: Pseudo dice [0.5, 0.7]\n"
    )
    assert accuracy.nnunet_pseudo_dice(tmp_path) == [0.3, 0.6]


def test_nnui_pseudo_dice_reads_epoch_ended_events(tmp_path):
    events = tmp_path / "events.jsonl"
    lines = [
        {"kind": "run_started"},
        {"kind": "epoch_ended", "epoch": 1, "mean_fg_dice": 0.25},
        {"kind": "epoch_ended", "epoch": 2, "mean_fg_dice": 0.5},
    ]
    events.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "epo')  # torn tail
    assert accuracy.nnui_pseudo_dice(events) == [0.25, 0.5]


def test_learned_epoch_is_the_first_epoch_each_label_reaches_half(tmp_path):
    (tmp_path / "training_log_2026_1_1_00_00_00.txt").write_text(
        "".join(f"x: Pseudo dice [{a}, {b}]\n" for a, b in [(0.3, 0.0), (0.8, 0.2), (0.9, 0.6)])
    )
    curves = accuracy.nnunet_pseudo_dice_per_label(tmp_path)
    assert accuracy.learned_epoch(curves) == {"1": 1, "2": 2}
    events = tmp_path / "events.jsonl"
    rows = [{"kind": "epoch_ended", "dice_per_class": [0.7, x]} for x in (0.0, 0.1)]
    events.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    per_label = accuracy.nnui_pseudo_dice_per_label(events)
    assert accuracy.learned_epoch(per_label) == {"1": 0, "2": None}


def test_summary_ends_with_the_difference_and_wall_ratio_lines():
    def run(side, fold, dice, wall):
        return accuracy.FoldRun(side, fold, 0, 0, dice, {"1": dice}, wall, 2 * wall)

    runs = [
        run("nnU-Net", "0", 0.80, 100.0),
        run("nnui", "0", 0.82, 60.0),
        run("nnU-Net", "1", 0.70, 100.0),
        run("nnui", "1", 0.66, 60.0),
    ]
    lines = accuracy.summarize(_args(), runs)
    assert lines[-2] == "mean foreground Dice difference nnui - nnU-Net = -0.010"
    assert lines[-1] == "wall time ratio nnui/nnU-Net = 0.60"
    assert "CPU-s ratio nnui/nnU-Net = 0.60" in lines


def test_repeats_run_every_fold_again_and_count_in_the_spread():
    a = _args(folds=["0", "1"], repeats=2)
    assert a.units() == [("0", 0), ("1", 0), ("0", 1), ("1", 1)]

    def run(side, fold, repeat, dice):
        return accuracy.FoldRun(side, fold, repeat, 0, dice, {"1": dice}, 10.0, 5.0)

    runs = [
        run(side, fold, repeat, 0.5 + (0.1 if side == "nnui" else 0.0) + 0.01 * repeat)
        for fold, repeat in a.units()
        for side in accuracy.SIDES
    ]
    lines = accuracy.summarize(a, runs)
    assert sum(line.startswith("fold 1 repeat 1: foreground Dice") for line in lines) == 1
    assert "Dice difference per run: +0.100 +0.100 +0.100 +0.100" in "\n".join(lines)
    assert lines[-2] == "mean foreground Dice difference nnui - nnU-Net = +0.100"


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--folds", "7"],
        ["--epochs", "0"],
        ["--cases", "3"],
        ["--shape-scale", "9"],
    ],
)
def test_bad_arguments_exit_2_with_one_error_line(argv, capsys):
    assert accuracy.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
