"""A first run: the screen without datasets says what to run (different for no raw data and
raw data not yet preprocessed), the palette's screenshot works on a box without a Downloads
folder, `nnui --version`, and an interrupted `make setup` is repaired by the next one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tui_fixtures import screen_of, tui_app, wait_for

from app.screens.dashboard import DashboardScreen
from app.services.launch import catalog
from trainer.schema.tree import Roots

REPO = Path(__file__).resolve().parents[3]


def _empty_roots(tmp_path: Path) -> Roots:
    roots = Roots(tmp_path / "raw", tmp_path / "preprocessed", tmp_path / "results")
    for root in (roots.raw, roots.preprocessed, roots.results):
        root.mkdir()
    return roots


def _raw_dataset(roots: Roots, name: str = "Dataset900_NnuiDemo") -> None:
    (roots.raw / name).mkdir()
    (roots.raw / name / "dataset.json").write_text(json.dumps({"labels": {"background": 0}}))


def test_first_step_tells_no_raw_data_from_not_preprocessed(tmp_path: Path) -> None:
    roots = _empty_roots(tmp_path)
    assert "nnui-demo-data" in catalog.first_step(roots)
    assert "no raw data" in catalog.first_step(roots)
    _raw_dataset(roots)
    step = catalog.first_step(roots)
    assert "not preprocessed" in step and "nnui-preprocess 900 -c 2d 3d_fullres" in step


async def test_first_screen_names_the_command_to_run(tmp_path: Path) -> None:
    roots = _empty_roots(tmp_path)
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await screen_of(app, pilot, DashboardScreen)
        summary = screen.query_one("#job-summary")
        await wait_for(lambda: "nnui-demo-data" in str(summary.render()), pilot)
        _raw_dataset(roots)
        await wait_for(lambda: "nnui-preprocess 900" in str(summary.render()), pilot)


def _text_or_empty(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


async def test_palette_screenshot_goes_to_the_current_folder_without_downloads(
    tmp_path: Path, monkeypatch
) -> None:
    home = tmp_path / "home"  # no Downloads folder in it
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_DOWNLOAD_DIR", str(home / "Downloads"))
    monkeypatch.chdir(work)
    app = tui_app(_empty_roots(tmp_path), tmp_path / "state")
    async with app.run_test(size=(100, 30)) as pilot:
        await screen_of(app, pilot, DashboardScreen)
        app.deliver_screenshot(filename="shot.svg")
        # Textual creates the file, then writes it: under load a read can fall in between.
        await wait_for(lambda: "</svg>" in _text_or_empty(work / "shot.svg"), pilot)
    assert (work / "shot.svg").read_text().lstrip().startswith("<svg")
    assert not (home / "Downloads").exists()


def test_version_flag_prints_the_installed_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.main", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nnui ") and done.stdout.split()[1][0].isdigit()
