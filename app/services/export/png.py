"""The curves of `nnui export` as one PNG, drawn by matplotlib (the optional extra `plot`).

matplotlib is imported inside `render()`, never at module import: the TUI and every other
command start without it (and without the numpy it pulls in). It draws through its Agg
canvas directly (no pyplot, no GUI backend, no global figure state), so it works on a
headless box over SSH. Panels are stacked vertically; each has a title, integer epochs on
x, one colour per series and a legend. The axis ranges are set here, not by matplotlib's
autoscale, so `describe()` (printed by `nnui export` and kept in the PNG's text chunks)
states exactly what the picture shows.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: matplotlib is imported in render()
    from matplotlib.axes import Axes

RGB = tuple[int, int, int]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
Y_PAD = 0.04  # the highest and lowest points stay off the frame
DPI = 100
LINE_WIDTH = 1.6
INSTALL_HINT = "the PNG needs matplotlib: pip install 'nnui[plot]' (make setup installs it)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Series:
    label: str
    colour: RGB
    xs: tuple[float, ...]
    ys: tuple[float, ...]


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]


def data_range(values: Sequence[float]) -> tuple[float, float]:
    """(low, high) of the finite values, widened when flat or empty so it has a size."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    if high - low < 1e-12:
        pad = max(abs(low) * 0.05, 0.5)
        return low - pad, high + pad
    return low, high


def ranges(panel: Panel) -> tuple[tuple[float, float], tuple[float, float]]:
    """The panel's x range (the data's) and y range (the data's, padded by Y_PAD)."""
    low, high = data_range([y for s in panel.series for y in s.ys])
    pad = (high - low) * Y_PAD
    return data_range([x for s in panel.series for x in s.xs]), (low - pad, high + pad)


def hex_colour(colour: RGB) -> str:
    return "#" + "".join(f"{c:02x}" for c in colour)


def describe(panels: Sequence[Panel]) -> list[str]:
    """One line per panel: its title, axis ranges and the legend in drawing order."""
    lines = []
    for panel in panels:
        (x0, x1), (y0, y1) = ranges(panel)
        legend = ", ".join(f"{hex_colour(s.colour)} {s.label}" for s in panel.series)
        lines.append(f"{panel.title}: x (epoch) {x0:g}..{x1:g}, y {y0:.4g}..{y1:.4g}; {legend}")
    return lines


def _draw_panel(axes: Axes, panel: Panel, ticker: ModuleType) -> None:
    for item in panel.series:
        marker = "o" if len(item.xs) == 1 else None  # a lone point would draw nothing
        axes.plot(item.xs, item.ys, color=hex_colour(item.colour), label=item.label,
                  linewidth=LINE_WIDTH, marker=marker, markersize=4)  # fmt: skip
    (x0, x1), (y0, y1) = ranges(panel)
    axes.set_xlim(x0, x1)
    axes.set_ylim(y0, y1)
    axes.xaxis.set_major_locator(ticker.MaxNLocator(nbins=10, integer=True, min_n_ticks=1))
    axes.set_title(panel.title, loc="left", fontsize=10)
    axes.grid(True, color="#e4e4e4", linewidth=0.8)
    axes.tick_params(labelsize=8)
    if panel.series:
        axes.legend(loc="best", fontsize=8, framealpha=0.9)


def render(
    panels: Sequence[Panel], width_px: int = 960, panel_height_px: int = 280
) -> tuple[bytes, list[str]]:
    """(PNG bytes of exactly width_px x panel_height_px * panels, description lines).
    Raises PlotUnavailable when matplotlib is not installed."""
    try:
        from matplotlib import ticker
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as missing:
        raise PlotUnavailable(INSTALL_HINT) from missing
    count = max(1, len(panels))
    figure = Figure(figsize=(width_px / DPI, panel_height_px * count / DPI), dpi=DPI,
                    layout="constrained")  # fmt: skip
    FigureCanvasAgg(figure)
    grid = figure.subplots(count, 1, squeeze=False)
    for axes, panel in zip(grid[:, 0], panels, strict=False):
        _draw_panel(axes, panel, ticker)
    grid[-1, 0].set_xlabel("epoch", fontsize=9)
    lines = describe(panels)
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=DPI,
                   metadata={"Title": "nnui curves", "Comment": "\n".join(lines)})  # fmt: skip
    return out.getvalue(), lines
