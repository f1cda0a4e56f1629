"""The screens never hide or invent state: keys pressed before the first readings, a
corrupt registry file named on the dashboard, alerts notified once per condition."""

from __future__ import annotations

import threading
from pathlib import Path

from tui_fixtures import SAFETY_NET_S, make_roots, record_toasts, screen_of, wait_for

from app.screens.dashboard import DashboardScreen
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from app.tui import Services, TuiConfig, make_app


class _HeldMonitor:
    """Simulated GPUs whose readings wait until the test releases them (a slow NVML)."""

    def __init__(self) -> None:
        from app.services.machine.gpus import GpuMonitor

        self.inner = GpuMonitor(simulate=2)
        self.release = threading.Event()

    def snapshot(self):
        self.release.wait(SAFETY_NET_S)
        return self.inner.snapshot()

    def close(self) -> None:
        self.release.set()
        self.inner.close()


class _HeldTracker(JobTracker):
    """A job reading that waits for the same release (a slow run folder)."""

    def __init__(self, registry: Registry, release: threading.Event) -> None:
        super().__init__(registry)
        self.release = release

    def refresh(self, snapshot=None):
        self.release.wait(SAFETY_NET_S)
        return super().refresh(snapshot)


def _held_app(tmp_path: Path):
    roots, state = make_roots(tmp_path), tmp_path / "state"
    monitor = _HeldMonitor()
    registry = Registry(state)
    services = Services(monitor, registry, _HeldTracker(registry, monitor.release))
    config = TuiConfig(roots=roots, state_dir=state, simulate_gpus=2)
    return make_app(config, services), monitor


async def test_action_keys_before_the_first_readings_say_loading(tmp_path: Path) -> None:
    """Was: `l` in the first second -> a blank screen, then `NoMatches: '.gpu-text'`."""
    app, monitor = _held_app(tmp_path)
    toasts = record_toasts(app)
    async with app.run_test(size=(150, 48)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        assert app.snapshot is None and app.num_jobs_messages == 0
        for key in ("l", "s", "r", "k", "d", "enter", "o", "question_mark"):
            await pilot.press(key)
            if not isinstance(app.screen, DashboardScreen):
                await pilot.press("escape")
            await screen_of(app, pilot, DashboardScreen)
        assert any("loading" in t for t in toasts), toasts
        assert not any("No job selected" in t for t in toasts), toasts
        monitor.release.set()
        await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
        await pilot.press("l")  # with the data in, l opens the fold board
        from app.screens.launch import LaunchScreen

        await screen_of(app, pilot, LaunchScreen)


async def test_a_corrupt_job_file_is_named_and_the_other_jobs_show(tmp_path: Path) -> None:
    """Was: one unreadable registry file -> "No jobs yet" while trainings ran, no warning."""
    from tui_fixtures import tui_app, write_frozen_runs

    roots, state = make_roots(tmp_path), tmp_path / "state"
    ids = write_frozen_runs(roots, state)
    bad = state / "jobs" / "20260101-000009-f9.json"
    bad.write_text('{"job_id": "20260101-000009-f9", "trunc')
    app = tui_app(roots, state)
    toasts = record_toasts(app)
    async with app.run_test(size=(150, 48)) as pilot:
        dashboard = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: app.num_jobs_messages >= 1, pilot)
        await wait_for(lambda: len(dashboard.query_one("#jobs").rows) == len(ids), pilot)
        line = dashboard.query_one("#cv-line").render().plain
        assert "warning" in line and bad.name in line, line
        assert any(bad.name in t for t in toasts)
        summary = dashboard.query_one("#job-summary").render().plain
        assert "No jobs yet" not in summary
    assert bad.exists() and bad.read_text().endswith("trunc")  # left as it is
    assert sorted(p.name for p in (state / "jobs").iterdir()) == sorted(
        [*(f"{i}.json" for i in ids), bad.name]
    )


async def test_only_a_corrupt_job_file_never_says_no_jobs_yet(tmp_path: Path) -> None:
    from tui_fixtures import tui_app

    roots, state = make_roots(tmp_path), tmp_path / "state"
    Registry(state)
    bad = state / "jobs" / "20260101-000009-f9.json"
    bad.write_text("not json")
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        dashboard = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: app.num_jobs_messages >= 1, pilot)
        await wait_for(lambda: bad.name in dashboard.query_one("#cv-line").render().plain, pilot)
        summary = dashboard.query_one("#job-summary").render().plain
        assert "No jobs yet" not in summary and "could not be read" in summary, summary


class _StallingTracker(JobTracker):
    """Every reading says the same stall with a new number of seconds (as a real one does)."""

    def refresh(self, snapshot=None):
        import dataclasses

        views = super().refresh(snapshot)
        self.num_reads = getattr(self, "num_reads", 0) + 1
        alert = f"stalled: no event for {200 + self.num_reads} s"
        return [dataclasses.replace(v, alerts=(alert,)) for v in views]


async def test_one_toast_per_alert_condition_not_per_second(tmp_path: Path) -> None:
    """Was: "stalled: no event for 208 s", "209 s", ... one toast a second."""
    from tui_fixtures import write_frozen_runs

    from app.services.machine.gpus import GpuMonitor

    roots, state = make_roots(tmp_path), tmp_path / "state"
    ids = write_frozen_runs(roots, state)
    registry = Registry(state)
    tracker = _StallingTracker(registry)
    services = Services(GpuMonitor(simulate=2), registry, tracker)
    config = TuiConfig(roots=roots, state_dir=state, simulate_gpus=2, jobs_interval_s=0.05)
    app = make_app(config, services)
    toasts = record_toasts(app)
    async with app.run_test(size=(150, 48)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: app.num_jobs_messages >= 6, pilot)
        stalls = [t for t in toasts if "stalled" in t]
        assert len(stalls) == len(ids), stalls
