"""The cross-validation view: the aggregation as a table (finished folds with their Dice
from summary.json or validation_finished, failed with and without a checkpoint, missing;
mean ± std; GPU-hours), `nnui cv --json`, and the TUI screen with its "queue the missing
folds" key showing the exact commands in the launch confirm dialog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tui_fixtures import T0, drawn_lines, make_roots, screen_of, tui_app, wait_for

from app.screens.confirm import LaunchConfirmScreen
from app.screens.cross_validation import CrossValidationScreen
from app.screens.dashboard import DashboardScreen
from app.services.cross_validation import cv_rows, queue_launches
from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker
from trainer.schema.atomic import atomic_write_text
from trainer.schema.events import Kind, encode_event
from trainer.schema.status import Status
from trainer.schema.tree import EVENTS_FILE, checkpoint_file, run_dir

ROOT = Path(__file__).resolve().parents[2]
DATASET = "Dataset004_Demo"
# fold: (state, exit code, gpus, seconds run, Dice in summary.json, Dice in the events, ckpt)
FOLDS = {
    "0": ("finished", 0, ["0"], 3600.0, 0.8, None, True),
    "1": ("finished", 0, ["0", "1"], 1800.0, None, 0.6, True),
    "2": ("failed", 3, ["1"], 360.0, None, None, True),
    "4": ("failed", 3, ["0"], 0.0, None, None, False),
}


def add_fold(registry: Registry, roots, fold: str, spec: tuple | None = None, tag: str = "",
             trainer_args: tuple[str, ...] = ("--epochs", "10"), env: dict | None = None,
             t0: float = T0) -> str:  # fmt: skip
    state, code, gpus, took_s, summary, validated, ckpt = spec or FOLDS[fold]
    folder = run_dir(roots.results, DATASET, "3d_fullres", fold)
    folder.mkdir(parents=True)
    t = t0 + int(fold)
    lines = [encode_event(Kind.RUN_STARTED, t=t, dataset=DATASET, configuration="3d_fullres",
                          fold=fold, num_epochs=10, iterations_per_epoch=250, world_size=1,
                          launcher="single", host="box", argv=["nnui-train"])]  # fmt: skip
    if validated is not None:
        lines.append(encode_event(Kind.VALIDATION_FINISHED, t=t + took_s - 1,
                                  mean_fg_dice=validated, dice_per_class=[validated],
                                  num_cases=2))  # fmt: skip
    end = Kind.FINISHED if state == "finished" else Kind.FAILED
    fields = {} if state == "finished" else {"message": "boom", "traceback": ""}
    lines.append(encode_event(end, t=t + took_s, **fields))
    (folder / EVENTS_FILE).write_text("".join(lines))
    atomic_write_text(folder / "status.json", Status(state=state, epoch=10, num_epochs=10,
                                                      updated_at=t + took_s).to_json())  # fmt: skip
    if summary is not None:
        (folder / "validation").mkdir()
        (folder / "validation" / "summary.json").write_text(
            json.dumps({"foreground_mean": {"Dice": summary}})
        )
    if ckpt:
        (folder / checkpoint_file("latest")).write_bytes(b"")
    job_id = f"20260101-00000{fold}-f{fold}{tag}"
    registry.add(Job(
        job_id=job_id, created_at=t, dataset=DATASET, configuration="3d_fullres", fold=fold,
        mode="single", device="cpu", gpus=gpus, simulated=True, argv=["nnui-train"],
        env={"NNUI_JOB_ID": job_id, **(env or {})}, run_dir=str(folder),
        console_path=str(folder / "c.log"),
        processes=[ProcessRecord(pid=3000 + int(fold), create_time=t, role="trainer")],
        exit_code=code, ended_at=t + took_s, trainer_args=list(trainer_args),
    ))  # fmt: skip
    return job_id


@pytest.fixture
def cv_box(tmp_path: Path):
    roots = make_roots(tmp_path)
    registry = Registry(tmp_path / "state")
    for fold in FOLDS:
        add_fold(registry, roots, fold)
    return roots, registry


def test_the_aggregation_table(cv_box) -> None:
    _, registry = cv_box
    tracker = JobTracker(registry)
    (row,) = cv_rows(tracker.refresh())
    assert (row.dataset, row.configuration, row.trainer, row.plans) == (
        DATASET, "3d_fullres", "nnuiTrainer", "nnuiPlans")  # fmt: skip
    cells = [(c.fold, c.state, c.dice, c.resumable) for c in row.folds]
    assert cells == [("0", "finished", 0.8, True), ("1", "finished", 0.6, True),
                     ("2", "failed", None, True), ("3", "missing", None, False),
                     ("4", "failed", None, True)]  # an earlier run: --c too  # fmt: skip
    assert row.mean_dice == pytest.approx(0.7) and row.std_dice == pytest.approx(0.1)
    assert row.gpu_hours == pytest.approx(1.0 + 1.0 + 0.1)  # wall time x GPUs
    assert row.eta_s is None and row.gpus == ("0", "1")
    launches = queue_launches(row, ["0", "1", "2"])
    assert [q.text() for q in launches] == [
        "nnui launch Dataset004_Demo 3d_fullres --folds 3 --simulate-gpus 2 --gpus 0,1 "
        "--when-free -- --epochs 10",
        "nnui launch Dataset004_Demo 3d_fullres --folds 2,4 --simulate-gpus 2 --gpus 0,1 "
        "--when-free --c -- --epochs 10",
    ]
    request = launches[1].request()
    assert request.continue_training and request.folds == ["2", "4"] and request.schedule.when_free


def test_nnui_cv_json_and_table(cv_box, tmp_path: Path) -> None:
    roots, registry = cv_box
    env = {**os.environ, "NNUI_STATE_DIR": str(registry.state_dir),
           "nnUNet_results": str(roots.results), "nnUNet_preprocessed": str(roots.preprocessed),
           "nnUNet_raw": str(roots.raw)}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.main", "cv", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    result = run("--json")
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert [f["state"] for f in row["folds"]] == ["finished", "finished", "failed", "missing",
                                                  "failed"]  # fmt: skip
    assert row["mean_dice"] == pytest.approx(0.7) and row["gpu_hours"] == pytest.approx(2.1)
    assert row["queue"][1][-4:] == ["--c", "--", "--epochs", "10"]
    text = run().stdout
    assert "0.8000" in text and "0.7000 ± 0.1000" in text and "missing" in text
    assert "--folds 2,4" in text and "--folds 3 " in text


def test_every_state_has_a_fold_state_and_live_folds_are_never_queued(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from app.services.cross_validation import FOLD_STATE, TO_QUEUE, UNKNOWN, fold_cell
    from trainer.schema.status import ACTIVE_STATES, State

    assert set(FOLD_STATE) == set(State)  # a new state cannot fall through to "failed"
    for state in ACTIVE_STATES:
        view = SimpleNamespace(state=state, job=SimpleNamespace(run_dir=str(tmp_path)))
        assert fold_cell("0", view).state not in TO_QUEUE, state
    validating = SimpleNamespace(state="validating", job=SimpleNamespace(run_dir=str(tmp_path)))
    assert fold_cell("0", validating).state == "validating"
    odd = SimpleNamespace(state="exploded", job=SimpleNamespace(run_dir=str(tmp_path)))
    assert fold_cell("0", odd).state == UNKNOWN


async def test_the_cv_screen_and_its_queue_key(cv_box) -> None:
    roots, registry = cv_box
    app = tui_app(roots, registry.state_dir)
    async with app.run_test(size=(170, 48)) as pilot:
        await wait_for(lambda: len(app.views) == 4 and app.snapshot is not None, pilot)
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("v")
        screen = await screen_of(app, pilot, CrossValidationScreen)
        await wait_for(lambda: screen.rows, pilot)
        table = screen.query_one("#cv-table")
        cells = [str(c) for c in table.get_row_at(0)]
        assert cells[4:10] == ["0.8000", "0.6000", "failed", "missing", "failed",
                               "0.7000 ± 0.1000"]  # fmt: skip
        await pilot.press("m")
        dialog = await screen_of(app, pilot, LaunchConfirmScreen)
        text = dialog.query_one("#launch-preview-text").render().plain
        assert "--folds 3 --simulate-gpus 2 --gpus 0,1 --when-free -- --epochs 10" in text
        assert "--folds 2,4 --simulate-gpus 2 --gpus 0,1 --when-free --c" in text
        assert "✗" not in text and dialog.query("#yes")  # checked and planned: startable
        await pilot.press("n")  # cancelled: nothing started
        await screen_of(app, pilot, CrossValidationScreen)
        assert len(Registry(registry.state_dir).list()) == 4


async def test_the_cv_screen_at_80x24_keeps_dice_and_eta_whole(cv_box) -> None:
    roots, registry = cv_box
    app = tui_app(roots, registry.state_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(lambda: len(app.views) == 4 and app.snapshot is not None, pilot)
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("v")
        screen = await screen_of(app, pilot, CrossValidationScreen)
        await wait_for(lambda: screen.rows and screen.header, pilot)
        table = screen.query_one("#cv-table")
        assert screen.header[-2:] == ["Dice ± sd", "ETA"]
        assert [str(c) for c in table.get_row_at(0)][:7] == [
            "004 3d_fullres", "0.800", "0.600", "FAIL", "–", "FAIL", "0.70±0.10"]  # fmt: skip
        widths = sum(column.get_render_width(table) for column in table.columns.values())
        assert widths <= table.size.width  # nothing scrolled off: the ETA column is whole
        footer = drawn_lines(app)[-1]
        assert "Back" in footer and "Queue missing/failed folds" in footer


async def test_read_only_cv_screen_queues_nothing(cv_box) -> None:
    roots, registry = cv_box
    app = tui_app(roots, registry.state_dir, readonly=True)
    async with app.run_test(size=(170, 48)) as pilot:
        await wait_for(lambda: len(app.views) == 4, pilot)
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("v")
        screen = await screen_of(app, pilot, CrossValidationScreen)
        await wait_for(lambda: screen.rows, pilot)
        await pilot.press("m", "escape")  # m is not bound read-only; escape goes back
        await screen_of(app, pilot, DashboardScreen)
        assert screen.queued == [] and len(Registry(registry.state_dir).list()) == 4


def test_cv_and_status_show_the_same_dice_after_the_folder_changes(cv_box) -> None:
    """A later run replaced fold 1's summary.json (e.g. --retrain by hand): the job's row in
    `nnui status` and its cell in `nnui cv` still agree (the job's own validation)."""
    roots, registry = cv_box
    folder = run_dir(roots.results, DATASET, "3d_fullres", "1")
    (folder / "validation").mkdir(exist_ok=True)
    (folder / "validation" / "summary.json").write_text(
        json.dumps({"foreground_mean": {"Dice": 0.9}})
    )
    tracker = JobTracker(registry)
    views = tracker.refresh()
    (row,) = cv_rows(views)
    view = next(v for v in views if v.job.fold == "1")
    assert row.folds[1].dice == view.final_dice == pytest.approx(0.6)


def test_nnui_cv_shows_a_validating_fold_live_and_offers_no_queue_for_it(cv_box, capsys) -> None:
    """Fold 3 (missing in the box) is now in its final validation: `nnui cv` says so and
    its queue lines no longer name fold 3 (only the failed 2 and 4, with --c)."""
    from argparse import Namespace

    from test_jobs import ME_ALIVE

    from app.cli.cv import cmd_cv

    roots, registry = cv_box
    folder = run_dir(roots.results, DATASET, "3d_fullres", "3")
    folder.mkdir(parents=True)
    t = T0 + 10
    (folder / EVENTS_FILE).write_text("".join([
        encode_event(Kind.RUN_STARTED, t=t, num_epochs=10, world_size=1, fold="3"),
        encode_event(Kind.VALIDATION_STARTED, t=t + 5, epoch=9, num_cases=4),
    ]))  # fmt: skip
    registry.add(Job(
        job_id="20260101-000003-f3", created_at=t, dataset=DATASET, configuration="3d_fullres",
        fold="3", mode="single", device="cpu", gpus=["0"], simulated=True, argv=["nnui-train"],
        env={}, run_dir=str(folder), console_path=str(folder / "c.log"), processes=[ME_ALIVE],
        trainer_args=["--epochs", "10"],
    ))  # fmt: skip
    options = Namespace(json=False, raw=None, preprocessed=None, results=str(roots.results))
    assert cmd_cv(options, registry) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(DATASET))
    assert "validating" in row and "missing" not in row
    queue = [line for line in out.splitlines() if "to queue" in line]
    assert queue and all("--folds 2,4" in line and "--c" in line for line in queue)


def test_a_cascade_row_queues_its_folds_after_the_lowres_ones(cv_box) -> None:
    """The row's jobs waited for 3d_lowres's segmentations (--after-lowres): so do the
    launches that queue its missing folds, in the command and in the request."""
    import dataclasses

    _, registry = cv_box
    for job in registry.list():
        registry.update(job.job_id, after_previous_stage=True)
    tracker = JobTracker(registry)
    (row,) = cv_rows(tracker.refresh())
    launches = queue_launches(row, ["0", "1"])
    assert all("--after-lowres" in q.command() for q in launches)
    assert all(q.request().schedule.after_previous_stage for q in launches)
    plain = dataclasses.replace(
        row, template=dataclasses.replace(row.template, after_previous_stage=False)
    )
    assert not any("--after-lowres" in q.command() for q in queue_launches(plain, ["0"]))
