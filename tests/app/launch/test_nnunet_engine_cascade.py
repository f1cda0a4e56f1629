"""The cascade's dependency under the nnU-Net engine (issue 29, item 5): stock nnU-Net's
lowres folds write results/D/nnUNetTrainer__nnUNetPlans__3d_lowres/predicted_next_stage/
3d_cascade_fullres/CASE.b2nd (nnUNetTrainer.perform_actual_validation); a cascade fold
launched with `--engine nnunet --after-lowres` waits for them, naming the folds, then
starts; without them and without --after-lowres it is refused in one line, by `nnui launch`
and by the engine entry itself. The fake nnU-Net (tests/fake_nnunet) trains in seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, wait_until
from test_cli import launched_ids, nnui, status

from app.services.launch.stage_inputs import missing_at

ROOT = Path(__file__).resolve().parents[3]
FAKE_NNUNET = ROOT / "tests" / "fake_nnunet" / "nnUNetv2_train"
DATASET = "Dataset901_Cascade"
CASES = ["a", "b", "c"]
SPLITS = [{"train": ["a", "b"], "val": ["c"]}, {"train": ["c"], "val": ["a", "b"]}]
STAGE_DIR = f"{DATASET}/nnUNetTrainer__nnUNetPlans__3d_lowres"
INPUTS = f"{STAGE_DIR}/predicted_next_stage/3d_cascade_fullres"
CASCADE_FOLD = f"{DATASET}/nnUNetTrainer__nnUNetPlans__3d_cascade_fullres/fold_0"


def make_tree(base: Path, splits: bool = True) -> dict[str, str]:
    """nnU-Net's preprocessed layout for a lowres + cascade plans (files the checks read)."""
    dataset = base / "pre" / DATASET
    data = dataset / "nnUNetPlans_3d_fullres"
    data.mkdir(parents=True)
    for case in CASES:  # nnU-Net's blosc2 dataset: CASE.b2nd, CASE_seg.b2nd, CASE.pkl
        for name in (f"{case}.b2nd", f"{case}_seg.b2nd", f"{case}.pkl"):
            (data / name).write_bytes(b"")
    plans = {
        "plans_name": "nnUNetPlans",
        "configurations": {
            "3d_fullres": {"data_identifier": "nnUNetPlans_3d_fullres", "batch_size": 2,
                           "patch_size": [16, 16, 16]},
            "3d_lowres": {"inherits_from": "3d_fullres", "data_identifier": "nnUNetPlans_3d_lowres",
                          "next_stage": "3d_cascade_fullres"},
            "3d_cascade_fullres": {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"},
        },
    }  # fmt: skip
    (dataset / "nnUNetPlans.json").write_text(json.dumps(plans))
    if splits:
        (dataset / "splits_final.json").write_text(json.dumps(SPLITS))
    return {
        **os.environ,
        "NNUI_STATE_DIR": str(base / "state"),
        "nnUNet_raw": str(base / "raw"),
        "nnUNet_preprocessed": str(base / "pre"),
        "nnUNet_results": str(base / "res"),
        "NNUI_NNUNET_SCRIPT": str(FAKE_NNUNET),
        "FAKE_NNUNET_FINISH": "1",
        "PYTHONPATH": str(ROOT),
    }


def _missing(base: Path) -> tuple:
    stage, folds, _ = missing_at(base / "res" / CASCADE_FOLD, base / "pre", "0", "nnunet")
    return stage, folds


def test_the_inputs_are_nnunets_predicted_next_stage_files(tmp_path: Path) -> None:
    make_tree(tmp_path, splits=False)
    # nnU-Net writes splits_final.json when its first fold starts: before that every case
    # is needed and the folds that will validate them are unknown, so all are named.
    assert _missing(tmp_path) == ("3d_lowres", [0, 1, 2])
    (tmp_path / "pre" / DATASET / "splits_final.json").write_text(json.dumps(SPLITS))
    assert _missing(tmp_path) == ("3d_lowres", [0, 1])
    inputs = tmp_path / "res" / INPUTS
    inputs.mkdir(parents=True)
    (inputs / "c.b2nd").write_bytes(b"")
    assert _missing(tmp_path) == ("3d_lowres", [1])
    (inputs / "a.b2nd").write_bytes(b"")
    (inputs / "b.npz").write_bytes(b"")  # nnU-Net's numpy dataset class writes .npz
    assert _missing(tmp_path) == ("3d_lowres", [])
    # A stock lowres fold in its final validation (checkpoint_final.pth, no summary.json
    # yet) may still be writing its files: its cases are not ready.
    fold_1 = tmp_path / "res" / STAGE_DIR / "fold_1"
    fold_1.mkdir(parents=True)
    (fold_1 / "checkpoint_final.pth").write_bytes(b"")
    assert _missing(tmp_path) == ("3d_lowres", [1])
    (fold_1 / "validation").mkdir()
    (fold_1 / "validation" / "summary.json").write_text("{}")
    assert _missing(tmp_path) == ("3d_lowres", [])
    # Not a cascade: nothing to wait for.
    plain = tmp_path / "res" / DATASET / "nnUNetTrainer__nnUNetPlans__3d_fullres" / "fold_0"
    assert missing_at(plain, tmp_path / "pre", "0", "nnunet") == (None, [], None)


def test_the_engine_entry_refuses_a_cascade_fold_without_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = make_tree(tmp_path)
    argv = [sys.executable, "-m", "trainer.nnunet_engine", "901", "3d_cascade_fullres", "0",
            "-tr", "nnUNetTrainer_nnui", "-device", "cpu", "--epochs", "1"]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: 3d_cascade_fullres needs 3d_lowres")
    assert lines[0].endswith("train 3d_lowres fold(s) 0, 1 first"), lines
    assert str(tmp_path / "res" / INPUTS) in lines[0]
    assert not (tmp_path / "res" / CASCADE_FOLD).exists()

    from trainer.nnunet_engine import cascade_problem

    inputs = tmp_path / "res" / INPUTS
    inputs.mkdir(parents=True)
    for case in CASES:
        (inputs / f"{case}.b2nd").write_bytes(b"")
    for key in ("nnUNet_preprocessed", "nnUNet_results"):
        monkeypatch.setenv(key, env[key])
    cascade = ["901", "3d_cascade_fullres", "0", "-tr", "nnUNetTrainer_nnui"]
    assert cascade_problem(cascade) is None
    assert cascade_problem(["901", "3d_lowres", "0"]) is None


needs_nnunet = pytest.mark.skipif(
    importlib.util.find_spec("nnunetv2") is None,
    reason="the nnU-Net engine is offered only where nnunetv2 is installed",
)


@pytest.fixture
def env(tmp_path: Path):
    values = make_tree(tmp_path)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


@needs_nnunet
def test_launch_refuses_a_cascade_fold_without_inputs_in_one_line(env: dict) -> None:
    done = nnui(env, "launch", "901", "3d_cascade_fullres", "--cpu", "--folds", "0",
                "--engine", "nnunet", "--", "--epochs", "1")  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: 3d_cascade_fullres fold 0 needs 3d_lowres fold(s) 0, 1")
    assert "--after-lowres" in errors[0] and str(Path(env["nnUNet_results"]) / INPUTS) in errors[0]
    assert not (Path(env["nnUNet_results"]) / CASCADE_FOLD).exists()
    assert status(env) == {}


@needs_nnunet
def test_an_nnunet_cascade_fold_waits_for_the_lowres_folds_then_runs(env: dict) -> None:
    results = Path(env["nnUNet_results"])
    flags = ["--cpu", "--engine", "nnunet"]
    cascade = nnui(env, "launch", "901", "3d_cascade_fullres", "--folds", "0", *flags,
                   "--after-lowres", "--", "--epochs", "1")  # fmt: skip
    (cascade_id,) = launched_ids(cascade)

    def reason() -> str:
        return status(env)[cascade_id]["waiting_reason"] or ""

    assert wait_until(lambda: reason() == "inputs: 3d_lowres fold(s) 0, 1 not done")
    # The waiting cascade fold holds no CPU slot: the lowres folds start at once.
    (lowres_0,) = launched_ids(nnui(env, "launch", "901", "3d_lowres", "--folds", "0", *flags))
    assert wait_until(lambda: status(env)[lowres_0]["state"] == "finished")
    assert (results / INPUTS / "c.b2nd").is_file()  # fold 0's validation case, by "nnU-Net"
    assert wait_until(lambda: reason() == "inputs: 3d_lowres fold(s) 1 not done")
    assert status(env)[cascade_id]["state"] == "queued"
    assert not any((results / CASCADE_FOLD).glob("training_log_*.txt"))  # not started

    (lowres_1,) = launched_ids(nnui(env, "launch", "901", "3d_lowres", "--folds", "1", *flags))
    # The fake cascade fold exits 3 when any of its cases' files is missing.
    assert wait_until(lambda: status(env)[cascade_id]["state"] == "finished")
    row = status(env)[cascade_id]
    assert row["exit_code"] == 0 and row["waiting_reason"] is None
    assert status(env)[lowres_1]["state"] == "finished"
    assert any((results / CASCADE_FOLD).glob("training_log_*.txt"))


@needs_nnunet
def test_a_cascade_fold_stopped_while_waiting_resumes_waiting(env: dict) -> None:
    launched = nnui(env, "launch", "901", "3d_cascade_fullres", "--folds", "0", "--cpu",
                    "--engine", "nnunet", "--after-lowres", "--", "--epochs", "1")  # fmt: skip
    (job_id,) = launched_ids(launched)
    waiting = "inputs: 3d_lowres fold(s) 0, 1 not done"
    assert wait_until(lambda: status(env)[job_id]["waiting_reason"] == waiting)
    stop = nnui(env, "stop", job_id, "--yes")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: status(env)[job_id]["state"] == "stopped")

    resumed = nnui(env, "resume", job_id)
    (new_id,) = launched_ids(resumed)
    assert wait_until(lambda: status(env)[new_id]["waiting_reason"] == waiting)
    inputs = Path(env["nnUNet_results"]) / INPUTS
    inputs.mkdir(parents=True)
    for case in CASES:
        (inputs / f"{case}.b2nd").write_bytes(b"")
    assert wait_until(lambda: status(env)[new_id]["state"] == "finished")
    assert status(env)[new_id]["exit_code"] == 0


def test_nnuis_own_cascade_waits_before_its_splits_exist_too(tmp_path: Path) -> None:
    """nnui's trainer also writes splits_final.json when its first fold starts."""
    dataset = tmp_path / "pre" / DATASET
    data = dataset / "nnuiPlans_3d_fullres"
    data.mkdir(parents=True)
    for case in CASES:
        for name in (f"{case}.b2nd", f"{case}_seg.b2nd", f"{case}.json"):
            (data / name).write_bytes(b"")
    plans = {
        "configurations": {
            "3d_fullres": {"data_identifier": "nnuiPlans_3d_fullres"},
            "3d_cascade_fullres": {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"},
        }
    }
    (dataset / "nnuiPlans.json").write_text(json.dumps(plans))
    fold = tmp_path / "res" / DATASET / "nnuiTrainer__nnuiPlans__3d_cascade_fullres" / "fold_0"
    stage, folds, folder = missing_at(fold, tmp_path / "pre", "0", "nnui")
    assert (stage, folds) == ("3d_lowres", [0, 1, 2])
    lowres = fold.parents[1] / "nnuiTrainer__nnuiPlans__3d_lowres"
    assert folder == lowres / "predicted_next_stage" / "3d_cascade_fullres"
