"""The nnU-Net engine on the board and nnU-Net runs in the jobs table, driven with Pilot on
simulated GPUs: the engine key and its plans files, the hint when nnunetv2 is missing,
watch-only rows whose stop/resume/kill are refused with nothing sent, and `r` on a stopped
nnU-Net job planning a resume with the nnU-Net engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tui_board import open_board, settled
from test_tui_fixtures import DATASET, make_roots, screen_of, tui_app, use_fake_trainer, wait_for

from app.screens.dashboard import DashboardScreen
from app.screens.launch import LaunchScreen
from app.services import engines
from app.widgets.dataset_picker import DatasetPicker
from app.widgets.fold_board import FoldBoard


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
