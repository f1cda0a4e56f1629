"""The fake NVML library (tests/fake_nvml) under the whole app: the board via Pilot (8 GPUs,
another user, "n/a", MIG devices as columns, a GPU lost while it runs, no driver) and real
jobs of the fake trainer on a MIG device and on a GPU that is then lost."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
from fake_nvml.fixtures import *  # noqa: F403 (pytest fixtures: fake_library, machine, other_user)
from fake_nvml.scenario import DRIVER_NOT_LOADED, GIB, GPU_IS_LOST, FakeMachine, h200_box
from fake_trainer import FAKE_TRAINER, cleanup_jobs, fake_env, wait_until
from test_nvml_fake import MIG_UUIDS, mig_box
from tui_fixtures import make_roots, screen_of, use_fake_trainer, wait_for

from app.screens.dashboard import DashboardScreen
from app.screens.launch import LaunchScreen
from app.screens.seam import Services, TuiConfig
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from app.services.launch import launcher
from app.services.launch import request as launch_request
from app.services.machine.gpus import GpuMonitor
from app.services.signals.send import send_stop
from app.services.signals.targets import plan_stop
from app.tui import make_app
from app.widgets.fold_board import FoldBoard
from app.widgets.gpu_panel import GpuCard, GpuPanel
from trainer.schema.tree import resolve_roots

ROOT = Path(__file__).resolve().parents[3]


def app_on(machine: FakeMachine, tmp_path: Path, monkeypatch):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    registry = Registry(state)
    monitor = GpuMonitor(backend=machine.nvml, visible_devices=None)
    services = Services(monitor, registry, JobTracker(registry))
    config = TuiConfig(roots=roots, state_dir=state, gpu_interval_s=0.2, jobs_interval_s=0.25,
                       cache_dir=tmp_path / "cache")  # fmt: skip
    return make_app(config, services)


def card_text(app, index: int) -> str:
    return app.screen.query_one(f"#gpu-{index}", GpuCard)._last_text or ""


async def test_board_shows_the_machine_and_a_gpu_lost_while_it_runs(
    machine: FakeMachine, tmp_path: Path, monkeypatch, other_user: tuple[int, str]
) -> None:
    pid, user = other_user
    box = mig_box()
    box["gpus"][1].update(procs=[{"pid": pid, "used": 80 * GIB}], mem_used=81 * GIB, util=97)
    box["errors"] = [{"gpu": 4, "fn": "nvmlDeviceGetPowerUsage", "code": 3}]
    machine.write(box)
    app = app_on(machine, tmp_path, monkeypatch)
    async with app.run_test(size=(160, 60)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: len(app.screen.query(GpuCard)) == 8 and card_text(app, 7), pilot)
        assert "GPU 1 H200" in card_text(app, 1) and "81.0/140.4 GiB" in card_text(app, 1)
        assert f"{user} (other user)" in card_text(app, 1) and "80.0/140.4" not in card_text(app, 1)
        assert "power n/a" in card_text(app, 4) and "MIG: partitioned in 3" in card_text(app, 2)
        assert all(u in card_text(app, 2) for u in MIG_UUIDS)
        # GPU 5 falls off the bus; GPU 0 gets busy: both show, the board goes on.
        box["errors"].append({"gpu": 5, "fn": "*", "code": GPU_IS_LOST})
        box["gpus"][0].update(util=88)
        machine.write(box)
        await wait_for(lambda: "LOST" in card_text(app, 5) and " 88%" in card_text(app, 0), pilot)
        assert "GPU is lost" in card_text(app, 5) and "LOST" not in card_text(app, 6)
        await wait_for(lambda: app.num_jobs_messages >= 1, pilot)  # l waits for the jobs too
        await pilot.press("l")
        screen = await screen_of(app, pilot, LaunchScreen)
        board = screen.query_one(FoldBoard)
        await wait_for(lambda: len(board.model.columns) == 10, pilot)
        assert board.model.columns == ["0", "1", *MIG_UUIDS, "3", "4", "5", "6", "7"]
        assert "MIG 0000" in board.render().plain


async def test_board_without_a_driver_offers_cpu_slots(
    machine: FakeMachine, tmp_path: Path, monkeypatch
) -> None:
    error = {"gpu": -1, "fn": "nvmlInitWithFlags", "code": DRIVER_NOT_LOADED}
    machine.write({"gpus": [], "errors": [error]})
    app = app_on(machine, tmp_path, monkeypatch)
    async with app.run_test(size=(160, 48)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        panel = app.screen.query_one(GpuPanel)
        await wait_for(lambda: panel._banner_text, pilot)
        assert "No usable GPU: jobs run on CPU" in panel._banner_text
        assert "CPU slots: 1" in panel._banner_text
        assert "NVIDIA driver not loaded" in panel._banner_text
        assert len(panel._banner_text.splitlines()) == 1 and not app.screen.query(GpuCard)


def _start_on(gpus: list[str], machine: FakeMachine, registry: Registry):
    """One fold of the fake trainer as a CUDA job on `gpus`, checked against the fake."""
    snapshot = GpuMonitor(backend=machine.nvml, visible_devices=None).snapshot()
    request = launch_request.LaunchRequest("4", "3d_fullres", ["0"], gpus, "per_gpu", "cuda",
                                     ["--epochs", "300", "--epoch-time", "0.1"], False)  # fmt: skip
    plans, problems = launcher.plan_launch(request, resolve_roots(), 2, snapshot, registry)
    assert problems == []
    return launcher.start(plans[0], registry), snapshot


def test_job_on_a_mig_device_gets_its_uuid_and_stops(
    machine: FakeMachine, tmp_path: Path, monkeypatch
) -> None:
    for key, value in fake_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    assert FAKE_TRAINER.is_file()
    machine.write(mig_box())
    registry = Registry()
    try:
        job, _ = _start_on([MIG_UUIDS[1]], machine, registry)
        tracker = JobTracker(registry)
        view = lambda: next(v for v in tracker.refresh() if v.job.job_id == job.job_id)  # noqa: E731
        assert wait_until(lambda: view().topology is not None, 30)
        trainer = registry.get(job.job_id).process("trainer")
        environ = psutil.Process(trainer.pid).environ()
        assert environ["CUDA_VISIBLE_DEVICES"] == MIG_UUIDS[1]
        assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        current = view()
        plan = plan_stop(current.job, current.topology, current.epoch)
        assert plan.ok, plan.reason
        assert [t.pid for t in plan.targets] == [trainer.pid]  # the worker, found
        assert [r.result for r in send_stop(plan, current.job, registry)] == ["sent"]
        assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 30)
        assert (view().state, view().exit_code) == ("stopped", 0)
    finally:
        cleanup_jobs(tmp_path / "state")


def test_job_on_a_gpu_that_is_lost_is_flagged(
    machine: FakeMachine, tmp_path: Path, monkeypatch
) -> None:
    for key, value in fake_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    box = h200_box()
    machine.write(box)
    registry = Registry()
    try:
        job, before = _start_on(["5"], machine, registry)
        tracker = JobTracker(registry)
        view = lambda snapshot: next(  # noqa: E731
            v for v in tracker.refresh(snapshot) if v.job.job_id == job.job_id
        )
        assert wait_until(lambda: view(before).state == "running", 30)
        assert not any("lost" in a for a in view(before).alerts)
        box["errors"] = [{"gpu": 5, "fn": "*", "code": GPU_IS_LOST}]
        machine.write(box)
        after = GpuMonitor(backend=machine.nvml, visible_devices=None).snapshot()
        assert "GPU 5 lost (NVML: GPU is lost): the job cannot go on" in view(after).alerts
        env = {**os.environ, **machine.env(), "PYTHONPATH": str(ROOT)}
        status = subprocess.run([sys.executable, "-m", "app.main", "status"], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert f"! {job.job_id}: GPU 5 lost (NVML: GPU is lost)" in status.stdout
    finally:
        cleanup_jobs(tmp_path / "state")
