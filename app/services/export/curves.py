"""`nnui export JOB`: a job's curves as CSV (one row per epoch, every `epoch_ended` field)
and PNG (loss, Dice, learning rate; app.services.png_plot, drawn by matplotlib).

The records are the job's own view of its run folder (app.services.jobs.events): its run and
the earlier runs a resume continued, never a later job's. An epoch trained twice (a resume
from an older checkpoint) keeps its newest record, as the curves do.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.services.export import png as png_plot
from app.services.jobs.curves import (
    distinct_colours,
    epoch_point,
    running_point,
    running_series,
    series,
)
from app.services.jobs.events import JobEvents, Scope
from app.services.jobs.registry import Job
from trainer.schema.atomic import atomic_write_bytes, atomic_write_text
from trainer.schema.events import Kind

# The epoch_ended keys in the order the trainer writes them; others follow, sorted.
KNOWN_COLUMNS = ("epoch", "t", "train_loss", "val_loss", "mean_fg_dice", "ema_fg_dice", "lr",
                 "epoch_time_s", "iterations_per_s", "data_wait_s", "nan_loss")  # fmt: skip
SKIPPED_KEYS = frozenset({"v", "kind", "dice_per_class"})


@dataclass
class JobCurves:
    epochs: list[dict[str, Any]] = field(default_factory=list)  # epoch_ended, by epoch
    running: list[dict[str, Any]] = field(default_factory=list)  # train_loss_running
    class_names: tuple[str, ...] = ()  # run_started's names of dice_per_class (regions too)


def read_curves(job: Job) -> JobCurves:
    """This job's epoch_ended and train_loss_running records (whole file, one read)."""
    events = JobEvents(job.run_dir)
    epochs: dict[int, dict[str, Any]] = {}
    running: dict[tuple[int, int], dict[str, Any]] = {}
    names: tuple[str, ...] = ()
    for scope, record in events.poll(job).records:
        if scope is Scope.LATER:
            continue
        if record["kind"] == Kind.RUN_STARTED and isinstance(record.get("class_names"), list):
            names = tuple(str(n) for n in record["class_names"])
        elif record["kind"] == Kind.EPOCH_ENDED:
            epochs[record["epoch"]] = record
        elif record["kind"] == Kind.TRAIN_LOSS_RUNNING:
            running[(record["epoch"], record["iteration"])] = record
    return JobCurves([epochs[e] for e in sorted(epochs)], list(running.values()), names)


def csv_columns(records: list[dict[str, Any]]) -> list[str]:
    classes = max((len(r.get("dice_per_class") or ()) for r in records), default=0)
    present = {key for record in records for key in record}
    known = [c for c in KNOWN_COLUMNS if c in present or c == "epoch"]
    extra = sorted(present - set(KNOWN_COLUMNS) - SKIPPED_KEYS)
    return known + [f"dice_class_{c}" for c in range(1, classes + 1)] + extra


def _cell(value: Any) -> str:
    if value is None:
        return ""  # null: an undefined Dice or a non-finite loss
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def csv_text(records: list[dict[str, Any]]) -> str:
    """One header row, then one row per epoch (empty cell = null in the event)."""
    columns = csv_columns(records)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for record in records:
        dice = list(record.get("dice_per_class") or ())
        row = []
        for column in columns:
            if column.startswith("dice_class_") and column not in record:
                index = int(column.removeprefix("dice_class_")) - 1
                row.append(_cell(dice[index] if index < len(dice) else None))
            else:
                row.append(_cell(record.get(column)))
        writer.writerow(row)
    return out.getvalue()


def _panel(
    title: str, named: Sequence[tuple[str, tuple[Sequence[float], Sequence[float]]]]
) -> png_plot.Panel:
    kept = [(label, xy) for label, xy in named if xy[0]]
    colours = distinct_colours(len(kept))
    return png_plot.Panel(title, tuple(
        png_plot.Series(label, colour, tuple(map(float, xs)), tuple(ys))
        for (label, (xs, ys)), colour in zip(kept, colours, strict=True)
    ))  # fmt: skip


def panels(curves: JobCurves) -> list[png_plot.Panel]:
    history = [epoch_point(r) for r in curves.epochs]
    running = [running_point(r) for r in curves.running]
    classes = max((len(p.dice_per_class) for p in history), default=0)
    loss: list[tuple[str, tuple[Sequence[float], Sequence[float]]]]
    loss = [("train", series(history, "train_loss")), ("val", series(history, "val_loss")),
            ("train (running)", running_series(running))]  # fmt: skip
    dice = [("Dice", series(history, "mean_fg_dice")), ("EMA", series(history, "ema_fg_dice"))]
    names = curves.class_names if len(curves.class_names) == classes else ()
    dice += [(names[c - 1] if names else f"class {c}", series(history, f"dice_class_{c}"))
             for c in range(1, classes + 1)]  # fmt: skip
    return [_panel("loss", loss), _panel("pseudo Dice", dice),
            _panel("learning rate", [("lr", series(history, "lr"))])]  # fmt: skip


def file_stem(job: Job) -> str:
    """The exported files' name: the job id, with no `:` (`run:4242` -> `run-4242_curves`),
    which some file systems and tools refuse or read as a drive or host."""
    safe = "".join(c if c.isalnum() or c in "-_.+" else "-" for c in job.job_id)
    return f"{safe}_curves"


def csv_path(job: Job, folder: Path) -> Path:
    return folder / f"{file_stem(job)}.csv"


def export(job: Job, folder: Path, curves: JobCurves | None = None) -> tuple[list[Path], list[str]]:
    """Write JOB_curves.csv and JOB_curves.png into `folder`: (paths, PNG description).
    Without matplotlib the CSV is written and png_plot.PlotUnavailable raised (no PNG)."""
    curves = read_curves(job) if curves is None else curves
    folder.mkdir(parents=True, exist_ok=True)
    png_path = folder / f"{file_stem(job)}.png"
    atomic_write_text(csv_path(job, folder), csv_text(curves.epochs))
    image, lines = png_plot.render(panels(curves))
    atomic_write_bytes(png_path, image)
    return [csv_path(job, folder), png_path], lines
