"""GPU panel: one card per GPU (memory bar, utilisation, temperature, power, processes by
user, utilisation sparkline) plus a banner for simulated machines and missing drivers.

Renders a `MachineSnapshot` it is given; it never polls NVML itself.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from app.services.gpus import GpuSnapshot, MachineSnapshot
from app.widgets.formatting import NA, bar, fmt_gib, fmt_mib, fmt_or_na, short_uuid

HISTORY_POINTS = 24
SPARK_LEVELS = "▁▁▂▃▄▅▆▇█"  # 0 % still draws a baseline
NO_DRIVER_BANNER = "No usable GPU: jobs run on CPU"


def sparkline(values: list[float], width: int = HISTORY_POINTS) -> str:
    """Utilisation history on a fixed 0-100 % scale. (Textual's Sparkline scales to the
    data's own min..max, so a flat 3 % would look like a full bar.)"""
    shown = values[-width:]
    cells = [SPARK_LEVELS[min(8, max(0, round(v / 100 * 8)))] for v in shown]
    return "".join(cells).rjust(width, " ")


def gpu_lines(gpu: GpuSnapshot) -> Text:
    """The text of one GPU card (a pure function of the snapshot, so it is easy to diff)."""
    used, total = gpu.memory_used_bytes, gpu.memory_total_bytes
    fraction = used / total if used is not None and total else None
    text = Text()
    text.append(f"GPU {gpu.index} ", style="bold")
    text.append(f"{gpu.name or NA} ", style="cyan")
    text.append(f"[{short_uuid(gpu.uuid or '')}]  ", style="dim")
    text.append(f"mem {bar(fraction, 12)} {fmt_gib(used)}/{fmt_gib(total)} GiB  ")
    text.append(f"util {fmt_or_na(gpu.utilization_percent, '{:>3d}%')}  ")
    text.append(f"{fmt_or_na(gpu.temperature_c, '{}°C')}  ")
    text.append(fmt_or_na(gpu.power_w, "{:.0f} W"))
    if not gpu.processes:
        text.append("\n   no processes", style="dim")
    for proc in gpu.processes:
        who = proc.user or NA
        if proc.is_mine:
            style, mark = "bold green", f"{who} (you)"
        else:
            style, mark = "bold yellow", f"{who} (other user)"
        text.append("\n   ")
        text.append(f"pid {proc.pid:<7d} {mark:<22s} ", style=style)
        text.append(f"{fmt_mib(proc.used_memory_bytes):>10s}  {proc.name or ''}", style="dim")
    return text


class GpuCard(Horizontal):
    """One GPU: its text on the left, a utilisation sparkline on the right."""

    def __init__(self, index: int) -> None:
        super().__init__(id=f"gpu-{index}", classes="gpu-card")
        self.index = index
        self._last_text: str | None = None
        self._last_spark: str | None = None
        self._latest: tuple[GpuSnapshot, list[float]] | None = (
            None  # kept until the card is composed
        )
        self._composed = False

    def compose(self) -> ComposeResult:
        yield Static(classes="gpu-text")
        yield Static(classes="gpu-spark")

    def on_mount(self) -> None:
        # Children exist from here on; a reading that came earlier is drawn now.
        self._composed = True
        if self._latest is not None:
            self.show(*self._latest)

    def show(self, gpu: GpuSnapshot, history: list[float]) -> None:
        """Draw this reading, now or once the card's own widgets are mounted (a busy machine
        can deliver a reading between the card's mount and its compose)."""
        self._latest = (gpu, history)
        if not self._composed:
            return
        text = gpu_lines(gpu)
        if text.plain != self._last_text:
            self._last_text = text.plain
            self.query_one(".gpu-text", Static).update(text)
        spark = sparkline(history)
        if spark != self._last_spark:
            self._last_spark = spark
            self.query_one(".gpu-spark", Static).update(Text(spark, style="green"))


class GpuPanel(Vertical):
    """All GPUs of the machine, or the no-driver banner with the CPU slots."""

    def __init__(self, cpu_slots: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cpu_slots = cpu_slots
        self._history: dict[int, deque[float]] = {}
        self._banner_text: str | None = None
        self._indices: tuple[int, ...] | None = None
        self._cards: dict[int, GpuCard] = {}  # the cards mounted (or being mounted) now
        self._banner = Static(id="gpu-banner")
        self._cards_box = Vertical(id="gpu-cards")

    def compose(self) -> ComposeResult:
        yield self._banner
        yield self._cards_box

    async def _replace_cards(self, new: list[GpuCard]) -> None:
        # The old cards (same ids) must be gone before the new ones mount.
        if not self.is_attached:
            return
        await self._cards_box.remove_children()
        await self._cards_box.mount_all(new)

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
        return text

    def update_snapshot(self, snapshot: MachineSnapshot) -> None:
        banner = self.banner_for(snapshot)
        if banner.plain != self._banner_text:
            self._banner_text = banner.plain
            self._banner.update(banner)
            self._banner.display = bool(banner.plain)
        indices = tuple(gpu.index for gpu in snapshot.gpus)
        if indices != self._indices:
            self._indices = indices
            self._cards = {i: GpuCard(i) for i in indices}
            self.call_later(self._replace_cards, list(self._cards.values()))
        # The cards draw what they are given once they are composed (GpuCard.show).
        for gpu in snapshot.gpus:
            history = self._history.setdefault(gpu.index, deque(maxlen=HISTORY_POINTS))
            history.append(float(gpu.utilization_percent or 0))
            card = self._cards.get(gpu.index)
            if card is not None:
                card.show(gpu, list(history))
