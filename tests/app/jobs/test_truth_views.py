"""Views that never hide or invent state: a final validation is "validating" with its own
progress (never a stall), the ETA counts down between epochs and is never 0 while work
remains, a kill reads "killed by you", a vanished run folder says so, the final Dice is in
the views and `status --json`, a resume names what it continues from, and one epoch
numbering is shared by the table, the stop dialog and `nnui status`."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from test_jobs import ME_ALIVE, add_job, epoch, run_started, topology, write_events

from app.cli.status import status_table, view_dict
from app.screens.choices import StopChoice
from app.screens.confirm import stop_text
from app.services.cross_validation import cross_validation_eta_s
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker, training_eta_s
from app.services.jobs.words import alert_condition, resume_from, state_label
from app.widgets.job_cells import row_cells
from trainer.schema.events import encode_event, validate_event
from trainer.schema.status import State


def _one(registry: Registry):
    (view,) = JobTracker(registry).refresh()
    return view


def test_final_validation_is_validating_with_progress_not_a_stall(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    stale = time.time() - 900  # far beyond the stall limit: one validation case can be slow
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=stale - 10)
    write_events(
        job, run_started(stale, num_epochs=2), topology(stale), epoch(stale, 0), epoch(stale, 1),
        encode_event("validation_started", t=stale, num_cases=3),
        encode_event("validation_case", t=stale + 30, index=1, num_cases=3),
    )  # fmt: skip
    view = _one(registry)
    assert view.state == State.VALIDATING and view.state in ("validating",)
    assert (view.validation_done, view.validation_cases) == (1, 3)
    assert not any("stalled" in a for a in view.alerts), view.alerts
    assert view.eta_s is not None and view.eta_s >= 1.0  # 2 cases left at 30 s each
    assert state_label(view) == "validating 1/3 cases"
    assert row_cells(view, False)["state"].plain == "validating 1/3 cases"
    assert row_cells(view, False)["eta"] not in ("", "0s")


def test_final_dice_in_the_table_header_and_json(tmp_path: Path) -> None:
    from app.screens.job_summary import summary_text

    registry = Registry(tmp_path / "state")
    t = time.time() - 100
    job = add_job(registry, tmp_path, "j", exit_code=0, created_at=t - 10)
    write_events(
        job, run_started(t, num_epochs=1), topology(t), epoch(t, 0),
        encode_event("validation_started", t=t, num_cases=2),
        encode_event("validation_case", t=t, index=2, num_cases=2),
        encode_event("validation_finished", t=t, mean_fg_dice=0.8125, dice_per_class=[0.8125],
                     num_cases=2),
        encode_event("finished", t=t),
    )  # fmt: skip
    view = _one(registry)
    assert view.state == "finished" and view.final_dice == pytest.approx(0.8125)
    assert row_cells(view, False)["dice"] == "final 0.812"
    assert "final validation Dice 0.812" in summary_text(view).plain
    assert view_dict(view)["final_dice"] == pytest.approx(0.8125)
    assert "final validation Dice 0.812" in status_table([view], None)


def test_eta_counts_down_between_epochs_and_is_never_zero_while_work_remains() -> None:
    now = 10_000.0
    assert training_eta_s(5, 30.0, now - 10, now) == pytest.approx(140.0)
    assert training_eta_s(5, 30.0, now - 20, now) == pytest.approx(130.0)  # counts down
    assert training_eta_s(1, 30.0, now - 100, now) == 1.0  # overrun: never "0s"
    assert training_eta_s(3, 30.0, now - 100, now) == pytest.approx(60.0)  # 2 more after it
    assert training_eta_s(0, 30.0, now, now) is None


def test_eta_in_the_view_counts_from_the_last_epoch_event(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    now = time.time()
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=now - 500)
    ends = [now - 400 + 30 * i for i in range(4)]  # the last epoch ended ~310 s ago
    write_events(
        job, run_started(ends[0] - 30), topology(ends[0] - 30),
        *(epoch(t, i, seconds=30) for i, t in enumerate(ends)),
    )  # fmt: skip
    view = _one(registry)
    # 6 epochs of 30 s left, 310 s since the last one ended: not 180 s frozen until the next.
    assert view.eta_s == pytest.approx(150.0, abs=20.0)


def test_alerts_dedupe_by_condition() -> None:
    # The stall rule itself (final validation exempt) is the supervisor's:
    # tests/app/supervisor/test_stall.py.
    assert alert_condition("stalled: no event for 208 s") == alert_condition(
        "stalled: no event for 209 s"
    )
    assert alert_condition("GPU 1 also used by bob") != alert_condition("GPU 2 also used by bob")


def test_a_kill_reads_killed_by_you_and_a_vanished_folder_says_so(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    t = time.time() - 100
    job = add_job(registry, tmp_path, "j", exit_code=-15, killed_at=t + 5, created_at=t)
    write_events(job, run_started(t), topology(t), epoch(t, 0))
    view = _one(registry)
    assert view.state == "killed" and state_label(view) == "killed by you"
    assert row_cells(view, False)["state"].plain == "killed by you"
    assert "killed by you" in status_table([view], None)
    assert "exit" not in status_table([view], None).splitlines()[1].split("killed by you")[0]
    shutil.rmtree(job.run_dir)
    view = _one(registry)  # a fresh reader (nnui status) after the folder went
    assert view.run_dir_gone and state_label(view) == "killed by you (run folder gone)"
    assert any("run folder gone" in a for a in view.alerts)
    assert view_dict(view)["run_dir_gone"] is True


def test_resume_names_its_checkpoint_and_epoch_or_says_from_scratch(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    t = time.time() - 100
    job = add_job(registry, tmp_path, "j", exit_code=0, created_at=t)
    saved = [
        encode_event("checkpoint_saved", t=t, checkpoint=kind, path="p", epoch=e, write_time_s=0)
        for kind, e in (("best", 1), ("latest", 2))
    ]
    write_events(job, run_started(t), *(epoch(t, i) for i in range(3)), *saved,
                 encode_event("stopped", t=t, epoch=2))  # fmt: skip
    view = _one(registry)
    assert "starts from scratch" in resume_from(view)  # no file there: nothing to continue
    (Path(job.run_dir) / "checkpoint_best.safetensors").write_bytes(b"x")
    assert resume_from(view) == (
        "continues from checkpoint_best.safetensors: 2/10 epochs done, next epoch 3"
    )
    (Path(job.run_dir) / "checkpoint_latest.safetensors").write_bytes(b"x")
    assert resume_from(view) == (
        "continues from checkpoint_latest.safetensors: 3/10 epochs done, next epoch 4"
    )


class _Plan:
    ok, queued, reason, epoch = True, False, None, None
    targets = ()


def test_stop_before_the_first_epoch_says_what_really_happens(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    t = time.time() - 5
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=t)
    write_events(job, run_started(t, num_epochs=300), topology(t))
    view = _one(registry)
    text = stop_text([StopChoice(view, _Plan(), None)]).plain
    assert "no checkpoint" in text and "from scratch" in text and "epoch 1/300" in text
    write_events(job, encode_event("train_loss_running", t=t + 1, epoch=0, iteration=5,
                                   num_iterations=20, loss=0.9))  # fmt: skip
    view = _one(registry)
    text = stop_text([StopChoice(view, _Plan(), None)]).plain
    assert "from scratch" not in text and "writes checkpoint_latest" in text


def test_one_epoch_numbering_table_dialog_status(tmp_path: Path) -> None:
    """ "epoch 3/300" everywhere = 3 epochs completed; the dialog names the running one,
    epoch 4/300, and the trainer's console line for it says "epoch 4/300" too."""
    registry = Registry(tmp_path / "state")
    t = time.time() - 5
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=t)
    write_events(job, run_started(t, num_epochs=300), topology(t),
                 *(epoch(t, i) for i in range(3)))  # fmt: skip
    view = _one(registry)
    assert row_cells(view, False)["epoch"].startswith("3/300")
    assert " 3/300 " in status_table([view], None).splitlines()[1]
    plan = _Plan()
    plan.epoch = view.epoch
    text = stop_text([StopChoice(view, plan, None)]).plain
    assert "epoch 3/300" in text and "(epoch 4/300)" in text


def test_validation_case_is_a_valid_additive_event() -> None:
    assert validate_event({"v": 1, "t": 1.0, "kind": "validation_case", "index": 1,
                           "num_cases": 3}) is None  # fmt: skip
    assert validate_event({"v": 1, "t": 1.0, "kind": "validation_case", "num_cases": 3})


def test_cross_validation_eta_is_unknown_not_zero_while_a_fold_validates(tmp_path: Path) -> None:
    import dataclasses

    from test_jobs import view

    running = view("a", "running", 20.0)
    validating = dataclasses.replace(view("b", "validating", None), epoch=10)  # all epochs done
    eta = cross_validation_eta_s([running, validating])
    assert eta is None  # was 20 s: as if the validation took no time ("0s" on its own)
