"""Fold board: grouping into launch requests, its own checks, and the launch screen's
checks and preview (valid and invalid DDP groups) driven with Pilot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_gpus import FakeNvml, monitor
from tui_fixtures import (
    DATASET,
    burst,
    make_roots,
    screen_of,
    tui_app,
    use_fake_trainer,
    wait_for,
)

from app.screens.dashboard import DashboardScreen
from app.screens.launch import LaunchScreen
from app.screens.seam import Services, TuiConfig
from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker
from app.services.machine.procs import proc_info
from app.tui import make_app
from app.widgets.fold_board import BoardModel, FoldBoard, RequestSpec
from trainer.schema.atomic import atomic_write_text
from trainer.schema.status import Status
from trainer.schema.tree import run_dir

SPEC_CASES = [
    (
        {"0": ["0"], "1": ["1"]},
        [
            RequestSpec(("0",), ("0",), "per_gpu", False),
            RequestSpec(("1",), ("1",), "per_gpu", False),
        ],
    ),
    ({"0": ["0"], "3": ["0"]}, [RequestSpec(("0", "3"), ("0",), "per_gpu", True)]),
    ({"all": ["0", "1"]}, [RequestSpec(("all",), ("0", "1"), "spawn", False)]),
    (
        {"0": ["0", "1"], "1": ["2"]},
        [
            RequestSpec(("0",), ("0", "1"), "spawn", False),
            RequestSpec(("1",), ("2",), "per_gpu", False),
        ],
    ),
]


@pytest.mark.parametrize(("assignments", "expected"), SPEC_CASES)
def test_board_groups_folds_into_requests(assignments, expected) -> None:
    model = BoardModel(columns=["0", "1", "2"])
    for fold, gpus in assignments.items():
        for gpu in gpus:
            model.toggle(fold, gpu)
    assert model.specs() == expected
    assert model.checks() == []


CHECK_CASES = [
    ({}, "no fold assigned"),
    ({"0": ["0", "1"], "1": ["1"]}, "GPU 1 is in the DDP group of fold 0"),
]


@pytest.mark.parametrize(("assignments", "expected"), CHECK_CASES)
def test_board_checks_name_the_reason(assignments, expected) -> None:
    model = BoardModel(columns=["0", "1"])
    for fold, gpus in assignments.items():
        for gpu in gpus:
            model.toggle(fold, gpu)
    assert any(expected in problem for problem in model.checks())


def test_toggle_twice_removes_the_assignment() -> None:
    model = BoardModel(columns=["0"])
    model.toggle("2", "0")
    model.toggle("2", "0")
    assert model.assignments == {}


async def open_board(app, pilot) -> LaunchScreen:
    # The board's columns come from the first GPU reading.
    await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
    await screen_of(app, pilot, DashboardScreen)
    await pilot.press("l")
    screen = await screen_of(app, pilot, LaunchScreen)
    await wait_for(lambda: screen.query_one("#picker").choices, pilot)
    return screen


async def settled(screen: LaunchScreen, pilot, assignments: dict | None = None) -> None:
    """The board holds `assignments` (the keys were handled) and the checks and preview
    shown were made from what the widgets hold now."""
    board = screen.query_one(FoldBoard)
    if assignments is not None:
        await wait_for(lambda: board.model.assignments == assignments, pilot)
    await wait_for(screen.plan_is_current, pilot)


async def refused_go(screen: LaunchScreen, pilot) -> None:
    """g on a board with problems: refused, nothing started, still on the board."""
    refused = screen.num_refused
    await pilot.press("g")
    await wait_for(lambda: screen.num_refused == refused + 1, pilot)
    assert screen.app.screen is screen


# (plans batch size, GPUs in fold 0's group, launcher key presses, expected problem or
#  expected preview fragments)
DDP_CASES = [
    (2, 2, [], None, ["-num_gpus 2", "-device cpu", "NNUI_JOB_ID="]),
    (2, 2, ["m"], None, ["torch.distributed.run", "--nproc_per_node=2", "--standalone"]),
    (4, 4, [], None, ["-num_gpus 4"]),
    (2, 3, [], "group of 3 GPUs > global batch size 2", []),
    (3, 2, [], "global batch size 3 is not divisible by 2 GPUs", []),
]


@pytest.mark.parametrize(("batch", "group", "keys", "problem", "fragments"), DDP_CASES)
async def test_launch_board_checks_ddp_groups_and_previews(
    tmp_path: Path, monkeypatch, batch, group, keys, problem, fragments
) -> None:
    roots = make_roots(tmp_path, batch_size=batch)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state", simulate_gpus=4)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        for _ in range(group):
            await pilot.press("space", "right")
        await pilot.press(*keys)
        launcher = "torchrun" if keys == ["m"] else "spawn"
        board = screen.query_one(FoldBoard)
        await wait_for(lambda: board.model.ddp_launcher == launcher, pilot)
        await settled(screen, pilot, {"0": [str(g) for g in range(group)]})
        if problem is None:
            assert screen.problems == []
            assert len(screen.plans) == 1
            for fragment in fragments:
                assert fragment in screen.preview_text
            assert "-m trainer" in screen.preview_text or "fake_trainer.py" in screen.preview_text
        else:
            assert any(problem in p for p in screen.problems), screen.problems
            assert screen.plans == []
            await refused_go(screen, pilot)


async def test_launch_board_queues_folds_on_one_gpu_and_passes_trainer_flags(
    tmp_path: Path, monkeypatch
) -> None:
    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space", "down", "space", "f", *"--epochs 3", "enter")
        flags = screen.query_one("#flags")
        await wait_for(lambda: flags.value == "--epochs 3", pilot)
        await settled(screen, pilot, {"0": ["0"], "1": ["0"]})
        assert screen.problems == []
        assert [p.fold for p in screen.plans] == ["0", "1"]
        assert screen.plans[1].after == screen.plans[0].job_id
        assert "--epochs 3" in screen.preview_text
        assert f"after job {screen.plans[0].job_id}" in screen.preview_text


async def test_launch_board_click_toggles_a_cell(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        board = screen.query_one("#board")
        # Row 2 of the content (fold 1), second GPU column; +1/+1 for border and padding.
        await pilot.click(board, offset=(1 + 1 + 10 + 9 + 4, 1 + 2))
        await wait_for(lambda: board.model.assignments == {"1": ["1"]}, pilot)


def _registered_running_job(roots, state: Path, fold: str) -> str:
    """A job of this fold whose recorded process is alive: this very test process."""
    me = proc_info(os.getpid())
    folder = run_dir(roots.results, DATASET, "3d_fullres", fold)
    folder.mkdir(parents=True)
    job = Job(
        job_id="0101-000000-f0-abc", created_at=me.create_time, dataset=DATASET,
        configuration="3d_fullres", fold=fold, mode="single", device="cpu", gpus=["0"],
        simulated=True, argv=[], env={}, run_dir=str(folder),
        console_path=str(folder / "console.log"),
        processes=[ProcessRecord(me.pid, me.create_time, "trainer", None, me.start_ticks)],
    )  # fmt: skip
    Registry(state).add(job)
    return job.job_id


async def test_launch_board_refuses_a_fold_that_is_already_running(
    tmp_path: Path, monkeypatch
) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    _registered_running_job(roots, state, "0")
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space")  # fold 0 on GPU 0
        await settled(screen, pilot, {"0": ["0"]})
        assert any("fold 0 is already running" in p for p in screen.problems), screen.problems
        assert screen.plans == []
        checks = screen.query_one("#launch-checks").render().plain
        assert "fold 0 is already running" in checks
        await refused_go(screen, pilot)
        assert len(Registry(state).list()) == 1
        # Another fold is fine.
        await pilot.press("space", "down", "space")
        await settled(screen, pilot, {"1": ["0"]})
        assert screen.problems == [] and [p.fold for p in screen.plans] == ["1"]


async def test_launch_board_offers_resume_for_a_stopped_fold(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    folder = run_dir(roots.results, DATASET, "3d_fullres", "0")
    folder.mkdir(parents=True)
    atomic_write_text(folder / "status.json", Status("stopped", epoch=3, num_epochs=10).to_json())
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space")
        await settled(screen, pilot, {"0": ["0"]})
        assert screen.resumable == ["0"] and screen.plans == []
        assert "press c (resume --c)" in screen.query_one("#launch-checks").render().plain
        await pilot.press("c")
        await wait_for(lambda: screen.query_one("#resume").value, pilot)
        await settled(screen, pilot)
        assert screen.problems == [] and "--c" in screen.plans[0].argv


async def test_launch_board_warns_about_busy_gpus_and_other_users(
    tmp_path: Path, monkeypatch
) -> None:
    """A real (fake NVML) machine: GPU 1 is 51 % full, 97 % busy and used by alice."""
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    registry = Registry(state)
    services = Services(monitor(FakeNvml()), registry, JobTracker(registry))
    app = make_app(TuiConfig(roots=roots, state_dir=state, jobs_interval_s=0.25), services)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("right", "space")  # fold 0 on GPU 1
        await settled(screen, pilot, {"0": ["1"]})
        assert screen.problems == [] and screen.plans[0].gpus == ["1"]
        assert any("GPU 1 is busy" in w for w in screen.warnings), screen.warnings
        assert "GPU 1 is used by alice" in screen.warnings
        checks = screen.query_one("#launch-checks").render().plain
        assert "! GPU 1 is busy" in checks and "CUDA_VISIBLE_DEVICES=1" in screen.preview_text


async def test_escape_in_the_flags_field_returns_to_the_board(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space", "f", *"--epochs 3", "escape")
        board, flags = screen.query_one(FoldBoard), screen.query_one("#flags")
        await wait_for(lambda: screen.focused is board, pilot)
        assert app.screen is screen and flags.value == "--epochs 3"  # the typed flags kept
        await pilot.press("escape")
        await screen_of(app, pilot, DashboardScreen)


# Keys queued all at once (a busy machine, a fast typist) act in the order pressed, each on
# the widget that had focus when it was pressed: `g` right after enter starts the launch and
# is never typed into the flags field; characters right after `f` land in the field.
BURSTS = [
    (["space", "f", *"--epochs 3", "enter", "g"], "--epochs 3"),
    (["space", "f", *"--epochs 34", "backspace", "enter", "g"], "--epochs 3"),
    (["space", "f", *"--epochs 3", "escape", "g"], "--epochs 3"),
]


@pytest.mark.parametrize(("keys", "flags"), BURSTS)
async def test_keys_in_one_burst_act_in_order_on_the_widget_focused_then(
    tmp_path: Path, monkeypatch, keys: list[str], flags: str
) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    # Nothing is started for real: the launch is recorded (the plan holds the exact argv).
    started: list = []
    typed: list[str] = []  # the field's value when the launch started (the screen then closes)

    def start_plans(app, plans) -> None:
        typed.append(app.screen.query_one("#flags").value)
        started.extend(plans)

    monkeypatch.setattr("app.screens.actions.start_plans", start_plans)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        burst(app, *keys)
        await wait_for(lambda: started or screen.query_one("#flags").value.endswith("g"), pilot)
        assert typed == [flags], screen.query_one("#flags").value
        assert [p.fold for p in started] == ["0"]
        assert started[0].argv[-len(flags.split()) :] == flags.split(), started[0].argv
        await screen_of(app, pilot, DashboardScreen)


async def test_launch_board_when_free_toggle_makes_folds_wait_for_their_gpu(
    tmp_path: Path, monkeypatch
) -> None:
    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space", "down", "space", "w")
        await wait_for(lambda: screen.query_one("#when-free").value, pilot)
        await settled(screen, pilot, {"0": ["0"], "1": ["0"]})
        assert screen.problems == []
        # The supervisors wait for GPU 0 in turn (FIFO): no chain of `after` jobs.
        assert [(p.fold, p.after, p.schedule.when_free) for p in screen.plans] == [
            ("0", None, True),
            ("1", None, True),
        ]
        assert "when a GPU of 0 is free" in screen.preview_text


async def test_the_preview_shows_the_job_id_the_job_gets(tmp_path: Path, monkeypatch) -> None:
    """The form plans again whenever jobs or GPUs change: the id in its preview stays, and
    the job started gets exactly that id."""
    import re

    from fake_trainer import cleanup_jobs

    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            screen = await open_board(app, pilot)
            await pilot.press("space", "f", *"--epochs 1", "enter")
            await wait_for(lambda: screen.query_one("#flags").value == "--epochs 1", pilot)
            await settled(screen, pilot, {"0": ["0"]})
            shown = re.findall(r"NNUI_JOB_ID=(\S+)", screen.preview_text)
            assert len(shown) == 1
            for _ in range(2):  # what a new reading of the jobs or GPUs does
                screen.recompute()
                await wait_for(screen.plan_is_current, pilot)
                assert re.findall(r"NNUI_JOB_ID=(\S+)", screen.preview_text) == shown
            await pilot.press("g")
            await screen_of(app, pilot, DashboardScreen)
            await wait_for(lambda: Registry(tmp_path / "state").list(), pilot)
            assert [j.job_id for j in Registry(tmp_path / "state").list()] == shown
    finally:
        cleanup_jobs(tmp_path / "state")
