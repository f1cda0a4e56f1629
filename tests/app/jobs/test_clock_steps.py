"""Events that survive clocks: order and state come from the file's order, never from `t`.
A clock stepped back (NTP) by 1 s or 60 s in the middle of a run leaves a finished run
finished with every epoch, in the board's model, `nnui status`, `nnui cv`'s folds and
`nnui export`; records that break the contract are skipped and counted."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
from test_jobs import add_job, epoch, run_started, topology, write_events

from app.main import main
from app.services.cross_validation import cv_rows
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from trainer.schema.events import encode_event
from trainer.schema.tree import EVENTS_FILE

NUM_EPOCHS = 4


def stepped_run(t: float, step_s: float) -> list[str]:
    """Two epochs, the clock steps back by step_s, two more epochs, validation, finished."""
    back = t - step_s
    return [
        run_started(t, num_epochs=NUM_EPOCHS), topology(t + 0.1), epoch(t + 1, 0), epoch(t + 2, 1),
        epoch(back + 3, 2), epoch(back + 4, 3),
        encode_event("validation_finished", t=back + 5, mean_fg_dice=0.75, num_cases=2),
        encode_event("finished", t=back + 6),
    ]  # fmt: skip


def registry_job(tmp: Path, step_s: float):
    registry = Registry(tmp / "state")
    t = time.time() - 3600
    # nnui's clock stepped back with the trainer's: the job ended "before" its first epochs.
    job = add_job(registry, tmp, "0101-000000-f0-abc", exit_code=0, created_at=t - 1,
                  ended_at=t - step_s + 7)  # fmt: skip
    write_events(job, *stepped_run(t, step_s))
    return registry, job


@pytest.mark.parametrize("step_s", [1.0, 60.0])
def test_a_step_back_keeps_a_finished_run_finished_with_every_epoch(tmp_path, step_s) -> None:
    registry, _ = registry_job(tmp_path, step_s)
    (view,) = JobTracker(registry).refresh()
    assert (view.state, view.epoch, view.final_dice) == ("finished", NUM_EPOCHS, 0.75)
    assert [p.epoch for p in view.history] == [0, 1, 2, 3]
    (cv,) = cv_rows([view])
    assert cv.folds[0].state == "finished" and cv.folds[0].dice == 0.75


@pytest.mark.parametrize("step_s", [1.0, 60.0])
def test_status_and_export_of_a_stepped_run(tmp_path, monkeypatch, capsys, step_s) -> None:
    registry, job = registry_job(tmp_path, step_s)
    monkeypatch.setenv("NNUI_STATE_DIR", str(registry.state_dir))
    assert main(["status", "--json", "--all", "--results", str(tmp_path / "none")]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["state"], row["epoch"], row["num_epochs"]) == ("finished", 4, 4)
    assert main(["cv", "--json", "--results", str(tmp_path / "none")]) == 0
    (cv,) = json.loads(capsys.readouterr().out)
    assert cv["folds"][0]["state"] == "finished" and cv["folds"][0]["dice"] == 0.75
    queued = [q[q.index("--folds") + 1].split(",") for q in cv["queue"]]
    assert queued and not any("0" in folds for folds in queued)  # fold 0 is never re-queued
    out = tmp_path / "out"
    assert main(["export", job.job_id, "-o", str(out)]) == 0
    (csv_file,) = out.glob("*.csv")
    rows = list(csv.DictReader(io.StringIO(csv_file.read_text())))
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]


def _fold(root: Path, step_s: float) -> Path:
    folder = root / "Dataset004_Demo" / "nnUNetTrainer__nnUNetPlans__3d_fullres" / "fold_0"
    folder.mkdir(parents=True)
    t = time.time() - 3600
    earlier = [run_started(t - 7200, num_epochs=NUM_EPOCHS), epoch(t - 7100, 0),
               encode_event("stopped", t=t - 7000)]  # fmt: skip
    (folder / EVENTS_FILE).write_text("".join([*earlier, *stepped_run(t, step_s)]))
    return folder


@pytest.mark.parametrize("step_s", [1.0, 60.0])
def test_a_run_that_ended_unseen_survives_a_step_back(tmp_path, monkeypatch, capsys,
                                                      step_s) -> None:  # fmt: skip
    root = tmp_path / "results"
    _fold(root, step_s)
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    tracker = JobTracker(Registry(tmp_path / "state"))
    tracker.refresh()
    (view,) = [v for v in tracker.refresh_adopted([root], [], None, []) if v.job.run_dir]
    assert (view.state, view.epoch, view.final_dice) == ("finished", NUM_EPOCHS, 0.75)
    assert cv_rows([view])[0].folds[0].state == "finished"
    assert main(["status", "--json", "--all", "--results", str(root)]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("run_dir")]
    assert [(r["state"], r["epoch"]) for r in rows] == [("finished", 4)]
    out = tmp_path / "out"
    assert main(["export", view.job.job_id, "-o", str(out), "--results", str(root)]) == 0
    (csv_file,) = out.glob("*.csv")
    assert len(list(csv.DictReader(io.StringIO(csv_file.read_text())))) == NUM_EPOCHS


def test_records_breaking_the_contract_are_skipped_and_counted(tmp_path) -> None:
    registry, job = registry_job(tmp_path, 1.0)
    t = time.time() - 3000
    write_events(
        job,
        json.dumps({"t": t, "kind": "failed", "message": "no v"}) + "\n",  # no `v`
        json.dumps({"v": 1, "t": t, "kind": "failed", "epoch": "3"}) + "\n",  # a wrong type
        json.dumps({"v": 1, "t": "soon", "kind": "run_started", "num_epochs": 9}) + "\n",
        json.dumps({"v": 1, "t": t, "kind": "epoch_ended"}) + "\n",  # a required key missing
    )
    (view,) = JobTracker(registry).refresh()
    assert (view.state, view.epoch, view.num_epochs) == ("finished", NUM_EPOCHS, NUM_EPOCHS)
    assert view.num_invalid_events == 4
    assert "4 invalid event lines skipped" in view.alerts
