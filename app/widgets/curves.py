"""Training curves as real plots (textual-plotext) with axes and integer epoch ticks: loss
(train, val and the running training loss a few times per epoch), pseudo and EMA Dice,
Dice per class, learning rate with epoch time on the right axis. One fold, or all folds of
a cross-validation overlaid; optional TensorBoard-style smoothing of losses and Dice.

One fold: every series has its own colour and the plot's legend names it. Overlaid folds:
each fold has one colour in every plot and the series of a fold differ by marker; the
legend (`legend_text`) names both. Renders the histories it is given; never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid
from textual_plotext import PlotextPlot

from app.services.jobs.curves import (
    EpochPoint,
    RunningPoint,
    distinct_colours,
    num_classes,
    running_series,
    series,
    smooth,
)

__all__ = ["CurvesPanel", "Drawn", "epoch_ticks", "legend_text", "plot_fields"]

RUNNING_FIELD = "running"  # the train_loss_running series (a curve, not a job state)
# (plot id, title, y label, smoothed, [(series label, field)]); "dice_class" expands to
# one series per foreground class, RUNNING_FIELD is the train_loss_running series.
PLOTS: tuple[tuple[str, str, str, bool, tuple[tuple[str, str], ...]], ...] = (
    ("plot-loss", "loss", "loss", True,
     (("train", "train_loss"), ("val", "val_loss"), ("train (running)", RUNNING_FIELD))),
    ("plot-dice", "pseudo Dice", "Dice", True, (("Dice", "mean_fg_dice"), ("EMA", "ema_fg_dice"))),
    ("plot-class", "Dice per class", "Dice", True, (("class", "dice_class"),)),
    ("plot-lr", "learning rate | epoch time (right)", "lr", False,
     (("lr", "lr"), ("epoch s", "epoch_time_s"))),
)  # fmt: skip
RIGHT_AXIS_FIELDS = frozenset({"epoch_time_s"})
# Overlaid folds: the n-th series of a fold is drawn with the n-th marker.
MARKERS = ("braille", "dot", "x", "+", "o", "*")
MARKER_GLYPHS = {"braille": "⣿", "dot": "•"}
MAX_TICKS = 10


@dataclass(frozen=True)
class Drawn:
    """One series as drawn (tests and the legend read these)."""

    label: str
    series: str  # the series' own name (label without the fold)
    colour: tuple[int, int, int]
    marker: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]


def epoch_ticks(epochs: Sequence[float]) -> list[int]:
    """Integer epoch ticks, at most MAX_TICKS of them, always including the last epoch."""
    if not epochs:
        return []
    first, last = math.floor(min(epochs)), math.ceil(max(epochs))
    step = max(1, math.ceil((last - first + 1) / MAX_TICKS))
    ticks = list(range(first, last + 1, step))
    if ticks[-1] != last:
        ticks.append(last)
    return ticks


def plot_fields(
    fields: tuple[tuple[str, str], ...], classes: int, class_names: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """The plot's (label, field) list with `dice_class` expanded to one series per foreground
    class: its dataset.json name where the run recorded them (labels or regions such as
    "whole tumor"), else `class N`."""
    out: list[tuple[str, str]] = []
    named = len(class_names) == classes
    for label, field in fields:
        if field == "dice_class":
            out += [
                (class_names[c - 1] if named else f"{label} {c}", f"dice_class_{c}")
                for c in range(1, classes + 1)
            ]
        else:
            out.append((label, field))
    return out


def _xy(
    history: Sequence[EpochPoint], running: Sequence[RunningPoint], field: str
) -> tuple[list[float], list[float]]:
    if field == RUNNING_FIELD:
        return running_series(running)
    xs, ys = series(history, field)
    return [float(x) for x in xs], ys


def plan_plot(
    fields: tuple[tuple[str, str], ...],
    histories: Mapping[str, Sequence[EpochPoint]],
    running: Mapping[str, Sequence[RunningPoint]],
    smoothing: float,
    class_names: Sequence[str] = (),
) -> list[tuple[Drawn, str]]:
    """What one plot draws: [(series, field)], colours and markers assigned (see module)."""
    overlay = len(histories) > 1
    classes = max((num_classes(h) for h in histories.values()), default=0)
    wanted = plot_fields(fields, classes, class_names)
    fold_colours = distinct_colours(len(histories))
    series_colours = distinct_colours(len(wanted))
    planned = []
    for fold_index, (run_label, history) in enumerate(histories.items()):
        for series_index, (series_label, field) in enumerate(wanted):
            xs, ys = _xy(history, running.get(run_label, ()), field)
            if not xs:
                continue
            if smoothing:
                ys = smooth(ys, smoothing)
            if overlay:
                label = f"{run_label} {series_label}"
                colour = fold_colours[fold_index]
                marker = MARKERS[series_index % len(MARKERS)]
            else:
                label, colour, marker = series_label, series_colours[series_index], "braille"
            drawn = Drawn(label, series_label, colour, marker, tuple(xs), tuple(ys))
            planned.append((drawn, field))
    return planned


def legend_text(histories: Mapping[str, Any], drawn: Mapping[str, list[Drawn]]) -> Text:
    """Overlaid folds: each fold's colour, then which marker is which series."""
    text = Text()
    if len(histories) <= 1:
        return text
    colours = distinct_colours(len(histories))
    text.append("folds: ")
    for label, colour in zip(histories, colours, strict=True):
        text.append("■ ", style=f"rgb({colour[0]},{colour[1]},{colour[2]})")
        text.append(f"{label}  ")
    by_marker: dict[str, list[str]] = {}
    for series_list in drawn.values():
        for item in series_list:
            names = by_marker.setdefault(item.marker, [])
            if item.series not in names:
                names.append(item.series)
    parts = [f"{MARKER_GLYPHS.get(m, m)} {', '.join(names)}" for m, names in by_marker.items()]
    text.append("│ " + "  ".join(parts), style="dim")
    return text


class CurvesPanel(Grid):
    """A 2x2 grid of plots. `show(...)` redraws only when the data or the smoothing changed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key: tuple | None = None  # per history: (label, num epochs, last point)
        self._extra: tuple | None = None  # running-loss lengths and the smoothing factor
        self.drawn: dict[str, list[Drawn]] = {}  # plot id -> series as last drawn
        self.legend = Text()

    def compose(self) -> ComposeResult:
        for plot_id, *_ in PLOTS:
            yield PlotextPlot(id=plot_id, classes="curve")

    def show(
        self,
        histories: Mapping[str, Sequence[EpochPoint]],
        running: Mapping[str, Sequence[RunningPoint]] | None = None,
        smoothing: float = 0.0,
        class_names: Sequence[str] = (),
    ) -> bool:
        """Redraw if anything changed; True when it did."""
        running = running or {}
        key = tuple((label, len(h), h[-1] if h else None) for label, h in histories.items())
        extra = (
            tuple((k, len(v), v[-1] if v else None) for k, v in running.items()),
            smoothing,
            tuple(class_names),
        )
        if key == self._key and extra == self._extra:
            return False
        self._key, self._extra = key, extra
        for plot_id, title, ylabel, smoothed, fields in PLOTS:
            factor = smoothing if smoothed else 0.0
            planned = plan_plot(fields, histories, running, factor, class_names)
            self.drawn[plot_id] = [item for item, _ in planned]
            if factor:
                title = f"{title} (smoothed {factor:g})"
            plot = self.query_one(f"#{plot_id}", PlotextPlot)
            self._draw(plot, title, ylabel, planned, label_series=len(histories) <= 1)
        self.legend = legend_text(histories, self.drawn)
        return True

    @staticmethod
    def _draw(
        plot: PlotextPlot,
        title: str,
        ylabel: str,
        planned: list[tuple[Drawn, str]],
        label_series: bool,
    ) -> None:
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        plt.xlabel("epoch")
        plt.ylabel(ylabel)
        all_x: list[float] = []
        for item, field in planned:
            all_x.extend(item.xs)
            draw = plt.scatter if len(item.xs) == 1 else plt.plot
            yside = "right" if field in RIGHT_AXIS_FIELDS else "left"
            label = item.label if label_series else None
            draw(list(item.xs), list(item.ys), label=label, marker=item.marker,
                 color=item.colour, yside=yside)  # fmt: skip
        ticks = epoch_ticks(all_x)
        if ticks:
            plt.xticks([float(t) for t in ticks], [str(t) for t in ticks])
        else:
            plt.title(f"{title} (no epochs yet)")
        plot.refresh()
