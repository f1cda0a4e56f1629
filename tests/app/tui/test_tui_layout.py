"""Every terminal size, colour and the GPU panel (issue 14, items 3, 4 and 6).

Pilot tests at 80x24 .. 200x60 with 1, 4 and 8 simulated GPUs assert which job columns
show, that GPU lines never wrap and that the footer keeps the keys that matter; the colour
tests render through Textual's own filters (NO_COLOR turns colours into greys) and measure
contrast; the GPU panel's parts are pure functions checked as tables.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import pytest
from rich.color import Color, ColorSystem
from test_tui_widgets import Gpu, View
from tui_fixtures import (
    Drawn,
    drawn_cells,
    drawn_lines,
    drawn_runs,
    make_roots,
    screen_of,
    tui_app,
    wait_for,
    write_frozen_runs,
)

from app.screens.dashboard import DashboardScreen
from app.screens.job_summary import summary_text
from app.services.machine.gpu_history import GpuHistory, HistorySeries
from app.services.machine.gpus import SIMULATED_BUSY_ENV, GpuProcess, MachineSnapshot
from app.services.machine.host import HostSnapshot, LoadSampler, ProcLoad
from app.widgets.formatting import readable_style
from app.widgets.gpu_panel import (
    CardOptions,
    GpuCard,
    GpuPanel,
    gpu_lines,
    host_title,
    sorted_processes,
)
from app.widgets.job_cells import (
    COLUMNS,
    DARK_STATE_STYLES,
    LAYOUTS,
    LIGHT_STATE_STYLES,
    choose_layout,
    row_cells,
)
from app.widgets.job_table import JobTable
from trainer.schema.status import State

WATCHED = {"job", "state", "epoch", "dice", "eta", "alerts"}
IDENTITY = {"dataset", "fold"}  # dataset and configuration share the dataset cell
ALL_COLUMNS = {key for key, _ in COLUMNS}


class FixedSampler:
    """A host with fixed readings (so shots do not depend on this machine's load)."""

    def host(self) -> HostSnapshot:
        return HostSnapshot(12.0, 20 * 2**30, 64 * 2**30, (1.5, 1.2, 0.9), 16)

    def processes(self, pids: list[int]) -> dict[int, ProcLoad]:
        return {
            pid: ProcLoad(pid, 97.0, 3 * 2**30, 3725.0, f"python train.py {pid}") for pid in pids
        }


def frozen(tmp_path, num_gpus: int, **config):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    write_frozen_runs(roots, state)
    app = tui_app(
        roots, state, simulate_gpus=num_gpus, gpu_interval_s=60, jobs_interval_s=60,
        procs_interval_s=60, **config,
    )  # fmt: skip
    app.services.sampler = FixedSampler()
    return app


async def drawn(app, pilot, num_gpus: int) -> DashboardScreen:
    screen = await screen_of(app, pilot, DashboardScreen)
    await wait_for(lambda: len(app.views) == 3 and app.snapshot is not None, pilot)
    table = screen.query_one(JobTable)
    await wait_for(
        lambda: (
            table.row_count == 3
            and len(cards := list(screen.query(GpuCard))) == num_gpus
            and all(c._last_text for c in cards)
        ),
        pilot,
    )
    await pilot.pause(0)
    return screen


SIZES = [((80, 24), 1), ((80, 24), 4), ((80, 24), 8), ((100, 30), 4), ((120, 40), 8),
         ((200, 60), 1), ((200, 60), 4), ((200, 60), 8)]  # fmt: skip


@pytest.mark.parametrize(("size", "num_gpus"), SIZES, ids=[f"{s[0]}x{s[1]}-{n}" for s, n in SIZES])
async def test_every_size_keeps_the_watched_columns(tmp_path, size, num_gpus) -> None:
    app = frozen(tmp_path, num_gpus)
    async with app.run_test(size=size) as pilot:
        screen = await drawn(app, pilot, num_gpus)
        table = screen.query_one(JobTable)
        shown = set(table.columns_shown)
        assert shown >= WATCHED | IDENTITY  # decorations go first, identity never
        assert {str(c.key.value) for c in table.columns.values()} == shown
        assert table.fixed_columns == 2  # the selection mark and the job id stay put
        if size[0] >= 200:
            assert shown == ALL_COLUMNS
        if size[0] <= 80:
            assert not {"train", "val", "ema", "wait"} & shown
        # GPU cards never wrap: every line fits the panel, an idle GPU takes one line.
        panel = screen.query_one(GpuPanel)
        for card in screen.query(GpuCard):
            assert card.size.height == len(card._last_text.splitlines()) == 1
            assert max(len(line) for line in card._last_text.splitlines()) <= card.size.width
        assert panel.region.bottom <= screen.query_one(JobTable).region.y
        assert table.region.height >= 5  # header + rows, not squeezed out by the panel

        def footer() -> str:  # the bottom line as drawn
            return drawn_lines(app)[-1]

        await wait_for(lambda: "Stop" in footer(), pilot)
        for word in ("Launch", "Resume", "Kill", "Help", "Quit"):
            assert word in footer()


async def test_a_resize_switches_layout_and_keeps_the_cursor(tmp_path) -> None:
    app = frozen(tmp_path, 2)
    async with app.run_test(size=(200, 40)) as pilot:
        screen = await drawn(app, pilot, 2)
        table = screen.query_one(JobTable)
        await pilot.press("down")
        chosen = table.current_job_id
        await pilot.resize_terminal(80, 24)
        await wait_for(lambda: "train" not in table.columns_shown, pilot)
        assert table.current_job_id == chosen
        await pilot.resize_terminal(200, 40)
        await wait_for(lambda: set(table.columns_shown) == ALL_COLUMNS, pilot)
        assert table.current_job_id == chosen
        for text in ("20260101-000001-f1", "failed (exit 3)", "004_Demo 3d_fullres"):
            state_segment(app, text)  # whole cells after the rebuild, not cut to their labels


def test_choose_layout_drops_the_least_watched_first() -> None:
    full = [{k: getattr(v, "plain", v) for k, v in row_cells(View(), False).items()}]
    short = [{k: getattr(v, "plain", v) for k, v in row_cells(View(), False, short=True).items()}]
    assert choose_layout(full, short, 500) == 0
    assert choose_layout(full, short, 10) == len(LAYOUTS) - 1  # the narrowest: scrolls sideways
    assert short[0]["epoch"] == "5/10"  # abbreviated: the bar goes first


def test_eta_and_the_alerts_header_are_whole_at_80_columns() -> None:
    """A running job with a long state, a 4-digit epoch, an ETA of hours and an alert: at 80
    columns (78 cells inside the border) every watched column up to ETA and the alerts header
    fit; only the alert's text may run past the edge."""
    from app.widgets.job_cells import LAYOUTS, layout_width

    view = View(state="stopping", epoch=999, num_epochs=1000, eta_s=7800,
                alerts=("no event for 12 min",))  # fmt: skip
    kinds = [[{k: getattr(v, "plain", v) for k, v in row_cells(view, False, **flags).items()}]
             for flags in ({}, {"short": True}, {"compact": True})]  # fmt: skip
    level = choose_layout(kinds[0], kinds[1], 78, kinds[2])
    hidden, cells = LAYOUTS[level]
    rows = [{**kinds[cells][0], "alerts": "alerts"}]
    assert layout_width(rows, hidden) <= 78, (level, rows)
    assert not IDENTITY & hidden and rows[0]["dataset"] == "004 3d_fullres"


def test_identity_stays_and_decorations_go_first() -> None:
    """No layout hides dataset/configuration or fold; at 120 columns a row in its final
    validation (`validating 0/4 cases`) keeps them beside the watched columns."""
    from app.widgets.job_cells import LAYOUTS

    assert all(not IDENTITY & hidden for hidden, _ in LAYOUTS)
    view = View(state="validating", epoch=1000, num_epochs=1000, eta_s=240)
    view.validation_done, view.validation_cases = 0, 4  # type: ignore[attr-defined]
    kinds = [[{k: getattr(v, "plain", v) for k, v in row_cells(view, False, **flags).items()}]
             for flags in ({}, {"short": True}, {"compact": True})]  # fmt: skip
    assert kinds[0][0]["state"] == "validating 0/4 cases"
    level = choose_layout(kinds[0], kinds[1], 118, kinds[2])
    hidden, cells = LAYOUTS[level]
    assert kinds[cells][0]["dataset"] == "004_Hippocampus 3d_fullres"  # whole, not compact
    assert not (WATCHED | IDENTITY) & hidden


# ---- colour ------------------------------------------------------------------------------


def _luminance(color: Color) -> float:
    r, g, b = (c / 255 for c in color.get_truecolor())
    lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def contrast(a: Color, b: Color) -> float:
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def state_segment(app, text: str) -> Drawn:
    """The run showing `text` as the terminal shows it (Textual's filters applied, colours
    after reverse)."""
    for run in drawn_runs(app):
        if text in run.text:
            return run
    raise AssertionError(f"{text!r} not on screen: " + "\n".join(drawn_lines(app)))


@pytest.mark.parametrize("theme", ["dark", "light"])
async def test_no_color_keeps_states_readable(tmp_path, monkeypatch, theme) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    app = frozen(tmp_path, 1, theme=theme)
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await drawn(app, pilot, 1)
        assert screen.query_one(JobTable).palette == "mono"
        for text in ("failed (exit 3)", "finished", "stopped"):
            segment = state_segment(app, text)
            fg, bg = segment.fg, segment.bg
            assert contrast(fg, bg) >= 4.5, (text, fg, bg)
        failed = state_segment(app, "failed (exit 3)")
        assert failed.bold  # cues beyond colour: bold, and reverse (its row's colours swapped)
        before = max((r for r in drawn_runs(app) if r.y == failed.y and r.x < failed.x),
                     key=lambda r: r.x)  # fmt: skip
        assert (failed.fg, failed.bg) == (before.bg, before.fg), (failed, before)


@pytest.mark.parametrize("theme", ["dark", "light"])
async def test_no_color_keeps_the_failure_summary_readable(tmp_path, monkeypatch, theme) -> None:
    """The summary of a failed job (its state with the exit code, its console's last lines)
    at full contrast under NO_COLOR: no red turned near-black, no dim turned grey."""
    monkeypatch.setenv("NO_COLOR", "1")
    app = frozen(tmp_path, 1, theme=theme)
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await drawn(app, pilot, 1)
        summary = screen.query_one("#job-summary")
        table = screen.query_one(JobTable)
        for _ in range(table.row_count):  # down to the failed job
            if app.view_of(table.current_job_id).state == "failed":
                break
            await pilot.press("down")
        await wait_for(lambda: "Traceback" in " ".join(_texts(app, summary)), pilot)
        segments = _segments(app, summary)
        assert any("failed (exit 3)" in s.text for s in segments)
        for segment in segments:
            fg, bg = segment.fg, segment.bg
            assert contrast(fg, bg) >= 4.5, (segment.text, fg, bg)


@pytest.mark.parametrize("theme", ["dark", "light"])
async def test_no_color_keeps_the_gpu_panel_readable(tmp_path, monkeypatch, theme) -> None:
    """Bars, sparklines, names and another user's process at full contrast under NO_COLOR
    (magenta and green bars were greys of contrast 2-3, the other-user warning near-white
    on the light theme)."""
    monkeypatch.setenv("NO_COLOR", "1")
    busy = tmp_path / "busy.json"
    busy.write_text(json.dumps({"1": [{"pid": 4411, "user": "bob", "used_gib": 30}]}))
    monkeypatch.setenv(SIMULATED_BUSY_ENV, str(busy))
    app = frozen(tmp_path, 2, theme=theme)
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await drawn(app, pilot, 2)
        app.poll_machine()
        cards = list(screen.query(GpuCard))
        await wait_for(lambda: any("bob" in " ".join(_texts(app, c)) for c in cards), pilot)
        for card in cards:
            for segment in _segments(app, card):
                fg, bg = segment.fg, segment.bg
                assert contrast(fg, bg) >= 4.5, (segment.text, fg, bg)


def _segments(app, widget) -> list[Drawn]:
    """The non-blank runs of text inside `widget` as the terminal shows them."""
    region = widget.region
    return [r for r in drawn_runs(app) if region.contains(r.x, r.y)]


def _texts(app, widget) -> list[str]:
    return [s.text for s in _segments(app, widget)]


def test_no_color_summary_styles_carry_no_colour_or_dim() -> None:
    """Every span of the summary under NO_COLOR is text style only; the exit code and the
    alerts stand out as bold reverse (what a red "failed" is in the mono table)."""
    tail = ("Traceback (most recent call last):", "RuntimeError: boom")
    view = View(state="lost", exit_code=137, alerts=("stalled 300 s",), console_tail=tail)
    view.job = replace(view.job, queued_stop=True)
    text = summary_text(view, mono=True)
    words = {w for span in text.spans for w in str(span.style).split()}
    assert words <= {"bold", "italic", "reverse"}, words
    for part in ("exit code 137", "⚠ stalled 300 s"):
        start = text.plain.index(part)
        styles = {str(s.style) for s in text.spans if s.start <= start < s.end}
        assert styles == {"bold reverse"}, (part, styles)
    colour = summary_text(view)  # the colour themes keep their colours
    assert any("red" in str(span.style) for span in colour.spans)


@pytest.mark.parametrize(
    ("style", "mono"),
    [("bold red", "bold reverse"), ("red", ""), ("dim", "italic"), ("bold cyan", "bold"),
     ("bold yellow", "bold"), ("green", ""), ("bold reverse", "bold reverse"), ("", "")],
)  # fmt: skip
def test_readable_style_keeps_only_text_style_under_no_color(style, mono) -> None:
    assert readable_style(style, True) == mono
    assert readable_style(style, False) == style


async def test_light_theme_by_flag_and_key(tmp_path) -> None:
    app = frozen(tmp_path, 1, theme="light")
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await drawn(app, pilot, 1)
        table = screen.query_one(JobTable)
        assert app.theme == "textual-light" and table.palette == "light"
        for text in ("failed (exit 3)", "finished", "stopped"):
            run = state_segment(app, text)
            assert contrast(run.fg, run.bg) >= 4.5, (text, run.fg, run.bg)
        await pilot.press("t")
        await wait_for(lambda: table.palette == "dark", pilot)
        run = state_segment(app, "failed (exit 3)")
        assert app.theme == "textual-dark" and contrast(run.fg, run.bg) >= 3.0


@pytest.mark.parametrize("system", [ColorSystem.STANDARD, ColorSystem.EIGHT_BIT])
@pytest.mark.parametrize("palette", [DARK_STATE_STYLES, LIGHT_STATE_STYLES])
def test_state_colours_survive_fewer_colours(palette, system) -> None:
    """TERM=xterm (16 colours) and 256 colours: the states that matter stay apart."""
    from rich.style import Style

    colours = {}
    for state in (State.RUNNING, State.FAILED, State.STOPPED, State.FINISHED, State.QUEUED):
        color = Style.parse(palette[state]).color
        colours[state] = color.downgrade(system).number
    assert len(set(colours.values())) == len(colours), colours


def _row_text(app, table: JobTable, job_id: str) -> str:
    """The row of `job_id` as the terminal shows it."""
    region = table.content_region
    y = region.y + 1 + table.get_row_index(job_id)  # under the header row
    return "".join(drawn_cells(app)[y][region.x : region.right])


async def test_a_changed_cell_shows_with_only_its_row_repainted(tmp_path) -> None:
    """A loss changing at the same width repaints its row only (not the whole table); a
    cell that gets wider than its column's widest repaints the table (the column moves); one
    that grows within the column's width repaints its row; all show on screen."""
    app = frozen(tmp_path, 1)
    async with app.run_test(size=(200, 40)) as pilot:
        screen = await drawn(app, pilot, 1)
        table = screen.query_one(JobTable)
        views = list(table._views.values())
        target = next(v for v in views if v.train_loss is not None)
        job_id = target.job.job_id
        before = table.get_cell(job_id, "train")
        changed = replace(target, train_loss=0.1234)
        assert len(str(before)) == len("0.1234")
        table.show([changed if v is target else v for v in views])
        assert table.num_row_repaints == 1
        await wait_for(lambda: "0.1234" in _row_text(app, table, job_id), pilot)
        wider = replace(changed, epoch=(changed.epoch or 0) + 1000)
        table.show([wider if v is target else v for v in views])
        assert table.num_row_repaints == 1  # the epoch cell grew: the whole table
        epoch = f"{wider.epoch}/{wider.num_epochs}"
        await wait_for(lambda: epoch in _row_text(app, table, job_id), pilot)
        assert "0.1234" in _row_text(app, table, job_id)
        # Another row's epoch grows but stays narrower than the column's widest cell (the
        # one above): no column can move, so its row alone is repainted.
        other = next(v for v in views if v is not target and v.epoch is not None)
        longer = replace(other, epoch=other.epoch + 10)
        table.show([wider if v is target else longer if v is other else v for v in views])
        assert table.num_row_repaints == 2
        shown = f"{longer.epoch}/{longer.num_epochs}"
        await wait_for(lambda: shown in _row_text(app, table, other.job.job_id), pilot)


async def test_a_reading_of_the_very_same_views_draws_nothing(tmp_path) -> None:
    """The tracker hands an unchanged job the very same view: a reading made only of those
    never reaches the screens (a lab's board re-reads hundreds of ended runs each second);
    a reading with one changed view does."""
    from app.tui import JobsRead

    app = frozen(tmp_path, 1)
    async with app.run_test(size=(160, 40)) as pilot:
        screen = await drawn(app, pilot, 1)
        shown: list[list] = []
        draw = screen.show_jobs
        screen.show_jobs = lambda views, eta: (shown.append(views), draw(views, eta))
        same, count = list(app.views), app.num_jobs_messages
        app.post_message(JobsRead(same, app.cv_eta_s, app.first_step, app.problems))
        await wait_for(lambda: app.num_jobs_messages == count + 1, pilot)
        assert shown == []
        target = next(v for v in same if v.train_loss is not None)
        changed = [replace(v, train_loss=0.4321) if v is target else v for v in same]
        app.post_message(JobsRead(changed, app.cv_eta_s, app.first_step, app.problems))
        await wait_for(lambda: app.num_jobs_messages == count + 2, pilot)
        assert shown == [changed]
        await wait_for(lambda: "0.4321" in _row_text(app, screen.query_one(JobTable),
                                                      target.job.job_id), pilot)  # fmt: skip


# ---- GPU panel -------------------------------------------------------------------------

MINE = GpuProcess(11, "alice", 2 * 2**30, "python", True)
BOB = GpuProcess(22, "bob", 6 * 2**30, None, False)
SERIES = HistorySeries(5.0, (None, 10.0, 50.0, 100.0), (None, 20.0, 20.0, 30.0))


@pytest.mark.parametrize("width", [60, 80, 100, 140, 200])
@pytest.mark.parametrize("compact", [False, True])
def test_gpu_lines_never_exceed_the_width(width, compact) -> None:
    gpu = Gpu(processes=(MINE, BOB), fan_percent=41, power_limit_w=700.0)
    loads = FixedSampler().processes([11, 22])
    text = gpu_lines(gpu, SERIES, loads, CardOptions(width, compact))
    lines = text.plain.splitlines()
    assert all(len(line) <= width for line in lines)
    assert len(lines) == (1 if compact else 4)
    assert "MEM" in lines[0] and "UTL" in lines[0] and "87%" in lines[0]


def test_gpu_card_shows_what_a_nvitop_user_reads() -> None:
    gpu = Gpu(processes=(MINE, BOB), fan_percent=41, power_limit_w=700.0)
    loads = {11: ProcLoad(11, 97.0, 3 * 2**30, 3725.0, "python -m trainer Dataset004 3d 0")}
    header, history, *procs = gpu_lines(gpu, SERIES, loads, CardOptions(200)).plain.splitlines()
    for part in ("GPU 0", "H100", "[8f3a1c2d]", "40.0/80.0 GiB", "87%", "61°C", "fan 41%",
                 "312/700 W", "█"):  # fmt: skip
        assert part in header, part
    assert "UTL" in history and "MEM" in history and "█" in history
    assert procs[0].split()[:3] == ["pid", "22", "bob"]  # sorted by GPU memory
    for part in ("pid 11", "alice (you)", "2048 MiB", "cpu   97%", "rss   3.0G", "1 h 2 min",
                 "python -m trainer"):  # fmt: skip
        assert part in procs[1], part
    assert "n/a" in procs[0]  # bob's host side is not readable: n/a, not a crash
    by_user = sorted_processes(gpu.processes, "user")
    assert [p.user for p in by_user] == ["alice", "bob"]


@pytest.mark.parametrize("compact", [False, True])
def test_no_color_gpu_lines_carry_text_styles_only(compact) -> None:
    """Under NO_COLOR every part is styled where it is built (formatting.readable_style):
    no colour or dim is left on any span, and the text is the colour one's."""
    gpu = Gpu(processes=(MINE, BOB), fan_percent=41, power_limit_w=700.0)
    loads = FixedSampler().processes([11, 22])
    mono = gpu_lines(gpu, SERIES, loads, CardOptions(200, compact, mono=True))
    words = {w for span in mono.spans for w in str(span.style).split()}
    assert words <= {"bold", "italic", "reverse"}, words
    assert "italic" in words  # the dim parts (uuid, the host side) keep a cue
    colour = gpu_lines(gpu, SERIES, loads, CardOptions(200, compact))
    assert mono.plain == colour.plain
    assert any("green" in str(span.style) for span in colour.spans)


def test_idle_gpu_takes_one_line_and_fan_only_where_present() -> None:
    text = gpu_lines(Gpu(processes=(), fan_percent=None), SERIES).plain
    assert "\n" not in text and "idle" in text and "fan" not in text


def test_full_command_on_demand() -> None:
    command = "python -m trainer " + " ".join(f"--flag{i} value" for i in range(30))
    gpu = Gpu(processes=(MINE,))
    loads = {11: ProcLoad(11, 1.0, 2**30, 5.0, command)}
    cut = gpu_lines(gpu, None, loads, CardOptions(100)).plain
    full = gpu_lines(gpu, None, loads, CardOptions(100, show_commands=True)).plain
    assert command not in cut and command in full


def test_host_title() -> None:
    title = host_title(FixedSampler().host())
    assert title == "GPUs · host CPU 12% of 16 · RAM 20.0/64.0 GiB · load 1.50 1.20 0.90"
    assert host_title(None) == "GPUs"


async def test_a_new_host_line_reaches_the_screen(tmp_path) -> None:
    """The host line repaints only the panel's border row: that row must show it."""
    app = frozen(tmp_path, 2)
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await drawn(app, pilot, 2)
        panel = screen.query_one(GpuPanel)
        assert "host CPU 12% of 16" in panel.border_title
        busy = HostSnapshot(77.0, 30 * 2**30, 64 * 2**30, (3.25, 1.2, 0.9), 16)
        panel.update_snapshot(app.snapshot, replace(app.readings, host=busy))
        await wait_for(lambda: "77%" in app.export_screenshot(), pilot)
        shot = app.export_screenshot()
        assert "3.25" in shot and "12%" not in shot
        assert panel.border_title == host_title(busy)


async def test_panel_keys_toggle_commands_and_sort(tmp_path) -> None:
    app = frozen(tmp_path, 1, readonly=True)  # view keys exist in read-only mode too
    async with app.run_test(size=(120, 30)) as pilot:
        screen = await drawn(app, pilot, 1)
        panel = screen.query_one(GpuPanel)
        await pilot.press("c", "u")
        assert panel.show_commands and panel.sort_by == "user"


def test_load_sampler_reads_this_process() -> None:
    sampler = LoadSampler()
    sampler.processes([os.getpid()])
    load = sampler.processes([os.getpid(), 2**22 + 12345])  # the second pid does not exist
    mine = load[os.getpid()]
    assert list(load) == [os.getpid()]
    assert mine.rss_bytes and mine.rss_bytes > 0 and mine.elapsed_s and mine.elapsed_s > 0
    assert "python" in (mine.cmdline or "") and mine.cpu_percent is not None
    host = sampler.host()
    assert host.memory_total_bytes and host.num_cpus >= 1 and host.load_avg is not None


# ---- history across restarts -----------------------------------------------------------


def _machine(t: float, util: int) -> MachineSnapshot:
    return MachineSnapshot((Gpu(utilization_percent=util),), False, None, t)


def test_history_keeps_the_peak_per_step_and_survives_a_restart(tmp_path) -> None:
    t0 = 1_780_000_000.0
    history = GpuHistory(tmp_path, step_s=5, span_s=60)
    for i, util in enumerate([10, 90, 30, 40]):
        history.add(_machine(t0 + i * 2, util))
    history.save(t0 + 8)
    again = GpuHistory(tmp_path, step_s=5, span_s=60)
    again.load()
    uuid = Gpu().uuid
    series = again.series(uuid, t0 + 8)
    assert series.utilization_percent[-2:] == history.series(uuid, t0 + 8).utilization_percent[-2:]
    assert [v for v in series.utilization_percent if v is not None] == [90.0, 40.0]
    assert series.memory_percent[-1] == 50.0
    assert len(series.utilization_percent) == 12
    old = again.series(uuid, t0 + 3600)  # an hour later: nothing left in the window
    assert set(old.utilization_percent) == {None}


def test_a_series_is_built_again_only_when_it_changes() -> None:
    """The panel asks for every GPU's series every second: the same series comes back
    while no peak rose and no step began; a higher reading or a new step shows at once."""
    t0 = 1_780_000_000.0  # a step boundary (step_s 5)
    history, uuid = GpuHistory(None, step_s=5, span_s=60), Gpu().uuid
    history.add(_machine(t0, 40))
    first = history.series(uuid, t0)
    history.add(_machine(t0 + 1, 30))  # lower than the step's peak: nothing to show
    assert history.series(uuid, t0 + 1) is first
    history.add(_machine(t0 + 2, 70))  # a new peak
    risen = history.series(uuid, t0 + 2)
    assert risen.utilization_percent[-1] == 70.0 and first.utilization_percent[-1] == 40.0
    history.add(_machine(t0 + 5, 10))  # the next step: the window moves on
    moved = history.series(uuid, t0 + 5)
    assert moved.utilization_percent[-2:] == (70.0, 10.0)
    assert history.series(uuid, t0 + 11).utilization_percent[-3:] == (70.0, 10.0, None)


@pytest.mark.parametrize("content", ["{not json", '{"gpus": 3}', '{"gpus": {"x": [[1]]}}'])
def test_a_bad_history_cache_is_ignored(tmp_path, content) -> None:
    (tmp_path / "gpu_history.json").write_text(content)
    history = GpuHistory(tmp_path)
    history.load()
    assert set(history.series(Gpu().uuid, time.time()).utilization_percent) == {None}


async def test_the_app_keeps_gpu_history_across_restarts(tmp_path) -> None:
    cache = tmp_path / "cache"
    app = frozen(tmp_path, 1, cache_dir=cache)
    async with app.run_test(size=(120, 30)) as pilot:
        await drawn(app, pilot, 1)
    assert (cache / "gpu_history.json").exists()
    uuid = app.snapshot.gpus[0].uuid
    second = tui_app(app.config.roots, app.config.state_dir, simulate_gpus=1, cache_dir=cache)
    async with second.run_test(size=(120, 30)) as pilot:
        await wait_for(lambda: second.readings is not None, pilot)
        values = [v for v in second.readings.history[uuid].utilization_percent if v is not None]
        assert values  # what the first run sampled is there from the first frame


def test_nvml_static_fields_are_read_once(monkeypatch) -> None:
    from test_gpus import FakeNvml

    import app.services.machine.gpus as gpus

    calls: dict[str, int] = {}

    class Counting(FakeNvml):
        def nvmlDeviceGetName(self, handle):
            calls["name"] = calls.get("name", 0) + 1
            return super().nvmlDeviceGetName(handle)

        def nvmlDeviceGetEnforcedPowerLimit(self, handle):
            calls["limit"] = calls.get("limit", 0) + 1
            return 700_000

        def nvmlDeviceGetFanSpeed(self, handle):
            calls["fan"] = calls.get("fan", 0) + 1
            if handle == 1:
                raise gpus_error(3)  # NOT_SUPPORTED: a passively cooled GPU
            return 37

    import pynvml

    gpus_error = pynvml.NVMLError
    monitor = gpus.GpuMonitor(backend=Counting(), visible_devices=None)
    first = monitor.snapshot()
    for _ in range(4):
        last = monitor.snapshot()
    assert calls["name"] == 2 and calls["limit"] == 2  # once per GPU, not every second
    assert calls["fan"] == 2 + 5  # once each for the static fields; GPU 1 (no fan) never again
    assert [g.fan_percent for g in last.gpus] == [37, None]
    assert [g.power_limit_w for g in first.gpus] == [700.0, 700.0]
    assert replace(last.gpus[0], processes=()).name == "NVIDIA H100 80GB HBM3"


def test_theme_flag_reaches_the_app() -> None:
    from app.cli.parser import build_parser
    from app.tui import config_from_options

    assert config_from_options(build_parser().parse_args(["--theme", "light"])).theme == "light"
    assert config_from_options(build_parser().parse_args([])).theme == "dark"


@pytest.mark.parametrize(("size", "num_gpus"), [((80, 24), 8), ((80, 24), 1), ((200, 60), 8)])
async def test_fold_board_and_flags_fit_or_scroll_as_a_whole(tmp_path, size, num_gpus) -> None:
    from app.screens.launch import LaunchScreen
    from app.widgets.fold_board import FoldBoard

    app = frozen(tmp_path, num_gpus)
    async with app.run_test(size=size) as pilot:
        await drawn(app, pilot, num_gpus)
        await pilot.press("l")
        launch = await screen_of(app, pilot, LaunchScreen)
        board = launch.query_one(FoldBoard)
        await wait_for(lambda: board.size.width > 0, pilot)
        lines = board.render().plain.splitlines()
        assert len(lines) == 7 and board.size.height >= 7  # header + 6 folds, none wrapped
        assert max(len(line) for line in lines) <= board.size.width
        assert board.region.right <= size[0]
        await pilot.press("f")
        flags = launch.query_one("#flags")
        await wait_for(lambda: flags.has_focus, pilot)
        await pilot.pause(0)
        visible = launch.region
        await wait_for(lambda: visible.contains_region(flags.region), pilot)  # scrolled to it
