"""The real nnU-Net 2.8.1 as nnui's engine on the smallest cascade of a region dataset
(issue 29, item 5), end to end on CPU (slow: a few minutes).

A BraTS-like region dataset (nested regions, one of them a single value) planned and
preprocessed by nnU-Net itself, 3d_lowres and 3d_cascade_fullres added to its plans as
nnU-Net's own integration test does. The cascade fold is launched first with
--after-lowres and waits, naming the lowres folds; the lowres fold (`all`: it validates,
so writes predicted_next_stage for, every case) shows per-region pseudo Dice named by
region, is stopped and resumed with nnui's machinery, writes its next-stage files; then the
cascade fold starts by itself and finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_trainer import cleanup_jobs, wait_until
from nnui_cli import job_row, run_nnui

ROOT = Path(__file__).resolve().parents[2]
DATASET = "Dataset900_NnuiDemo"
NUM_CASES = 3  # fold 'all' validates (and writes the next stage of) every case
REGIONS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3}
NAMES = ["whole tumor", "tumor core", "enhancing tumor"]
LOWRES = Path(DATASET) / "nnUNetTrainer__nnUNetPlans__3d_lowres"
CASCADE = Path(DATASET) / "nnUNetTrainer__nnUNetPlans__3d_cascade_fullres" / "fold_all"
TINY = ["--iterations-per-epoch", "1", "--val-iterations", "1"]

# A hang guard for a busy shared box (measured there: 624 s at load ~22 on 2 cores).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _write_dataset(raw: Path) -> None:
    from trainer.data.image_io import write_nifti
    from trainer.demo import make_case

    folder = raw / DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
    for index in range(NUM_CASES):
        image, label, spacing = make_case(0, index, 0.25)
        nested = label.copy()  # label 3: the lesion's low-x half (enhancing inside core)
        lesion = np.argwhere(label == 2)
        if len(lesion):
            low_x = np.arange(label.shape[2])[None, None, :] <= np.median(lesion[:, 2])
            nested[(label == 2) & low_x] = 3
        write_nifti(folder / "imagesTr" / f"demo_{index:03d}_0000.nii.gz", image, spacing)
        write_nifti(folder / "labelsTr" / f"demo_{index:03d}.nii.gz", nested, spacing)
    dataset_json = {"channel_names": {"0": "MRI"}, "labels": REGIONS, "numTraining": NUM_CASES,
                    "file_ending": ".nii.gz", "regions_class_order": [1, 2, 3]}  # fmt: skip
    (folder / "dataset.json").write_text(json.dumps(dataset_json, indent=1))


def _add_cascade(plans_path: Path) -> None:
    """3d_lowres (half the in-plane resolution) and 3d_cascade_fullres, as nnU-Net's
    tests/integration_tests/add_lowres_and_cascade.py adds them to a small dataset."""
    plans = json.loads(plans_path.read_text())
    spacing = plans["configurations"]["3d_fullres"]["spacing"]
    plans["configurations"]["3d_lowres"] = {
        "inherits_from": "3d_fullres", "data_identifier": "nnUNetPlans_3d_lowres",
        "spacing": [spacing[0], spacing[1] * 2, spacing[2] * 2],
        "next_stage": "3d_cascade_fullres",
    }  # fmt: skip
    plans["configurations"]["3d_cascade_fullres"] = {
        "inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}  # fmt: skip
    plans_path.write_text(json.dumps(plans, indent=1))


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    pytest.importorskip("nnunetv2", reason="make setup installs nnunetv2 (extra 'nnunet')")
    base = tmp_path_factory.mktemp("nnunet_cascade")
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "NNUI_STATE_DIR": str(base / "state"),
        "nnUNet_raw": str(base / "raw"), "nnUNet_preprocessed": str(base / "pre"),
        "nnUNet_results": str(base / "res"),
        # nnU-Net's defaults start 8 export and 12 augmentation processes: too many here
        "nnUNet_def_n_proc": "1", "nnUNet_n_proc_DA": "1",
    }  # fmt: skip
    _write_dataset(base / "raw")
    bin_dir = Path(sys.executable).parent
    steps = [["nnUNetv2_extract_fingerprint", "-d", "900", "-np", "1"],
             ["nnUNetv2_plan_experiment", "-d", "900"]]  # fmt: skip
    for step in steps:
        done = subprocess.run([str(bin_dir / step[0]), *step[1:]], env=env, capture_output=True,
                              text=True)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    _add_cascade(base / "pre" / DATASET / "nnUNetPlans.json")
    preprocess = [str(bin_dir / "nnUNetv2_preprocess"), "-d", "900", "-c", "3d_fullres",
                  "3d_lowres", "-np", "1", "1"]  # fmt: skip
    done = subprocess.run(preprocess, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    try:  # trainings: nnU-Net's single-threaded loaders (the planner needs 1 or more)
        yield {"base": base, "env": {**env, "nnUNet_n_proc_DA": "0"}}
    finally:
        cleanup_jobs(base / "state")


def _events(folder: Path) -> list[dict]:
    try:
        lines = (folder / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _kinds(folder: Path) -> list[str]:
    return [e["kind"] for e in _events(folder)]


def _launched(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()[0]


def test_a_region_cascade_waits_for_its_lowres_fold_stopped_and_resumed(tree) -> None:
    results = tree["base"] / "res"
    lowres = results / LOWRES / "fold_all"
    inputs = results / LOWRES / "predicted_next_stage" / "3d_cascade_fullres"
    cascade_id = _launched(run_nnui(tree["env"], "launch", "900", "3d_cascade_fullres",
                                    "--cpu", "--folds", "all", "--engine", "nnunet",
                                    "--after-lowres", "--", "--epochs", "1", *TINY))  # fmt: skip
    assert wait_until(lambda: job_row(tree["env"], cascade_id)["waiting_reason"]
                      == "inputs: 3d_lowres fold(s) 0, 1, 2 not done")  # fmt: skip

    lowres_id = _launched(run_nnui(tree["env"], "launch", "900", "3d_lowres", "--cpu",
                                   "--folds", "all", "--engine", "nnunet", "--", "--epochs",
                                   "12", *TINY))  # fmt: skip
    assert wait_until(lambda: "epoch_ended" in _kinds(lowres), 300)
    started = next(e for e in _events(lowres) if e["kind"] == "run_started")
    first = next(e for e in _events(lowres) if e["kind"] == "epoch_ended")
    assert started["class_names"] == NAMES and len(first["dice_per_class"]) == 3
    _region_curves_named(tree, lowres_id)

    stop = run_nnui(tree["env"], "stop", lowres_id, "--yes")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: job_row(tree["env"], lowres_id)["exit_code"] is not None, 300)
    row = job_row(tree["env"], lowres_id)
    assert row["state"] == "stopped" and row["exit_code"] == 0, row
    assert (lowres / "checkpoint_latest.pth").is_file()
    assert not inputs.is_dir() or not any(inputs.iterdir())  # no validation after a stop
    assert job_row(tree["env"], cascade_id)["state"] == "queued"

    resumed_id = _launched(run_nnui(tree["env"], "resume", lowres_id))
    assert wait_until(lambda: job_row(tree["env"], resumed_id)["exit_code"] is not None, 900)
    row = job_row(tree["env"], resumed_id)
    assert row["state"] == "finished" and row["exit_code"] == 0, row
    kinds = _kinds(lowres)
    assert kinds.count("run_started") == 2 and kinds[-1] == "finished", kinds
    final = next(e for e in _events(lowres) if e["kind"] == "validation_finished")
    assert final["class_names"] == NAMES and len(final["dice_per_class"]) == 3
    cases = [f"demo_{i:03d}" for i in range(NUM_CASES)]
    assert sorted(p.stem for p in inputs.glob("*.b2nd")) == cases  # every case: fold 'all'

    # The cascade fold started by itself once the lowres fold's validation was written.
    assert wait_until(lambda: job_row(tree["env"], cascade_id)["exit_code"] is not None, 900)
    row = job_row(tree["env"], cascade_id)
    assert row["state"] == "finished" and row["exit_code"] == 0, row
    assert _kinds(results / CASCADE)[-1] == "finished"
    assert (results / CASCADE / "validation" / "summary.json").is_file()


def _region_curves_named(tree: dict, job_id: str) -> None:
    """The board's view of the running lowres job: its per-class curves carry the regions'
    names (what the job detail plots)."""
    from app.services.jobs.registry import Registry
    from app.services.jobs.views import JobTracker
    from app.widgets.curves import plot_fields

    view = next(v for v in JobTracker(Registry(tree["base"] / "state")).refresh()
                if v.job.job_id == job_id)  # fmt: skip
    assert view.class_names == tuple(NAMES)
    classes = len(view.history[0].dice_per_class)
    fields = plot_fields((("Dice", "dice_class"),), classes, view.class_names)
    assert [label for label, _ in fields] == NAMES
