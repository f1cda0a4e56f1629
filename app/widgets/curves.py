"""Training curves: train/val loss, pseudo and EMA Dice, learning rate and epoch time, as
real plots (textual-plotext) with axes and integer epoch ticks. One fold, or all folds of a
cross-validation overlaid.

Renders the `EpochPoint` histories it is given; it never reads files.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from textual.app import ComposeResult
from textual.containers import Grid
from textual_plotext import PlotextPlot

from app.services.jobs import EpochPoint

# (plot id, title, y label, [(series label, field)])
PLOTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    ("plot-loss", "loss", "loss", (("train", "train_loss"), ("val", "val_loss"))),
    ("plot-dice", "pseudo Dice", "Dice", (("Dice", "mean_fg_dice"), ("EMA", "ema_fg_dice"))),
    ("plot-lr", "learning rate", "lr", (("lr", "lr"),)),
    ("plot-time", "epoch time", "s", (("epoch s", "epoch_time_s"),)),
)
MAX_TICKS = 10


def epoch_ticks(epochs: Sequence[int]) -> list[int]:
    """Integer epoch ticks, at most MAX_TICKS of them, always including the last epoch."""
    if not epochs:
        return []
    first, last = min(epochs), max(epochs)
    step = max(1, math.ceil((last - first + 1) / MAX_TICKS))
    ticks = list(range(first, last + 1, step))
    if ticks[-1] != last:
        ticks.append(last)
    return ticks


def series(history: Sequence[EpochPoint], field: str) -> tuple[list[int], list[float]]:
    """Epochs and values of one field, dropping NaN/inf (plotext cannot draw them)."""
    xs, ys = [], []
    for point in history:
        value = getattr(point, field)
        if value is not None and math.isfinite(value):
            xs.append(point.epoch)
            ys.append(float(value))
    return xs, ys


class CurvesPanel(Grid):
    """A 2x2 grid of plots. `show({label: history})` redraws only when the data changed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key: tuple | None = None

    def compose(self) -> ComposeResult:
        for plot_id, *_ in PLOTS:
            yield PlotextPlot(id=plot_id, classes="curve")

    def show(self, histories: Mapping[str, Sequence[EpochPoint]]) -> None:
        key = tuple((label, len(h), h[-1] if h else None) for label, h in histories.items())
        if key == self._key:
            return
        self._key = key
        for plot_id, title, ylabel, fields in PLOTS:
            plot = self.query_one(f"#{plot_id}", PlotextPlot)
            self._draw(plot, title, ylabel, fields, histories)

    @staticmethod
    def _draw(
        plot: PlotextPlot,
        title: str,
        ylabel: str,
        fields: tuple[tuple[str, str], ...],
        histories: Mapping[str, Sequence[EpochPoint]],
    ) -> None:
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        plt.title(title)
        plt.xlabel("epoch")
        plt.ylabel(ylabel)
        all_epochs: list[int] = []
        overlay = len(histories) > 1
        for run_label, history in histories.items():
            for series_label, field in fields:
                xs, ys = series(history, field)
                if not xs:
                    continue
                all_epochs.extend(xs)
                label = f"{run_label} {series_label}" if overlay else series_label
                draw: Callable[..., Any] = plt.scatter if len(xs) == 1 else plt.plot
                draw(xs, ys, label=label, marker="braille")
        ticks = epoch_ticks(sorted(set(all_epochs)))
        if ticks:
            plt.xticks(ticks, [str(t) for t in ticks])
        else:
            plt.title(f"{title} (no epochs yet)")
        plot.refresh()
