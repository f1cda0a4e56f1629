"""Pilot tests of the user's flows with the fake trainer and a registry in tmp: launch,
graceful stop (press s, confirm, the trainer stops, the table says stopped), pressing s
again, the typed kill confirm, read-only mode and the command palette."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
from tui_fixtures import (
    SAFETY_NET_S,
    kill_started_jobs,
    make_roots,
    screen_of,
    tui_app,
    use_fake_trainer,
    wait_for,
    write_frozen_runs,
)

from app.screens.confirm import KillConfirmScreen, LaunchConfirmScreen, StopConfirmScreen
from app.screens.dashboard import DashboardScreen
from app.screens.help import HelpScreen
from app.screens.keys import ACTION_IDS
from app.screens.launch import LaunchScreen
from app.screens.palette import NnuiCommands
from app.services.jobs.registry import Registry
from app.services.launch import launcher
from app.services.launch import request as launch_request


def live_or_zombie_children() -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process().children()]


def zombie_children() -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]


async def launch_one_fold(app, pilot, flags: str) -> str:
    # The board's columns come from the first GPU reading.
    await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
    await screen_of(app, pilot, DashboardScreen)
    await pilot.press("l")
    screen = await screen_of(app, pilot, LaunchScreen)
    await wait_for(lambda: screen.query_one("#picker").choices, pilot)
    await pilot.press("space", "f", *flags, "enter")
    await wait_for(lambda: screen.query_one("#flags").value == flags, pilot)
    await wait_for(lambda: screen.plans and screen.plan_is_current(), pilot)
    assert screen.problems == []
    job_id = screen.plans[0].job_id
    await pilot.press("g")
    await screen_of(app, pilot, DashboardScreen)
    return job_id


@pytest.mark.slow
async def test_launch_then_graceful_stop_then_resume(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            job_id = await launch_one_fold(app, pilot, "--epochs 200 --epoch-time 0.2")
            await wait_for(
                lambda: (
                    (v := app.view_of(job_id)) is not None
                    and v.state == "running"
                    and (v.epoch or 0) >= 1
                ),
                pilot,
            )
            job = Registry(state).get(job_id)
            assert job.gpus == ["0"] and job.simulated
            assert "--epochs" in job.argv
            # The table shows it; the cell of the state column says running.
            table = app.screen.query_one("#jobs")
            assert table.get_cell(job_id, "state").plain == "running"

            await pilot.press("s")
            await screen_of(app, pilot, StopConfirmScreen)
            dialog = app.screen
            text = dialog.query_one("#stop-plan").render().plain
            rank_pid = app.view_of(job_id).topology["ranks"][0]["pid"]
            assert f"pid {rank_pid}" in text and "rank 0" in text and "device cpu" in text
            assert "stops at the end of the running epoch (epoch " in text
            await pilot.press("y")
            await wait_for(
                lambda: (
                    app.view_of(job_id).state == "stopped" and app.view_of(job_id).exit_code == 0
                ),
                pilot,
            )
            await wait_for(
                lambda: app.screen.query_one("#jobs").get_cell(job_id, "state").plain == "stopped",
                pilot,
            )
            assert any(s.result == "sent" for s in Registry(state).get(job_id).signals)
            # Its supervisor (our child) ends after the job: the board reaps it (a child
            # that is not reaped stays listed as <defunct> until the TUI quits).
            supervisor = Registry(state).get(job_id).process("supervisor").pid
            await wait_for(lambda: supervisor not in live_or_zombie_children(), pilot)
            assert not zombie_children()

            # s again: harmless, the dialog says why nothing is sent and offers only Close.
            await pilot.press("s")
            await screen_of(app, pilot, StopConfirmScreen)
            assert not app.screen.actionable
            assert "nothing is sent" in app.screen.query_one("#stop-plan").render().plain
            await pilot.press("y")
            await screen_of(app, pilot, DashboardScreen)
            signals_after = Registry(state).get(job_id).signals
            assert len([s for s in signals_after if s.result == "sent"]) == 1

            # r: resume with --c on the same GPU, after showing the exact command.
            await pilot.press("r")
            await screen_of(app, pilot, LaunchConfirmScreen)
            preview = app.screen.query_one("#launch-preview-text").render().plain
            assert "--c" in preview and " 0 -device cpu" in preview
            # ... and what it continues from (the fake trainer saves no checkpoint file).
            assert "starts from scratch (epoch 1)" in preview, preview
            await pilot.press("y")
            await wait_for(lambda: len(Registry(state).list()) == 2, pilot)
            resumed = next(j for j in Registry(state).list() if j.job_id != job_id)
            assert "--c" in resumed.argv and resumed.gpus == ["0"] and resumed.fold == "0"
    finally:
        kill_started_jobs(state)


async def test_readonly_binds_no_action_keys(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    ids_written = write_frozen_runs(roots, state)
    app = tui_app(roots, state, readonly=True)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: len(app.views) == len(ids_written), pilot)
        ids = {b.id for bs in screen._bindings.key_to_bindings.values() for b in bs}
        assert ids.isdisjoint(ACTION_IDS)
        assert {"detail", "help", "quit"} <= ids
        active = {b.binding.id for b in app.active_bindings.values()}
        assert active.isdisjoint(ACTION_IDS)
        before = Registry(state).list()
        # `?` after the action keys: once help is up, l s r k have been handled (in order).
        await pilot.press("l", "s", "r", "k", "question_mark")
        await screen_of(app, pilot, HelpScreen)
        assert app.screen_stack[-2] is screen and len(app.screen_stack) == 3
        assert Registry(state).list() == before  # nothing launched, signalled or written
        names = [name for name, _, _ in NnuiCommands(screen)._commands()]
        assert names == ["Job detail", "Filter jobs", "Sort jobs", "Cross-validation view", "Help",
                         "Quit"]  # fmt: skip


async def test_action_bindings_all_have_ids(tmp_path: Path) -> None:
    app = tui_app(make_roots(tmp_path), tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await screen_of(app, pilot, DashboardScreen)
        bindings = [b for bs in screen._bindings.key_to_bindings.values() for b in bs]
        assert all(b.id for b in bindings)
        assert {b.id for b in bindings} >= ACTION_IDS
        await pilot.press("question_mark")
        text = (await screen_of(app, pilot, HelpScreen)).query_one("#help-text").render().plain
        for word in ("Launch", "Stop", "Resume", "Kill", "ctrl+p"):
            assert word in text


class _Proc:
    pid, name, cmdline = 4242, "python", ["python", "-m", "trainer"]


class _Job:
    job_id, dataset, configuration, fold = "job-x", "Dataset004_Demo", "3d_fullres", "0"


class _View:
    job, state = _Job(), "running"


class _Choice:
    view, processes = _View(), (_Proc(),)


async def test_kill_needs_the_typed_word(tmp_path: Path) -> None:
    app = tui_app(make_roots(tmp_path), tmp_path / "state")
    results: list[bool] = []
    async with app.run_test(size=(150, 48)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        app.push_screen(KillConfirmScreen([_Choice()]), results.append)
        dialog = await screen_of(app, pilot, KillConfirmScreen)
        await wait_for(lambda: dialog.query_one("#kill-word").has_focus, pilot)
        assert "pid 4242" in dialog.query_one("#kill-plan").render().plain
        await pilot.press(*"kil", "enter")
        await wait_for(lambda: dialog.num_refused == 1, pilot)
        assert app.screen is dialog and results == []
        await pilot.press("l", "enter")
        await wait_for(lambda: results == [True], pilot)
        app.push_screen(KillConfirmScreen([_Choice()]), results.append)
        dialog = await screen_of(app, pilot, KillConfirmScreen)
        await pilot.press("escape")
        await wait_for(lambda: results == [True, False], pilot)


@pytest.mark.slow
async def test_kill_flow_ends_the_job(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            job_id = await launch_one_fold(app, pilot, "--epochs 500 --epoch-time 0.2")
            await wait_for(
                lambda: (v := app.view_of(job_id)) is not None and (v.epoch or 0) >= 1,
                pilot,
            )
            trainer_pid = Registry(state).get(job_id).process("trainer").pid
            await pilot.press("k")
            await screen_of(app, pilot, KillConfirmScreen)
            assert f"pid {trainer_pid}" in app.screen.query_one("#kill-plan").render().plain
            await pilot.press(*"kill", "enter")
            await wait_for(
                lambda: app.view_of(job_id).state not in ("running", "starting", "stopping"),
                pilot,
            )
            assert app.view_of(job_id).exit_code not in (None, 0)
    finally:
        kill_started_jobs(state)


async def test_space_selects_several_jobs_for_stop(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    ids = write_frozen_runs(roots, state)
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        dashboard = await screen_of(app, pilot, DashboardScreen)
        table = dashboard.query_one("#jobs")
        await wait_for(lambda: len(app.views) == 3 and table.row_count == 3, pilot)
        await pilot.press("space", "down", "down", "space")
        await wait_for(lambda: table.target_job_ids() == [ids[0], ids[2]], pilot)
        await pilot.press("s")
        text = (await screen_of(app, pilot, StopConfirmScreen)).query_one("#stop-plan")
        text = text.render().plain
        assert ids[0] in text and ids[2] in text and ids[1] not in text
        assert "job is finished: nothing to stop" in text and "job is failed" in text
        assert not app.screen.actionable
        await pilot.press("escape")
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("space")  # unselect the third: the cursor row is the target again
        await wait_for(lambda: table.target_job_ids() == [ids[0]], pilot)


async def test_go_right_after_typing_flags_uses_the_new_flags(tmp_path: Path, monkeypatch) -> None:
    """g pressed while the checks of just-typed flags are still running waits for them: the
    job starts with the flags on screen, never with a plan of older input. (The checks are
    held until g has been handled: a busy machine, made deterministic.)"""
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
            await screen_of(app, pilot, DashboardScreen)
            await pilot.press("l")
            screen = await screen_of(app, pilot, LaunchScreen)
            await wait_for(lambda: screen.query_one("#picker").choices, pilot)
            await pilot.press("space")
            await wait_for(lambda: screen.plans and screen.plan_is_current(), pilot)  # no flags
            real_checks, release = launch_request.check_request, threading.Event()

            def held_checks(*args, **kwargs):  # the checks wait until g was handled
                assert release.wait(SAFETY_NET_S)
                return real_checks(*args, **kwargs)

            monkeypatch.setattr(launch_request, "check_request", held_checks)
            monkeypatch.setattr(launcher, "check_request", held_checks)
            await pilot.press("f", *"--epochs 7", "enter", "g")
            await wait_for(lambda: screen._go_pending, pilot)  # g seen, waiting for the checks
            assert app.screen is screen and Registry(state).list() == []
            release.set()
            await screen_of(app, pilot, DashboardScreen)
            await wait_for(lambda: len(Registry(state).list()) == 1, pilot)
            argv = Registry(state).list()[0].argv
            assert argv[argv.index("--epochs") + 1] == "7", argv
    finally:
        kill_started_jobs(state)


class _LateMonitor:
    """Simulated GPUs whose reading, once armed, comes back only after the dashboard has
    begun to be taken apart (a thread finishing late on a busy machine at shutdown)."""

    def __init__(self) -> None:
        from app.services.machine.gpus import GpuMonitor

        self.inner = GpuMonitor(simulate=2)
        self.panel = None  # armed: the GpuPanel to outlive
        self.waiting = threading.Event()  # the armed reading is on its way
        self.answered_late = threading.Event()

    def snapshot(self):
        reading = self.inner.snapshot()
        panel = self.panel
        if panel is None:
            return reading
        self.waiting.set()
        gone = threading.Event()
        while panel.display and not gone.wait(0.01):  # display is False once pruning began
            pass
        self.answered_late.set()
        return dataclasses.replace(reading, gpus=reading.gpus[:1])  # a change to draw

    def close(self) -> None:
        self.inner.close()


async def test_a_reading_that_arrives_during_shutdown_is_dropped(tmp_path: Path) -> None:
    """Was `NoMatches: JobTable` / `GpuPanel`: data drawn into a half-removed screen."""
    from app.screens.seam import Services, TuiConfig
    from app.services.jobs.views import JobTracker
    from app.tui import make_app
    from app.widgets.gpu_panel import GpuPanel

    roots, state = make_roots(tmp_path), tmp_path / "state"
    late = _LateMonitor()
    registry = Registry(state)
    services = Services(late, registry, JobTracker(registry))
    config = TuiConfig(roots=roots, state_dir=state, gpu_interval_s=0.05, jobs_interval_s=0.05)
    app = make_app(config, services)
    async with app.run_test(size=(150, 48)) as pilot:
        dashboard = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: app.num_machine_messages >= 1, pilot)
        late.panel = dashboard.query_one(GpuPanel)
        await wait_for(late.waiting.is_set, pilot)  # earlier readings drawn, this one held
        drawn = app.num_machine_messages
    # Leaving run_test took the screens apart while the reading was on its way; it raised
    # nothing (run_test re-raises the app's exception) and nothing was drawn.
    assert late.answered_late.wait(SAFETY_NET_S)
    assert app.num_machine_messages == drawn
