"""Pilot tests of the user's flows with the fake trainer and a registry in tmp: launch,
graceful stop (press s, confirm, the trainer stops, the table says stopped), pressing s
again, the typed kill confirm, read-only mode and the command palette."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_tui_fixtures import (
    kill_started_jobs,
    make_roots,
    tui_app,
    use_fake_trainer,
    wait_for,
    write_frozen_runs,
)

from app.screens.confirm import KillConfirmScreen, LaunchConfirmScreen, StopConfirmScreen
from app.screens.dashboard import ACTION_IDS, DashboardScreen
from app.screens.launch import LaunchScreen
from app.screens.palette import NnuiCommands
from app.services import launcher
from app.services.registry import Registry


async def launch_one_fold(app, pilot, flags: str) -> str:
    # The board's columns come from the first GPU reading.
    await wait_for(lambda: app.snapshot is not None, pilot)
    await pilot.press("l")
    await wait_for(lambda: isinstance(app.screen, LaunchScreen), pilot)
    screen = app.screen
    await wait_for(lambda: screen.query_one("#picker").choices, pilot)
    await pilot.press("space", "f", *flags, "enter")
    await wait_for(lambda: screen.plans and screen.planned_generation == screen._generation, pilot)
    assert screen.problems == []
    job_id = screen.plans[0].job_id
    await pilot.press("g")
    await wait_for(lambda: isinstance(app.screen, DashboardScreen), pilot)
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
                timeout_s=15,
            )
            job = Registry(state).get(job_id)
            assert job.gpus == ["0"] and job.simulated
            assert "--epochs" in job.argv
            # The table shows it; the cell of the state column says running.
            table = app.screen.query_one("#jobs")
            assert table.get_cell(job_id, "state").plain == "running"

            await pilot.press("s")
            await wait_for(lambda: isinstance(app.screen, StopConfirmScreen), pilot)
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
                timeout_s=15,
            )
            await wait_for(
                lambda: app.screen.query_one("#jobs").get_cell(job_id, "state").plain == "stopped",
                pilot,
            )
            assert any(s.result == "sent" for s in Registry(state).get(job_id).signals)

            # s again: harmless, the dialog says why nothing is sent and offers only Close.
            await pilot.press("s")
            await wait_for(lambda: isinstance(app.screen, StopConfirmScreen), pilot)
            assert not app.screen.actionable
            assert "nothing is sent" in app.screen.query_one("#stop-plan").render().plain
            await pilot.press("y")
            await wait_for(lambda: isinstance(app.screen, DashboardScreen), pilot)
            signals_after = Registry(state).get(job_id).signals
            assert len([s for s in signals_after if s.result == "sent"]) == 1

            # r: resume with --c on the same GPU, after showing the exact command.
            await pilot.press("r")
            await wait_for(lambda: isinstance(app.screen, LaunchConfirmScreen), pilot)
            preview = app.screen.query_one("#launch-preview-text").render().plain
            assert "--c" in preview and " 0 -device cpu" in preview
            await pilot.press("y")
            await wait_for(lambda: len(Registry(state).list()) == 2, pilot)
            resumed = next(j for j in Registry(state).list() if j.job_id != job_id)
            assert "--c" in resumed.argv and resumed.gpus == ["0"] and resumed.fold == "0"
    finally:
        kill_started_jobs(state)


async def test_readonly_binds_no_action_keys(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    app = tui_app(roots, tmp_path / "state", readonly=True)
    async with app.run_test(size=(150, 48)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, DashboardScreen)
        ids = {b.id for bs in screen._bindings.key_to_bindings.values() for b in bs}
        assert ids.isdisjoint(ACTION_IDS)
        assert {"detail", "help", "quit"} <= ids
        active = {b.binding.id for b in app.active_bindings.values()}
        assert active.isdisjoint(ACTION_IDS)
        await pilot.press("l", "s", "r", "k")
        assert app.screen is screen
        names = [name for name, _, _ in NnuiCommands(screen)._commands()]
        assert names == ["Job detail", "Help", "Quit"]


async def test_action_bindings_all_have_ids(tmp_path: Path) -> None:
    app = tui_app(make_roots(tmp_path), tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        await pilot.pause()
        bindings = [b for bs in app.screen._bindings.key_to_bindings.values() for b in bs]
        assert all(b.id for b in bindings)
        assert {b.id for b in bindings} >= ACTION_IDS
        await pilot.press("question_mark")
        text = app.screen.query_one("#help-text").render().plain
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
        await pilot.pause()
        app.push_screen(KillConfirmScreen([_Choice()]), results.append)
        await pilot.pause()
        assert "pid 4242" in app.screen.query_one("#kill-plan").render().plain
        await pilot.press(*"kil", "enter")
        assert isinstance(app.screen, KillConfirmScreen) and results == []
        await pilot.press("l", "enter")
        await wait_for(lambda: results == [True], pilot)
        app.push_screen(KillConfirmScreen([_Choice()]), results.append)
        await pilot.pause()
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
                timeout_s=15,
            )
            trainer_pid = Registry(state).get(job_id).process("trainer").pid
            await pilot.press("k")
            await wait_for(lambda: isinstance(app.screen, KillConfirmScreen), pilot)
            assert f"pid {trainer_pid}" in app.screen.query_one("#kill-plan").render().plain
            await pilot.press(*"kill", "enter")
            await wait_for(
                lambda: app.view_of(job_id).state not in ("running", "starting", "stopping"),
                pilot,
                timeout_s=15,
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
        await wait_for(lambda: len(app.views) == 3, pilot)
        await pilot.press("space", "down", "down", "space")
        table = app.screen.query_one("#jobs")
        assert table.target_job_ids() == [ids[0], ids[2]]
        await pilot.press("s")
        await wait_for(lambda: isinstance(app.screen, StopConfirmScreen), pilot)
        text = app.screen.query_one("#stop-plan").render().plain
        assert ids[0] in text and ids[2] in text and ids[1] not in text
        assert "job is finished: nothing to stop" in text and "job is failed" in text
        assert not app.screen.actionable
        await pilot.press("escape")
        await pilot.press("space")  # unselect the third: the cursor row is the target again
        assert table.target_job_ids() == [ids[0]]


async def test_go_right_after_typing_flags_uses_the_new_flags(tmp_path: Path, monkeypatch) -> None:
    """g pressed while the checks of just-typed flags are still running waits for them: the
    job starts with the flags on screen, never with a plan of older input."""
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            await wait_for(lambda: app.snapshot is not None, pilot)
            await pilot.press("l")
            await wait_for(lambda: isinstance(app.screen, LaunchScreen), pilot)
            screen = app.screen
            await wait_for(lambda: screen.query_one("#picker").choices, pilot)
            await pilot.press("space")
            await wait_for(lambda: screen.plans, pilot)  # a valid plan, without flags
            slow = launcher.check_request

            def slow_checks(*args, **kwargs):  # a busy machine: the checks take a while
                time.sleep(0.5)
                return slow(*args, **kwargs)

            monkeypatch.setattr(launcher, "check_request", slow_checks)
            await pilot.press("f", *"--epochs 7", "enter", "g")
            await wait_for(lambda: isinstance(app.screen, DashboardScreen), pilot)
            await wait_for(lambda: len(Registry(state).list()) == 1, pilot)
            argv = Registry(state).list()[0].argv
            assert argv[argv.index("--epochs") + 1] == "7", argv
    finally:
        kill_started_jobs(state)
