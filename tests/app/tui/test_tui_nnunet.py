"""The nnU-Net engine on the board and nnU-Net runs in the jobs table, driven with Pilot on
simulated GPUs: the engine key and its plans files, the hint when nnunetv2 is missing,
watch-only rows whose stop/resume/kill are refused with nothing sent, and `r` on a stopped
nnU-Net job planning a resume with the nnU-Net engine."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_trainer import wait_until
from test_nnunet_runs import FAKE_NNUNET
from test_nnunet_runs import _end as end_processes
from test_tui_board import open_board, settled
from tui_fixtures import (
    DATASET,
    T0,
    make_roots,
    screen_of,
    tui_app,
    use_fake_trainer,
    wait_for,
)

from app.screens import actions
from app.screens.confirm import LaunchConfirmScreen, RefusalScreen
from app.screens.dashboard import DashboardScreen
from app.screens.job_detail import JobDetailScreen
from app.screens.launch import LaunchScreen
from app.screens.palette import NnuiCommands
from app.screens.seam import Services, TuiConfig
from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker, watch_only_view
from app.services.jobs.words import human_duration
from app.services.launch import engines
from app.services.launch import request as launch_request
from app.services.machine.gpus import GpuMonitor
from app.services.machine.procs import process_start_ticks
from app.services.nnunet import runs as nnunet_runs
from app.services.nnunet.log import EpochStats
from app.services.nnunet.runs import TrainArgs, WatchOnlyRun
from app.services.signals import send as signals
from app.services.signals import targets
from app.tui import make_app
from app.widgets.curves import CurvesPanel
from app.widgets.dataset_picker import DatasetPicker
from app.widgets.fold_board import FoldBoard
from app.widgets.job_cells import row_cells
from app.widgets.job_table import JobTable
from app.widgets.log_tail import LogTail
from app.widgets.process_tree import ProcessTree
from trainer.schema.atomic import atomic_write_text
from trainer.schema.events import Kind, encode_event
from trainer.schema.status import Status
from trainer.schema.tree import EVENTS_FILE, run_dir


def write_plans(folder: Path, name: str, batch_2d: int, batch_3d: int) -> None:
    plans = {
        "plans_name": name,
        "configurations": {
            "2d": {"patch_size": [64, 64], "batch_size": batch_2d},
            "3d_fullres": {"patch_size": [32, 64, 64], "batch_size": batch_3d},
        },
    }
    (folder / f"{name}.json").write_text(json.dumps(plans))


def nnunet_roots(tmp_path: Path):
    """The demo dataset with nnui's plans and two of nnU-Net's own plans files beside them."""
    roots = make_roots(tmp_path)
    folder = roots.preprocessed / DATASET
    write_plans(folder, "nnuiResEncUNetMPlans", 6, 2)
    write_plans(folder, "nnUNetPlans", 40, 2)
    write_plans(folder, "nnUNetResEncUNetLPlans", 24, 4)
    (folder / "nnui_fingerprint.json").write_text("{}")  # not a plans file
    (folder / "dataset_fingerprint.json").write_text("{}")
    return roots


def rows(screen: LaunchScreen) -> list[tuple[str, str, int]]:
    picker = screen.query_one(DatasetPicker)
    return [(c.plans, c.configuration, c.batch_size) for c in picker.choices]


@pytest.fixture
def nnunet_installed(monkeypatch):
    monkeypatch.setattr(engines, "nnunet_available", lambda: True)


async def test_board_switches_to_the_nnunet_engine_and_its_plans(
    tmp_path: Path, monkeypatch, nnunet_installed
) -> None:
    roots = nnunet_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        # nnui's engine: nnui's plans identifiers only (never nnU-Net's files).
        assert {plans for plans, _, _ in rows(screen)} == {"nnuiPlans", "nnuiResEncUNetMPlans"}
        assert rows(screen)[0][0] == "nnuiPlans"  # the engine's default first
        line = screen.query_one("#engine-line")
        assert "engine: nnui" in line.render().plain and "e: switch to nnU-Net" in (
            line.render().plain
        )
        await pilot.press("space", "e")
        await wait_for(lambda: screen.datasets_engine == engines.NNUNET, pilot)
        assert "engine: nnU-Net" in line.render().plain
        assert rows(screen) == [
            ("nnUNetPlans", "2d", 40),
            ("nnUNetPlans", "3d_fullres", 2),
            ("nnUNetResEncUNetLPlans", "2d", 24),
            ("nnUNetResEncUNetLPlans", "3d_fullres", 4),
        ]
        await settled(screen, pilot, {"0": ["0"]})
        assert screen.problems == [], screen.problems
        preview = screen.preview_text
        assert "-m trainer.nnunet_engine Dataset004_Demo 2d 0" in preview, preview
        assert "-tr nnUNetTrainer_nnui -p nnUNetPlans" in preview
        assert "nnUNet_extTrainer=" in preview and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in preview
        assert [p.engine for p in screen.plans] == ["nnunet"]
        # Another plans file: its batch size and `-p` go into the request.
        picker = screen.query_one(DatasetPicker)
        picker.move_cursor(row=3)
        await wait_for(lambda: picker.current.plans == "nnUNetResEncUNetLPlans", pilot)
        await settled(screen, pilot)
        assert "-tr nnUNetTrainer_nnui -p nnUNetResEncUNetLPlans" in screen.preview_text
        assert screen._inputs[1] == 4  # the batch size of that plans' 3d_fullres
        run_dir = screen.plans[0].run_dir
        assert run_dir.parent.name == "nnUNetTrainer__nnUNetResEncUNetLPlans__3d_fullres"
        # And back: nnui's trainer again.
        await pilot.press("e")
        await wait_for(lambda: screen.datasets_engine == engines.NNUI, pilot)
        await settled(screen, pilot)
        assert "-m trainer" in screen.preview_text or "fake_trainer.py" in screen.preview_text
        assert "nnunet_engine" not in screen.preview_text


async def test_board_says_nnunet_is_missing_and_does_not_offer_it(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(engines, "nnunet_available", lambda: False)
    roots = nnunet_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        line = screen.query_one("#engine-line").render().plain
        assert "nnU-Net engine: nnunetv2 not installed — pip install 'nnui[nnunet]'" in line
        assert "switch to" not in line
        await pilot.press("e", "space")
        await settled(screen, pilot, {"0": ["0"]})
        assert screen.engine == engines.NNUI and screen.datasets_engine == engines.NNUI
        assert {plans for plans, _, _ in rows(screen)} == {"nnuiPlans", "nnuiResEncUNetMPlans"}
        assert "nnunet_engine" not in screen.preview_text and screen.problems == []
        assert all(p.engine == "nnui" for p in screen.plans)
        assert isinstance(app.screen, LaunchScreen)
        board = screen.query_one(FoldBoard)
        assert board.model.assignments == {"0": ["0"]}
        await pilot.press("escape")
        await screen_of(app, pilot, DashboardScreen)


# ---- watch-only rows ------------------------------------------------------------------

WATCHED_PID = 3_999_999  # no such process: the tests record every signal attempt instead


def watched_run(roots) -> Any:
    """alice's stock nnU-Net training, as NnunetRunWatcher would report it."""
    fold_dir = roots.results / DATASET / "nnUNetTrainer__nnUNetPlans__3d_fullres" / "fold_1"
    history = tuple(
        EpochStats(e, 1.0 / (e + 1), 1.1 / (e + 1), (0.5 + e / 10, 0.4 + e / 10),
                   0.45 + e / 10, 0.4 + e / 10, 0.01, 30.0 + e, None)
        for e in range(3)
    )  # fmt: skip
    args = TrainArgs(DATASET, "3d_fullres", "1")
    return WatchOnlyRun(
        run_id=f"nnunet:{WATCHED_PID}", pid=WATCHED_PID, pids=(WATCHED_PID, WATCHED_PID + 1),
        uid=1001, owner="alice", start_time=T0, start_ticks=123, cmdline=(
            "python", "nnUNetv2_train", DATASET, "3d_fullres", "1"),
        environ_readable=False, args=args, dataset=DATASET, gpus=("1",), gpu_source="nvml",
        fold_dir=str(fold_dir), log_path=str(fold_dir / "training_log_2026_1_1_00_00_00.txt"),
        log_mtime=T0 + 100, phase="training", epoch=3, current_epoch=3, num_epochs=1000,
        num_epochs_source="default", iterations_per_epoch=250, train_loss=history[-1].train_loss,
        val_loss=history[-1].val_loss, dice_per_class=history[-1].dice_per_class,
        mean_fg_dice=history[-1].mean_fg_dice, ema_fg_dice=history[-1].ema_fg_dice, lr=0.01,
        epoch_time_s=32.0, median_epoch_time_s=31.0, eta_s=997 * 31.0, final_dice=None,
        sigusr1_handler=False, history=history,
    )  # fmt: skip


class WatchingTracker(JobTracker):
    """The real tracker, whose /proc look finds the given runs (no real processes)."""

    def __init__(self, registry: Registry, runs: list[Any]) -> None:
        super().__init__(registry)
        self.runs = runs
        self.num_watch_refreshes = 0

    def refresh_watch_only(self, results_roots, snapshot=None, procs=None):
        self.num_watch_refreshes += 1
        console = ("2026-01-01 00:00:00: Epoch 2", "2026-01-01 00:00:31: train_loss -0.33")
        self.watch_only = [watch_only_view(run, console) for run in self.runs]
        return self.watch_only


def watching_app(roots, state: Path, runs: list[Any]):
    registry = Registry(state)
    monitor = GpuMonitor(simulate=2)
    services = Services(monitor=monitor, registry=registry, tracker=WatchingTracker(registry, runs))
    return make_app(TuiConfig(roots=roots, state_dir=state, simulate_gpus=2, jobs_interval_s=0.25),
                    services)  # fmt: skip


@pytest.fixture
def signals_sent(monkeypatch) -> list[tuple]:
    """Every way nnui could signal a process, recorded instead of done."""
    calls: list[tuple] = []
    for module, name in (
        (signals, "send_stop"),
        (signals, "kill"),
        (targets, "plan_stop"),
        (targets, "plan_kill"),
    ):
        monkeypatch.setattr(
            module, name, lambda *a, _name=name, **k: calls.append((_name, a)) or []
        )
    monkeypatch.setattr(os, "kill", lambda *a: calls.append(("os.kill", a)))
    monkeypatch.setattr(nnunet_runs, "read_sigcgt_mask", lambda pid: 0)  # stock: no handler
    return calls


async def dashboard_with_row(app, pilot, job_id: str) -> DashboardScreen:
    screen = await screen_of(app, pilot, DashboardScreen)
    table = screen.query_one(JobTable)
    await wait_for(lambda: job_id in table.target_job_ids(), pilot)
    return screen


async def test_a_watch_only_run_is_a_row_marked_with_its_owner(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    run = watched_run(roots)
    app = watching_app(roots, tmp_path / "state", [run])
    async with app.run_test(size=(170, 48)) as pilot:
        screen = await dashboard_with_row(app, pilot, run.run_id)
        table = screen.query_one(JobTable)
        assert table.get_cell(run.run_id, "state").plain == "running watch-only (alice)"
        assert table.get_cell(run.run_id, "where") == "1"
        assert table.get_cell(run.run_id, "epoch").startswith("3/1000")
        assert table.get_cell(run.run_id, "ema") == "0.600"
        assert table.get_cell(run.run_id, "eta") == human_duration(997 * 31.0)
        summary = screen.query_one("#job-summary").render().plain
        assert "watch-only: alice's nnU-Net run" in summary
        assert "Dice per class 0.700 0.600" in summary and "median epoch 31 s" in summary
        # Refreshed in the jobs thread at the processes' pace, never on the UI thread.
        assert app.services.tracker.num_watch_refreshes >= 1


@pytest.mark.parametrize(("key", "title"), [("s", "Stop"), ("r", "Resume"), ("k", "Kill")])
async def test_stop_resume_kill_of_a_watch_only_row_are_refused_with_nothing_sent(
    tmp_path: Path, signals_sent, key: str, title: str
) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    run = watched_run(roots)
    app = watching_app(roots, state, [run])
    async with app.run_test(size=(170, 48)) as pilot:
        await dashboard_with_row(app, pilot, run.run_id)
        await pilot.press(key)
        dialog = await screen_of(app, pilot, RefusalScreen)
        assert dialog.title_text.startswith(f"{title} refused")
        text = dialog.query_one("#refusal-text").render().plain
        assert f"pid {WATCHED_PID} of user alice" in text and "no SIGUSR1 handler" in text
        assert "nothing sent" in text
        assert f"nnUNetv2_train {DATASET} 3d_fullres 1 -tr nnUNetTrainer_nnui --c" in text
        assert "--engine nnunet" in text  # the same continuation from nnui
        await pilot.press("n")
        await screen_of(app, pilot, DashboardScreen)
        assert signals_sent == []
        assert Registry(state).list() == []  # nothing started, nothing recorded


async def test_enter_on_a_watch_only_row_shows_its_curves_and_nnunet_log(
    tmp_path: Path, signals_sent
) -> None:
    roots = make_roots(tmp_path)
    run = watched_run(roots)
    app = watching_app(roots, tmp_path / "state", [run])
    async with app.run_test(size=(170, 48)) as pilot:
        await dashboard_with_row(app, pilot, run.run_id)
        await pilot.press("enter")
        detail = await screen_of(app, pilot, JobDetailScreen)
        curves = detail.query_one(CurvesPanel)
        await wait_for(lambda: curves._key is not None, pilot)
        ((label, num_epochs, _),) = curves._key
        assert (label, num_epochs) == ("fold 1", 3)
        console = detail.query_one(LogTail).render().plain
        assert "train_loss -0.33" in console
        assert detail.query_one("#console-box").border_title.startswith("nnU-Net log ")
        tree = detail.query_one(ProcessTree).render().plain
        assert f"pid {WATCHED_PID}" in tree and "watch-only" in tree
        await pilot.press("s")  # the detail's stop is refused the same way
        await screen_of(app, pilot, RefusalScreen)
        assert signals_sent == []


# ---- r on a stopped nnU-Net job -------------------------------------------------------


def stopped_nnunet_job(roots, state: Path) -> str:
    """A job nnui launched with the nnU-Net engine, stopped gracefully after 3 epochs."""
    folder = run_dir(roots.results, DATASET, "3d_fullres", "0", "nnUNetTrainer", "nnUNetPlans")
    folder.mkdir(parents=True)
    lines = [
        encode_event(Kind.RUN_STARTED, t=T0, dataset=DATASET, configuration="3d_fullres",
                     fold="0", num_epochs=10, iterations_per_epoch=5, world_size=1,
                     launcher="single", engine="nnunet", host="h", argv=["nnUNetv2_train"]),
        encode_event(Kind.STOPPED, t=T0 + 90, epoch=3, reason="SIGUSR1"),
    ]  # fmt: skip
    (folder / EVENTS_FILE).write_text("".join(lines))
    atomic_write_text(folder / "status.json", Status("stopped", epoch=3, num_epochs=10).to_json())
    (folder / "console.log").write_text("stopped\n")
    job_id = "20260101-000000-f0-nnu"
    argv = [sys.executable, "-m", "trainer.nnunet_engine", DATASET, "3d_fullres", "0",
            "-tr", "nnUNetTrainer_nnui", "-p", "nnUNetPlans", "-device", "cpu",
            "--epochs", "10"]  # fmt: skip
    Registry(state).add(
        Job(job_id=job_id, created_at=T0, dataset=DATASET, configuration="3d_fullres",
            fold="0", mode="single", device="cpu", gpus=["1"], simulated=True, argv=argv,
            env={"NNUI_JOB_ID": job_id}, run_dir=str(folder),
            console_path=str(folder / "console.log"), trainer_args=["--epochs", "10"],
            processes=[ProcessRecord(pid=WATCHED_PID, create_time=T0, role="trainer")],
            exit_code=0, ended_at=T0 + 90, engine="nnunet")
    )  # fmt: skip
    return job_id


async def test_r_on_a_stopped_nnunet_job_resumes_it_with_the_nnunet_engine(
    tmp_path: Path, monkeypatch, nnunet_installed
) -> None:
    roots = nnunet_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    job_id = stopped_nnunet_job(roots, state)
    started: list = []
    monkeypatch.setattr("app.screens.actions.start_plans", lambda app, plans: started.extend(plans))
    app = tui_app(roots, state)
    async with app.run_test(size=(170, 48)) as pilot:
        await dashboard_with_row(app, pilot, job_id)
        await wait_for(lambda: app.view_of(job_id).state == "stopped", pilot)
        await pilot.press("r")
        dialog = await screen_of(app, pilot, LaunchConfirmScreen)
        preview = dialog.query_one("#launch-preview-text").render().plain
        assert dialog.problems == [], dialog.problems
        assert "-m trainer.nnunet_engine Dataset004_Demo 3d_fullres 0" in preview, preview
        assert "-tr nnUNetTrainer_nnui -p nnUNetPlans -device cpu --epochs 10 --c" in preview
        assert "nnUNet_extTrainer=" in preview
        await pilot.press("y")
        await wait_for(lambda: started, pilot)
    (plan,) = started
    assert plan.engine == "nnunet" and plan.continue_training and plan.gpus == ["1"]
    assert str(plan.run_dir) == Registry(state).get(job_id).run_dir  # its own fold folder


@pytest.mark.parametrize(("engine", "plans_args", "batch"), [
    ("nnui", [], 12), ("nnunet", [], 40), ("nnunet", ["-p", "nnUNetResEncUNetLPlans"], 24),
])  # fmt: skip
def test_a_resume_checks_the_batch_of_its_own_engines_plans(
    tmp_path: Path, nnunet_installed, engine: str, plans_args: list[str], batch: int
) -> None:
    roots = nnunet_roots(tmp_path)
    request = launch_request.LaunchRequest(
        dataset=DATASET, configuration="2d", folds=["0"], gpus=["0"], mode="per_gpu",
        device="cpu", trainer_args=plans_args, simulated=True, engine=engine,
    )  # fmt: skip
    assert actions.batch_size_of(request, roots) == batch


@pytest.mark.parametrize(("device", "gpus", "where"), [
    ("cuda", ("0", "1"), "0,1 (spawn)"), ("cuda", (), "n/a"), ("cpu", (), "cpu"),
])  # fmt: skip
def test_a_watch_only_row_says_where_it_runs(
    tmp_path: Path, device: str, gpus: tuple, where: str
) -> None:
    run = watched_run(make_roots(tmp_path))
    args = TrainArgs(DATASET, "3d_fullres", "1", num_gpus=max(1, len(gpus)), device=device)
    view = watch_only_view(dataclasses.replace(run, args=args, gpus=gpus))
    cells = row_cells(view, selected=False)
    assert cells["where"] == where
    assert cells["state"].plain == "running watch-only (alice)"
    assert cells["job"] == f"nnunet:{WATCHED_PID}"


# ---- a hand-started nnUNetv2_train (the stand-in), found through /proc by the app -------


async def test_a_hand_started_nnunet_run_is_watch_only_and_s_never_signals_it(
    tmp_path: Path,
) -> None:
    roots = make_roots(tmp_path)
    ready = tmp_path / "ready"
    env = {**os.environ, "nnUNet_results": str(roots.results), "FAKE_NNUNET_READY": str(ready)}
    env.pop("NNUI_JOB_ID", None)
    argv = [sys.executable, str(FAKE_NNUNET), "900", "2d", "0", "-device", "cpu"]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = [process.pid]
    try:
        assert wait_until(lambda: ready.exists() and ready.read_text().endswith("\n"), 30)
        pids = [int(p) for p in ready.read_text().split()]
        ticks = process_start_ticks(process.pid)
        app = tui_app(roots, tmp_path / "state")
        run_id = f"nnunet:{process.pid}"
        async with app.run_test(size=(170, 48)) as pilot:
            screen = await dashboard_with_row(app, pilot, run_id)
            table = screen.query_one(JobTable)
            assert "watch-only" in table.get_cell(run_id, "state").plain
            assert table.get_cell(run_id, "where") == "cpu"
            assert table.get_cell(run_id, "epoch").startswith("2/1000")
            await pilot.press("s")
            dialog = await screen_of(app, pilot, RefusalScreen)
            text = dialog.query_one("#refusal-text").render().plain
            assert "no SIGUSR1 handler" in text and "-tr nnUNetTrainer_nnui -device cpu --c" in text
            await pilot.press("n")
            await screen_of(app, pilot, DashboardScreen)
        assert process.poll() is None and process_start_ticks(process.pid) == ticks
    finally:
        end_processes(pids, argv)
        process.wait(timeout=10)


async def test_the_palette_switches_the_engine_while_the_board_is_open(
    tmp_path: Path, monkeypatch, nnunet_installed
) -> None:
    roots = nnunet_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        dashboard = await screen_of(app, pilot, DashboardScreen)
        names = [name for name, _, _ in NnuiCommands(dashboard)._commands()]
        assert not any(name.startswith("Switch engine") for name in names)
        screen = await open_board(app, pilot)
        commands = {name: run for name, _, run in NnuiCommands(screen)._commands()}
        commands["Switch engine (nnui / nnU-Net)"]()
        await wait_for(lambda: screen.datasets_engine == engines.NNUNET, pilot)
        bindings = [b for bs in screen._bindings.key_to_bindings.values() for b in bs]
        assert any(b.id == "launch-engine" and b.key == "e" for b in bindings)
