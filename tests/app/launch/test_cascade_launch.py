"""`nnui launch D 3d_cascade_fullres --after-lowres` (issue 29, item 4): each cascade fold is
queued and its supervisor waits until the 3d_lowres folds that validated its cases wrote
their segmentations (predicted_next_stage), naming the folds it waits for; then it starts.
Fake trainer, CPU; the inputs are written by the test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_trainer import DEMO_DATASET, cleanup_jobs, fake_env, wait_until
from test_cli import launched_ids, nnui, status

SPLITS = [{"train": ["a", "b"], "val": ["c"]}, {"train": ["c"], "val": ["a", "b"]}]


@pytest.fixture
def env(tmp_path: Path):
    values = {**os.environ, **fake_env(tmp_path)}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    dataset = tmp_path / "preprocessed" / DEMO_DATASET
    plans = json.loads((dataset / "nnuiPlans.json").read_text())
    plans["configurations"]["3d_lowres"] = {"patch_size": [32, 32, 32], "batch_size": 2,
                                            "next_stage": "3d_cascade_fullres"}  # fmt: skip
    plans["configurations"]["3d_cascade_fullres"] = {
        "inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}  # fmt: skip
    (dataset / "nnuiPlans.json").write_text(json.dumps(plans))
    (dataset / "splits_final.json").write_text(json.dumps(SPLITS))
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def test_cascade_fold_waits_for_the_lowres_folds_then_runs(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_cascade_fullres", "--cpu", "--folds", "0",
                  "--after-lowres", "--", "--epochs", "2", "--epoch-time", "0.1")  # fmt: skip
    (job_id,) = launched_ids(result)
    inputs = (Path(env["nnUNet_results"]) / DEMO_DATASET / "nnuiTrainer__nnuiPlans__3d_lowres"
              / "predicted_next_stage" / "3d_cascade_fullres")  # fmt: skip

    def reason() -> str:
        return status(env)[job_id]["waiting_reason"] or ""

    assert wait_until(lambda: reason() == "inputs: 3d_lowres fold(s) 0, 1 not done")
    assert status(env)[job_id]["state"] == "queued"
    inputs.mkdir(parents=True)
    (inputs / "c.b2nd").write_bytes(b"")  # lowres fold 0 done: its validation case c
    assert wait_until(lambda: reason() == "inputs: 3d_lowres fold(s) 1 not done")
    assert status(env)[job_id]["state"] == "queued"
    for case in ("a", "b"):
        (inputs / f"{case}.b2nd").write_bytes(b"")
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished")
    assert status(env)[job_id]["waiting_reason"] is None
