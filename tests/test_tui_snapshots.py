"""SVG snapshot tests (pytest-textual-snapshot) on frozen run folders: ended jobs only, a
fixed registry, simulated GPUs with no load, so nothing on screen depends on the clock.
Update with `pytest tests/test_tui_snapshots.py --snapshot-update` after a deliberate change.
"""

from __future__ import annotations

from pathlib import Path

from test_tui_fixtures import make_roots, tui_app, wait_for, write_frozen_runs

SIZE = (140, 42)


def frozen_app(tmp_path: Path):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    write_frozen_runs(roots, state)
    # Long intervals: the first reads happen at mount; no refresh while the shot is taken.
    return tui_app(roots, state, gpu_interval_s=60, jobs_interval_s=60, procs_interval_s=60)


def loaded(app):
    async def run_before(pilot) -> None:
        await wait_for(lambda: len(app.views) == 3 and app.snapshot is not None, pilot)
        await pilot.pause(0.2)

    return run_before


def test_dashboard_snapshot(tmp_path: Path, snap_compare) -> None:
    app = frozen_app(tmp_path)
    assert snap_compare(app, terminal_size=SIZE, run_before=loaded(app), press=["down", "down"])


def test_job_detail_overlay_snapshot(tmp_path: Path, snap_compare) -> None:
    app = frozen_app(tmp_path)

    async def run_before(pilot) -> None:
        await loaded(app)(pilot)
        await pilot.press("enter", "o")
        await pilot.pause(0.3)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
