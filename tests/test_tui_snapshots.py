"""SVG snapshot tests (pytest-textual-snapshot) on frozen run folders: ended jobs only, a
fixed registry, simulated GPUs with no load, so nothing on screen depends on the clock.
Update with `pytest tests/test_tui_snapshots.py --snapshot-update` after a deliberate change.
"""

from __future__ import annotations

from pathlib import Path

from test_tui_fixtures import make_roots, screen_of, tui_app, wait_for, write_frozen_runs

from app.screens.dashboard import DashboardScreen
from app.screens.job_detail import JobDetailScreen
from app.widgets.curves import CurvesPanel
from app.widgets.gpu_panel import GpuCard
from app.widgets.job_table import JobTable

SIZE = (140, 42)


def frozen_app(tmp_path: Path):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    write_frozen_runs(roots, state)
    # Long intervals: the first reads happen at mount; no refresh while the shot is taken.
    return tui_app(roots, state, gpu_interval_s=60, jobs_interval_s=60, procs_interval_s=60)


def _drawn(screen: DashboardScreen) -> bool:
    """Every job has its row and every GPU card its text (what the shot must show)."""
    cards = list(screen.query(GpuCard))
    rows = screen.query_one(JobTable).row_count
    return rows == 3 and len(cards) == 2 and all(c._last_text for c in cards)


def loaded(app):
    async def run_before(pilot) -> None:
        await wait_for(lambda: len(app.views) == 3 and app.snapshot is not None, pilot)
        screen = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: _drawn(screen), pilot)

    return run_before


def test_dashboard_snapshot(tmp_path: Path, snap_compare) -> None:
    app = frozen_app(tmp_path)

    async def run_before(pilot) -> None:
        await loaded(app)(pilot)
        await pilot.press("down", "down")
        summary = app.screen.query_one("#job-summary")
        await wait_for(lambda: app.views[2].job.job_id in str(summary.render()), pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_job_detail_overlay_snapshot(tmp_path: Path, snap_compare) -> None:
    app = frozen_app(tmp_path)

    async def run_before(pilot) -> None:
        await loaded(app)(pilot)
        await pilot.press("enter", "o")
        detail = await screen_of(app, pilot, JobDetailScreen)
        curves = detail.query_one(CurvesPanel)
        await wait_for(lambda: detail.overlay and len(curves._key or ()) == 3, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
