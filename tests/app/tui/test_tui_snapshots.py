"""SVG snapshot tests (pytest-textual-snapshot) on frozen run folders: ended jobs only, a
fixed registry, simulated GPUs with no load, so nothing on screen depends on the clock.
Update with `pytest tests/app/tui/test_tui_snapshots.py --snapshot-update` after a deliberate
change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_fixtures import (
    drawn_lines,
    make_roots,
    screen_of,
    tui_app,
    wait_for,
    write_frozen_runs,
)

from app.screens.dashboard import DashboardScreen
from app.screens.job_detail import JobDetailScreen
from app.services.machine.host import HostSnapshot, ProcLoad
from app.widgets.curves import CurvesPanel
from app.widgets.gpu_panel import GpuCard
from app.widgets.job_table import JobTable

SIZE = (140, 42)


class FixedHost:
    """This machine's CPU, RAM and load change from run to run: a fixed host line."""

    def host(self) -> HostSnapshot:
        return HostSnapshot(12.0, 20 * 2**30, 64 * 2**30, (1.5, 1.2, 0.9), 16)

    def processes(self, pids: list[int]) -> dict[int, ProcLoad]:
        return {}


def frozen_app(tmp_path: Path, num_gpus: int = 2):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    write_frozen_runs(roots, state)
    # Long intervals: the first reads happen at mount; no refresh while the shot is taken.
    app = tui_app(
        roots, state, simulate_gpus=num_gpus,
        gpu_interval_s=60, jobs_interval_s=60, procs_interval_s=60,
    )  # fmt: skip
    app.services.sampler = FixedHost()
    return app


def _drawn(screen: DashboardScreen, num_gpus: int) -> bool:
    """Every job has its row and every GPU card its text (what the shot must show)."""
    cards = list(screen.query(GpuCard))
    rows = screen.query_one(JobTable).row_count
    return rows == 3 and len(cards) == num_gpus and all(c._last_text for c in cards)


def loaded(app, num_gpus: int = 2):
    async def run_before(pilot) -> None:
        await wait_for(lambda: len(app.views) == 3 and app.snapshot is not None, pilot)
        screen = await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: _drawn(screen, num_gpus), pilot)
        # The footer draws its keys a frame later; the shot must show them.
        await wait_for(lambda: "Stop" in drawn_lines(app)[-1], pilot)

    return run_before


@pytest.mark.parametrize(("size", "num_gpus"), [((80, 24), 8), ((200, 60), 4)])
def test_dashboard_sizes_snapshot(tmp_path: Path, snap_compare, size, num_gpus) -> None:
    """The smallest and a large terminal: watched columns kept, GPU lines unwrapped."""
    app = frozen_app(tmp_path, num_gpus)
    assert snap_compare(app, terminal_size=size, run_before=loaded(app, num_gpus))


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
