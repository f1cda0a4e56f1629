"""GPU panel, as a nvitop user reads it: per GPU one header line (memory and utilisation
as bars with numbers, temperature, fan where there is one, power against its limit, a
utilisation sparkline when there is room), then for a GPU in use a history line
(utilisation and memory over the last minutes) and one line per process (user, pid, GPU
memory, %CPU, host RSS, elapsed time, command). The host line (CPU %, RAM, load) is the
panel's title. Lines never wrap: they are cut to the panel's width, parts the width has no
room for are left out, and when the height has no room for every line the panel turns
compact (one line per GPU, as nvitop's). An idle GPU always takes one line. A GPU in MIG
mode shows "MIG: partitioned" and one line per MIG device (each one a slot jobs can be
given, named by its UUID); a lost GPU (NVML_ERROR_GPU_IS_LOST) one red line saying so.

Renders a `MachineSnapshot` and `PanelReadings` it is given; it never polls anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rich.text import Text
from textual.containers import VerticalScroll
from textual.geometry import Region
from textual.widgets import Static

from app.services.jobs.words import human_duration
from app.services.machine.gpu_history import HistorySeries, PanelReadings
from app.services.machine.gpus import GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.machine.host import HostSnapshot, ProcLoad
from app.widgets.formatting import NA, bar, fmt_gib, fmt_or_na, readable_style, short_uuid

HISTORY_POINTS = 24
SPARK_LEVELS = "▁▁▂▃▄▅▆▇█"  # 0 % still draws a baseline
NO_DRIVER_BANNER = "No usable GPU: jobs run on CPU"
SORT_KEYS = ("memory", "user")
MIN_SPARK_CELLS = 8
DEFAULT_WIDTH = 200  # before the panel knows its width


def sparkline(values: Sequence[float | None], width: int = HISTORY_POINTS) -> str:
    """History on a fixed 0-100 % scale (Textual's Sparkline scales to the data's own
    min..max, so a flat 3 % would look like a full bar); a gap where nothing was sampled."""
    shown = list(values)[-width:] if width > 0 else []
    cells = [" " if v is None else SPARK_LEVELS[min(8, max(0, round(v / 100 * 8)))] for v in shown]
    return "".join(cells).rjust(width, " ")


@dataclass(frozen=True)
class CardOptions:
    """How one card is drawn: its width in cells and the panel-wide view toggles."""

    width: int = DEFAULT_WIDTH
    compact: bool = False
    show_commands: bool = False
    sort_by: str = "memory"
    # NO_COLOR: text styles only; each line applies formatting.readable_style where it
    # styles a part (colours would turn into greys of poor contrast: bars, the warning).
    mono: bool = False


@dataclass(frozen=True)
class _HeaderFit:
    bar_cells: int
    name: bool
    uuid: bool
    fan: bool
    power_limit: bool
    procs: bool


# Widest first: the first that fits the width is drawn; the last is cut to the width.
HEADER_FITS = (
    _HeaderFit(12, True, True, True, True, True),
    _HeaderFit(10, True, False, True, True, True),
    _HeaderFit(8, True, False, False, True, True),
    _HeaderFit(8, False, False, False, True, True),
    _HeaderFit(6, False, False, False, False, True),
    _HeaderFit(4, False, False, False, False, False),
)


def _percent(value: float | None) -> str:
    return fmt_or_na(None if value is None else round(value), "{:>3d}%")


def _power(gpu: GpuSnapshot, with_limit: bool) -> str:
    if gpu.power_w is None:
        return "power n/a"
    if with_limit and gpu.power_limit_w:
        return f"{gpu.power_w:.0f}/{gpu.power_limit_w:.0f} W"
    return f"{gpu.power_w:.0f} W"


def _procs_summary(gpu: GpuSnapshot) -> str:
    users = sorted({p.user or "?" for p in gpu.processes})
    mine = any(p.is_mine for p in gpu.processes)
    others = ", ".join(f"{u}(other)" for u in gpu.other_users)
    who = ", ".join(x for x in ("you" if mine else "", others) if x) or ", ".join(users)
    return f"{len(gpu.processes)} proc: {who}"


def header_line(gpu: GpuSnapshot, fit: _HeaderFit, compact: bool, mono: bool = False) -> Text:
    """One GPU's first line for one choice of what fits (`mono`: NO_COLOR styles)."""
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    text = Text()
    text.append(f"GPU {gpu.index} ", style="bold")
    if gpu.lost:
        return _lost_line(text, gpu, mono)
    if fit.name:
        text.append(f"{(gpu.name or NA).removeprefix('NVIDIA ')} ", readable_style("cyan", mono))
    if fit.uuid:
        text.append(f"[{short_uuid(gpu.uuid or '')}] ", style=readable_style("dim", mono))
    text.append(" MEM ", style="bold")
    text.append(bar(gpu.memory_used_fraction, fit.bar_cells), readable_style("magenta", mono))
    text.append(f" {fmt_gib(used)}/{fmt_gib(total)} GiB  ")
    text.append("UTL ", style="bold")
    util = gpu.utilization_percent
    utilization = bar(None if util is None else util / 100, fit.bar_cells)
    text.append(utilization, style=readable_style("green", mono))
    text.append(f" {_percent(util)}  ")
    text.append(
        fmt_or_na(gpu.temperature_c, "{}°C") if gpu.temperature_c is not None else "temp n/a"
    )
    if fit.fan and gpu.fan_percent is not None:
        text.append(f"  fan {gpu.fan_percent}%")
    text.append(f"  {_power(gpu, fit.power_limit)}")
    if gpu.mig_enabled:
        text.append(f"  MIG: partitioned in {len(gpu.mig)}", style=readable_style("cyan", mono))
    elif not gpu.processes:
        text.append("  idle", style=readable_style("dim", mono))
    elif compact and fit.procs:
        warning = readable_style("bold yellow", mono) if gpu.other_users else ""
        text.append(f"  {_procs_summary(gpu)}", style=warning)
    return text


def _lost_line(text: Text, gpu: GpuSnapshot, mono: bool) -> Text:
    name = "" if gpu.name == NA else f"{gpu.name.removeprefix('NVIDIA ')} "
    text.append(f"{name}[{short_uuid(gpu.uuid or '')}] ", style=readable_style("dim", mono))
    text.append(" LOST ", style=readable_style("bold white on red", mono))
    text.append("  NVML: GPU is lost (needs a reset); jobs on it are flagged")
    return text


def mig_line(device: GpuSnapshot, options: CardOptions) -> Text:
    """One MIG device: the slot name jobs are given (its UUID), memory, its processes."""
    text = Text("   ")
    text.append(f"MIG {device.mig_position} ", style="bold")
    text.append(f"{device.uuid} ", style=readable_style("cyan", options.mono))
    used, total = device.memory_used_bytes, device.memory_total_bytes
    text.append(f"MEM {fmt_gib(used)}/{fmt_gib(total)} GiB  ")
    if device.lost:
        text.append("lost with its GPU", style=readable_style("bold red", options.mono))
    elif device.processes:
        warning = readable_style("bold yellow", options.mono) if device.other_users else ""
        text.append(_procs_summary(device), style=warning)
    else:
        text.append("idle", style=readable_style("dim", options.mono))
    text.truncate(options.width, overflow="ellipsis")
    return text


@lru_cache(maxsize=256)  # called for every GPU every second with mostly equal readings
def first_fit(gpu: GpuSnapshot, width: int, compact: bool) -> int:
    """Index of the widest HEADER_FITS entry whose header fits `width` (styles do not
    change a width: the colour one is measured)."""
    for level, fit in enumerate(HEADER_FITS):
        if header_line(gpu, fit, compact).cell_len <= width:
            return level
    return len(HEADER_FITS) - 1


def fitted_header(
    gpu: GpuSnapshot, series: HistorySeries | None, options: CardOptions, level: int | None = None
) -> Text:
    """The header at `level` (default: the widest that fits), with a utilisation sparkline
    in the room left. The panel passes one level for all its GPUs so that columns align."""
    if level is None:
        level = first_fit(gpu, options.width, options.compact)
    text = header_line(gpu, HEADER_FITS[level], options.compact, options.mono)
    room = options.width - text.cell_len - 3
    if series is not None and room >= MIN_SPARK_CELLS:
        text.append("  ")
        spark = sparkline(series.utilization_percent, min(room, HISTORY_POINTS))
        text.append(spark, readable_style("green", options.mono))
    text.truncate(options.width, overflow="ellipsis")
    return text


def history_line(series: HistorySeries | None, width: int, mono: bool = False) -> Text:
    """Utilisation and memory over the last minutes, side by side."""
    text = Text("   ")
    if series is None or not series.utilization_percent:
        return text + Text("history: n/a", style=readable_style("dim", mono))
    cells = max(4, min(len(series.utilization_percent), (width - 32) // 2))
    minutes = cells * series.step_s / 60
    text.append(f"last {minutes:.0f} min ", style=readable_style("dim", mono))
    text.append("UTL ", style="bold")
    text.append(sparkline(series.utilization_percent, cells), readable_style("green", mono))
    text.append("  MEM ", style="bold")
    text.append(sparkline(series.memory_percent, cells), readable_style("magenta", mono))
    text.truncate(width, overflow="ellipsis")
    return text


def sorted_processes(processes: Sequence[GpuProcess], sort_by: str) -> list[GpuProcess]:
    if sort_by == "user":
        return sorted(processes, key=lambda p: (p.user or "", p.pid))
    return sorted(processes, key=lambda p: (-(p.used_memory_bytes or 0), p.pid))


def process_line(proc: GpuProcess, load: ProcLoad | None, options: CardOptions) -> Text:
    who = proc.user or NA
    mark = f"{who} (you)" if proc.is_mine else f"{who} (other user)"
    text = Text("   ")
    text.append(f"pid {proc.pid:<7d} ", style="bold")
    whose = "bold green" if proc.is_mine else "bold yellow"
    text.append(f"{mark:<20s} ", style=readable_style(whose, options.mono))
    memory = NA if proc.used_memory_bytes is None else f"{proc.used_memory_bytes / 2**20:.0f} MiB"
    text.append(f"{memory:>10s}  ")
    cpu = NA if load is None or load.cpu_percent is None else f"{load.cpu_percent:.0f}%"
    rss = NA if load is None or load.rss_bytes is None else f"{fmt_gib(load.rss_bytes)}G"
    elapsed = human_duration(None if load is None else load.elapsed_s)
    text.append(
        f"cpu {cpu:>5s}  rss {rss:>6s}  {elapsed:>6s}  ", readable_style("dim", options.mono)
    )
    command = (load.cmdline if load is not None else None) or proc.name or ""
    if options.show_commands:
        return text + Text(command)  # on demand: the whole command, wrapped if need be
    text.append(command)
    text.truncate(options.width, overflow="ellipsis")
    return text


def gpu_lines(
    gpu: GpuSnapshot,
    series: HistorySeries | None = None,
    loads: dict[int, ProcLoad] | None = None,
    options: CardOptions = CardOptions(),
    level: int | None = None,
) -> Text:
    """The text of one GPU card (a pure function of what it is given, easy to diff)."""
    text = fitted_header(gpu, series, options, level)
    for device in gpu.mig:  # slots: shown even when compact
        text.append("\n")
        text.append_text(mig_line(device, options))
    if not options.compact and gpu.processes and not gpu.lost:
        text.append("\n")
        text.append_text(history_line(series, options.width, options.mono))
        for proc in sorted_processes(gpu.processes, options.sort_by):
            text.append("\n")
            text.append_text(process_line(proc, (loads or {}).get(proc.pid), options))
    return text


def full_lines(gpu: GpuSnapshot) -> int:
    """Lines a card takes when not compact (an idle GPU: one)."""
    return len(gpu.mig) + (1 if not gpu.processes or gpu.lost else 2 + len(gpu.processes))


def host_title(host: HostSnapshot | None) -> str:
    """The panel title: GPUs, then the host line."""
    if host is None:
        return "GPUs"
    cpu = fmt_or_na(host.cpu_percent, "{:.0f}%")
    ram = f"{fmt_gib(host.memory_used_bytes)}/{fmt_gib(host.memory_total_bytes)} GiB"
    load = " ".join(f"{v:.2f}" for v in host.load_avg) if host.load_avg else NA
    return f"GPUs · host CPU {cpu} of {host.num_cpus} · RAM {ram} · load {load}"


class GpuCard(Static):
    """One GPU's lines; redrawn only when their text changes."""

    def __init__(self, index: int) -> None:
        super().__init__(id=f"gpu-{index}", classes="gpu-card")
        self.index = index
        self._last_text: str | None = None
        self.drawn_from: object = None  # the inputs of the text shown (skip equal redraws)

    def show_text(self, text: Text) -> None:
        if text.plain == self._last_text:
            return
        # A card's lines never wrap, so its height is its line count: only a change of that
        # count needs a layout pass (one costs ~0.1 s of CPU for the whole screen, and live
        # readings change every few seconds on every GPU).
        same_height = self._last_text is not None and (
            self._last_text.count("\n") == text.plain.count("\n")
        )
        self._last_text = text.plain
        self.update(text, layout=not same_height)


class GpuPanel(VerticalScroll):
    """All GPUs of the machine, or the no-driver banner with the CPU slots."""

    def __init__(self, cpu_slots: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cpu_slots = cpu_slots
        self.show_commands = False
        self.sort_by = SORT_KEYS[0]
        self.compact = False
        self._banner_text: str | None = None
        self._indices: tuple[int, ...] | None = None
        self._cards: dict[int, GpuCard] = {}  # the cards mounted (or being mounted) now
        self._banner = Static(id="gpu-banner")
        self._latest: tuple[MachineSnapshot, PanelReadings | None] | None = None

    def compose(self) -> Any:
        yield self._banner

    def banner_for(self, snapshot: MachineSnapshot) -> Text:
        text = Text()
        if snapshot.simulated:
            text.append(" SIMULATED ", style="bold black on magenta")
            text.append(f" {len(snapshot.gpus)} simulated GPUs (runs use -device cpu)  ")
        if snapshot.driver_problem:
            text.append(f" {NO_DRIVER_BANNER} ", style="bold black on yellow")
            text.append(f"  CPU slots: {self.cpu_slots}  ", style="bold")
            # The service appends its own "jobs can run on CPU"; the banner already says it.
            text.append(snapshot.driver_problem.split(" — ")[0], style="dim")
        elif not snapshot.gpus:
            text.append(f"No GPUs visible: jobs run on CPU  CPU slots: {self.cpu_slots}")
        elif snapshot.order_note:  # NVML's order is not CUDA's: say which one is shown
            text.append(snapshot.order_note, style="dim")
        return text

    def _options(self, snapshot: MachineSnapshot) -> CardOptions:
        width = self.scrollable_content_region.width or max(20, self.app.size.width - 6)
        # The panel may take half the screen (nnui.tcss), less its border and banner.
        budget = self.app.size.height // 2 - 2 - (1 if self._banner_text else 0)
        self.compact = sum(full_lines(g) for g in snapshot.gpus) > max(1, budget)
        mono = bool(getattr(self.app, "no_color", False))
        return CardOptions(width, self.compact, self.show_commands, self.sort_by, mono)

    def update_snapshot(
        self, snapshot: MachineSnapshot, readings: PanelReadings | None = None
    ) -> None:
        self._latest = (snapshot, readings)
        banner = self.banner_for(snapshot)
        if banner.plain != self._banner_text:
            self._banner_text = banner.plain
            self._banner.update(banner)
            self._banner.display = bool(banner.plain)
        self._show_title(host_title(readings.host if readings else None))
        indices = tuple(gpu.index for gpu in snapshot.gpus)
        if indices != self._indices:
            self._indices = indices
            self._cards = {i: GpuCard(i) for i in indices}
            self.call_later(self._replace_cards, list(self._cards.values()))
        self._draw()

    def _show_title(self, title: str) -> None:
        """The host line lives in the top border. Assigning border_title repaints the whole
        panel (every card, and the frame composes the screen below it anew); the host line
        changes every few seconds, so only its border row is repainted (measured: about a
        third of the board's idle CPU with 8 GPUs)."""
        if title == self.border_title:
            return
        top, _right, _bottom, left = self.styles.gutter
        if not self.is_mounted or not top or not hasattr(self, "_border_title"):
            self.border_title = title
            return
        # What Textual's border_title setter stores, without its whole-widget refresh.
        self._border_title = self.render_str(title).expand_tabs(4).split()[0]
        # refresh() regions are relative to the content: the border row is at -top.
        self.refresh(Region(-left, -top, self.outer_size.width, 1))

    async def _replace_cards(self, new: list[GpuCard]) -> None:
        if not self.is_attached:
            return
        await self.remove_children(GpuCard)
        await self.mount_all(new)
        self._draw()

    def _draw(self) -> None:
        if self._latest is None:
            return
        snapshot, readings = self._latest
        options = self._options(snapshot)
        level = max(
            (first_fit(g, options.width, options.compact) for g in snapshot.gpus), default=0
        )
        for gpu in snapshot.gpus:
            card = self._cards.get(gpu.index)
            if card is None:
                continue
            series = readings.history.get(gpu.uuid) if readings else None
            loads = readings.loads if readings else {}
            mine = {p.pid: loads[p.pid] for p in gpu.processes if p.pid in loads}
            inputs = (gpu, series, tuple(mine.values()), options, level)
            if inputs != card.drawn_from:  # readings are frozen values: equal = same text
                card.drawn_from = inputs
                card.show_text(gpu_lines(gpu, series, mine, options, level))

    def on_resize(self) -> None:
        self._draw()

    def toggle_commands(self) -> None:
        self.show_commands = not self.show_commands
        self._draw()

    def cycle_sort(self) -> str:
        self.sort_by = SORT_KEYS[(SORT_KEYS.index(self.sort_by) + 1) % len(SORT_KEYS)]
        self._draw()
        return self.sort_by
