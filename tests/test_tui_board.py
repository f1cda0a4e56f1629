"""Fold board: grouping into launch requests, its own checks, and the launch screen's
checks and preview (valid and invalid DDP groups) driven with Pilot."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tui_fixtures import make_roots, tui_app, use_fake_trainer, wait_for

from app.screens.launch import LaunchScreen
from app.widgets.fold_board import BoardModel, RequestSpec

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
    await wait_for(lambda: app.snapshot is not None, pilot)
    await pilot.press("l")
    await wait_for(lambda: isinstance(app.screen, LaunchScreen), pilot)
    screen = app.screen
    await wait_for(lambda: screen.query_one("#picker").choices, pilot)
    return screen


async def settled(screen: LaunchScreen, pilot) -> None:
    await wait_for(lambda: screen.planned_generation == screen._generation, pilot)


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
        await settled(screen, pilot)
        if problem is None:
            assert screen.problems == []
            assert len(screen.plans) == 1
            for fragment in fragments:
                assert fragment in screen.preview_text
            assert "-m trainer" in screen.preview_text or "fake_trainer.py" in screen.preview_text
        else:
            assert any(problem in p for p in screen.problems), screen.problems
            assert screen.plans == []
            await pilot.press("g")  # refused: still on the board
            assert isinstance(app.screen, LaunchScreen)


async def test_launch_board_queues_folds_on_one_gpu_and_passes_trainer_flags(
    tmp_path: Path, monkeypatch
) -> None:
    roots = make_roots(tmp_path)
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space", "down", "space", "f", *"--epochs 3", "enter")
        await settled(screen, pilot)
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
        assert board.model.assignments == {"1": ["1"]}
