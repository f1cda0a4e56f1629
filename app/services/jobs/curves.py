"""The numbers behind the curves: per-epoch points, running-loss points, series, smoothing.

Plain Python (no textual): the TUI's curves and `nnui export` draw the same series.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# TensorBoard's default: a readable curve without hiding a trend.
SMOOTHING_FACTORS = (0.0, 0.6, 0.9)  # what the job detail's smoothing key cycles through
# Ten colours that stay apart on dark and light backgrounds (Tableau 10), RGB.
PALETTE_RGB: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
)  # fmt: skip


def distinct_colours(count: int) -> list[tuple[int, int, int]]:
    """`count` different RGB colours: the palette, then hues spread by the golden ratio."""
    colours = list(PALETTE_RGB[:count])
    hue = 0.0
    while len(colours) < count:
        hue = (hue + 0.618033988749895) % 1.0
        rgb = colorsys.hsv_to_rgb(hue, 0.75, 0.6 + 0.35 * (len(colours) % 2))
        colour = (round(rgb[0] * 255), round(rgb[1] * 255), round(rgb[2] * 255))
        if colour not in colours:
            colours.append(colour)
    return colours


@dataclass(frozen=True)
class EpochPoint:
    epoch: int
    train_loss: float
    val_loss: float
    mean_fg_dice: float
    ema_fg_dice: float
    lr: float
    epoch_time_s: float
    iterations_per_s: float
    dice_per_class: tuple[float, ...] = ()  # entry 0 = label 1; NaN where undefined
    data_wait_share: float = math.nan  # of the training steps' time, waiting for batches


@dataclass(frozen=True)
class RunningPoint:
    """A `train_loss_running` record: the mean loss of the steps since the previous point."""

    epoch: int
    iteration: int  # steps done in this epoch (1-based)
    num_iterations: int
    loss: float

    @property
    def x(self) -> float:
        """Position on the epoch axis (epochs done, as the table counts them): the end of
        the epoch with index E is at x = E + 1, where its epoch_ended is."""
        return self.epoch + self.iteration / max(self.num_iterations, self.iteration)


def num(value: Any) -> float:
    """JSON null (the trainer writes NaN as null) -> NaN, so curves keep their x positions."""
    return math.nan if value is None else float(value)  # validated: a finite number or null


def epoch_point(record: dict[str, Any]) -> EpochPoint:
    return EpochPoint(
        epoch=record["epoch"],
        train_loss=num(record.get("train_loss")),
        val_loss=num(record.get("val_loss")),
        mean_fg_dice=num(record.get("mean_fg_dice")),
        ema_fg_dice=num(record.get("ema_fg_dice")),
        lr=num(record.get("lr")),
        epoch_time_s=num(record.get("epoch_time_s")),
        iterations_per_s=num(record.get("iterations_per_s")),
        dice_per_class=tuple(num(d) for d in record.get("dice_per_class") or ()),
        data_wait_share=num(record.get("data_wait_share")),
    )


def running_point(record: dict[str, Any]) -> RunningPoint:
    iteration = record["iteration"]
    return RunningPoint(
        epoch=record["epoch"],
        iteration=iteration,
        num_iterations=record.get("num_iterations") or iteration,
        loss=num(record["loss"]),
    )


def epoch_field(point: EpochPoint, field: str) -> float:
    """A field of a point; `dice_class_N` is the Dice of label N (NaN when absent)."""
    if field.startswith("dice_class_"):
        index = int(field.removeprefix("dice_class_")) - 1
        return point.dice_per_class[index] if index < len(point.dice_per_class) else math.nan
    return float(getattr(point, field))


def num_classes(history: Sequence[EpochPoint]) -> int:
    """Foreground classes with a per-class Dice in any epoch."""
    return max((len(p.dice_per_class) for p in history), default=0)


def series(history: Sequence[EpochPoint], field: str) -> tuple[list[int], list[float]]:
    """Epochs done (x = index + 1: the first epoch ends at 1, as "epoch 1/N" in the table)
    and values of one field, dropping NaN/inf (neither plot can draw them)."""
    xs, ys = [], []
    for point in history:
        value = epoch_field(point, field)
        if value is not None and math.isfinite(value):
            xs.append(point.epoch + 1)
            ys.append(float(value))
    return xs, ys


def running_series(points: Sequence[RunningPoint]) -> tuple[list[float], list[float]]:
    pairs = [(p.x, p.loss) for p in points if math.isfinite(p.loss)]
    return [x for x, _ in pairs], [y for _, y in pairs]


def smooth(values: Sequence[float], factor: float) -> list[float]:
    """TensorBoard's smoothing: an EMA with weight `factor` on the past, debiased so the
    first points are not pulled towards zero. factor 0 returns the values unchanged."""
    if not 0.0 <= factor < 1.0:
        raise ValueError(f"smoothing factor must be in [0, 1), got {factor}")
    if factor == 0.0:
        return [float(v) for v in values]
    smoothed, last, weight = [], 0.0, 0.0
    for value in values:
        last = factor * last + (1 - factor) * value
        weight = factor * weight + (1 - factor)
        smoothed.append(last / weight)
    return smoothed
