"""Everything parsed from one job's events.jsonl so far, and its compact summary.

A job's `RunState` is kept by the tracker (views.py) and fed each poll's new records. A
run that ended keeps only its newest epochs (`TAIL_EPOCHS`: what the row, the ETA and
the alerts read); its curves are read again, whole, when a screen asks for them
(`JobTracker.want_curves`). `summary()` / `restored()` write and read that state as JSON
for the summary cache (summaries.py), with the reader's offset, so a later nnui reads only
what was appended since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.services.jobs.case_progress import CaseProgress
from app.services.jobs.curves import EpochPoint, RunningPoint, epoch_point, running_point
from app.services.jobs.events import EventBatch, JobEvents, Scope
from app.services.tail import TextTail
from trainer.schema.events import START_KINDS, Kind

CONSOLE_LINES = 40
MAX_HISTORY_EPOCHS = 20000
MAX_RUNNING_POINTS = 20000  # a few train_loss_running points per epoch, the newest kept
TAIL_EPOCHS = 8  # a compact run's newest epochs (the row reads 5, the data-wait alert 3)
TAIL_RUNNING_POINTS = 8


@dataclass
class RunState:
    """Everything parsed from one job's events.jsonl so far (bounded)."""

    events: JobEvents
    console: TextTail
    history: dict[int, EpochPoint] = field(default_factory=dict)
    # Keyed by (epoch, iteration): a resume that repeats an epoch replaces its points in place.
    running: dict[tuple[int, int], RunningPoint] = field(default_factory=dict)
    _running_tuple: tuple[RunningPoint, ...] | None = ()  # None: points came, build again
    # The views' tuples, built again only after a change (not every second for every job:
    # a long run has thousands of epochs, a console hundreds of lines).
    _history_tuple: tuple[EpochPoint, ...] | None = ()  # None: an epoch came
    _console_tuple: tuple[str, ...] | None = ()  # None: console lines came
    num_epochs: int | None = None
    class_names: tuple[str, ...] = ()  # from run_started (regions: their dataset.json names)
    last_kind: str | None = None  # last lifecycle event of THIS job's run
    stop_requested: bool = False
    stop_requested_t: float | None = None  # the first stop_requested/stop_heard of this run
    last_event_t: float | None = None
    nan_epoch: int | None = None
    cases: CaseProgress = field(default_factory=CaseProgress)  # a prediction's
    last_epoch_t: float | None = None  # when this run's newest epoch_ended was written
    validation: tuple[int, int] | None = None  # (cases done, of) while final validation runs
    validation_t: float | None = None  # when the final validation began
    final_dice: float | None = None
    checkpoints: dict[str, int] = field(default_factory=dict)  # kind -> epochs completed
    started_t: float | None = None  # this job's first start (run_started), in file order
    compact: bool = False  # keeps only the newest epochs and running points (an ended run)

    @property
    def topology(self) -> dict | None:
        return self.events.topology

    def running_points(self) -> tuple[RunningPoint, ...]:
        if self._running_tuple is None:
            self._running_tuple = tuple(self.running.values())
        return self._running_tuple

    def history_points(self) -> tuple[EpochPoint, ...]:
        """The epochs in epoch order."""
        if self._history_tuple is None:
            self._history_tuple = tuple(self.history[k] for k in sorted(self.history))
        return self._history_tuple

    def console_tail(self) -> tuple[str, ...]:
        if self._console_tuple is None:
            self._console_tuple = tuple(self.console.lines)[-CONSOLE_LINES:]
        return self._console_tuple

    def follow_console(self, path: Path) -> None:
        """Read the console of a new attempt (a restart writes a new file)."""
        self.console = TextTail(path)
        self._console_tuple = None

    def poll_console(self) -> None:
        while True:
            if self.console.poll():
                self._console_tuple = None
            if not self.console.more:
                return

    def absorb(self, batch: EventBatch) -> None:
        if batch.reset:
            self.history.clear()
            self.running.clear()
            self._running_tuple = self._history_tuple = ()
            self.num_epochs, self.last_kind, self.stop_requested = None, None, False
            self.stop_requested_t = None
            self.nan_epoch, self.last_event_t = None, None
            self.cases = CaseProgress()
            self.last_epoch_t, self.validation, self.final_dice = None, None, None
            self.checkpoints = {}
            self.started_t = None
        for scope, record in batch.records:
            if scope is Scope.LATER:
                continue  # a later run (a resume) in the same folder: that job's view shows it
            # Earlier runs in the folder are history: their epochs still draw the curve.
            self._absorb_history(scope, record)
            if scope is Scope.MINE:
                self._absorb_mine(record)

    def _absorb_history(self, scope: Scope, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == Kind.RUN_STARTED:
            self.num_epochs = record["num_epochs"]
            names = record.get("class_names")
            self.class_names = tuple(names) if isinstance(names, list) else ()
        elif kind == Kind.TRAIN_LOSS_RUNNING:
            running = running_point(record)
            self.running[(running.epoch, running.iteration)] = running
            if len(self.running) > (TAIL_RUNNING_POINTS if self.compact else MAX_RUNNING_POINTS):
                self.running.pop(next(iter(self.running)))
            self._running_tuple = None
        elif kind == Kind.CHECKPOINT_SAVED and isinstance(record.get("epoch"), int):
            self.checkpoints[record["checkpoint"]] = record["epoch"] + 1
        elif kind == Kind.EPOCH_ENDED:
            point = epoch_point(record)
            self.history[point.epoch] = point
            self._history_tuple = None
            if len(self.history) > (TAIL_EPOCHS if self.compact else MAX_HISTORY_EPOCHS):
                self.history.pop(min(self.history))
            finite = math.isfinite(point.train_loss) and math.isfinite(point.val_loss)
            if scope is Scope.MINE and not finite:
                self.nan_epoch = point.epoch

    def _absorb_mine(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        self.last_event_t = record["t"]
        self._absorb_validation(record)
        if kind == Kind.EPOCH_ENDED:
            self.last_epoch_t = record["t"]
        if kind in START_KINDS:
            self.last_kind, self.stop_requested, self.stop_requested_t = None, False, None
            if self.started_t is None:
                self.started_t = record["t"]
            if kind == Kind.PREDICTION_STARTED:
                self.cases = CaseProgress()
        elif kind in (Kind.STOP_REQUESTED, Kind.STOP_HEARD):
            self.stop_requested = True
            if self.stop_requested_t is None:
                self.stop_requested_t = record["t"]
        if kind in (Kind.PREDICTION_STARTED, Kind.CASE_PREDICTED):
            self.cases.absorb(record)
        if kind in (Kind.RUN_STARTED, Kind.STOPPED, Kind.FINISHED, Kind.FAILED):
            self.last_kind = kind
        elif kind == Kind.EPOCH_ENDED and self.last_kind is None:
            self.last_kind = Kind.RUN_STARTED

    def _absorb_validation(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == Kind.VALIDATION_STARTED:
            self.validation = (0, int(record.get("num_cases") or 0))
            self.validation_t = record["t"]
        elif kind == Kind.VALIDATION_CASE:
            self.validation = (record["index"], record["num_cases"])
        elif kind == Kind.VALIDATION_FINISHED:
            self.validation = None
            dice = record.get("mean_fg_dice")
            self.final_dice = dice if isinstance(dice, (int, float)) else None
        elif kind in (*START_KINDS, Kind.STOPPED, Kind.FINISHED, Kind.FAILED):
            self.validation = None
            if kind in START_KINDS:
                self.final_dice = None


# ---- the compact summary (summaries.py keeps it across nnui's starts) ------------------------

_SCALARS = ("num_epochs", "last_kind", "stop_requested", "last_event_t", "nan_epoch",
            "last_epoch_t", "validation_t", "final_dice", "started_t")  # fmt: skip


def summary(run: RunState) -> dict[str, Any] | None:
    """The compact state of a compact run with its reader's position (JSON-ready); None
    when it cannot be kept (not compact, a prediction's case counts, nothing read)."""
    events = run.events.state()
    if not run.compact or run.cases.num_cases is not None or events is None:
        return None
    return {
        **{name: getattr(run, name) for name in _SCALARS},
        "history": [_point_list(p) for p in run.history_points()],
        "running": [[p.epoch, p.iteration, p.num_iterations, p.loss]
                    for p in run.running_points()],
        "class_names": list(run.class_names),
        "validation": list(run.validation) if run.validation else None,
        "checkpoints": run.checkpoints,
        "events": events,
    }  # fmt: skip


def restored(data: dict[str, Any], run_dir: str, console: TextTail) -> RunState | None:
    """The RunState a summary describes, its reader at the summary's offset; None when the
    summary is not one (a damaged cache is read again from the events file)."""
    try:
        events = JobEvents(run_dir)
        if not events.restore(data["events"]):
            return None
        run = RunState(events, console, compact=True)
        for name in _SCALARS:
            setattr(run, name, data[name])
        for values in data["history"]:
            point = _point(values)
            run.history[point.epoch] = point
        for epoch, iteration, num_iterations, loss in data["running"]:
            run.running[(epoch, iteration)] = RunningPoint(epoch, iteration, num_iterations, loss)
        run.class_names = tuple(str(n) for n in data["class_names"])
        validation = data["validation"]
        run.validation = (int(validation[0]), int(validation[1])) if validation else None
        run.checkpoints = {str(k): int(v) for k, v in data["checkpoints"].items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    run._history_tuple = run._running_tuple = None
    return run


def _point(values: list[Any]) -> EpochPoint:
    epoch, train, val, dice, ema, lr, epoch_s, it_s, per_class, wait = values
    return EpochPoint(int(epoch), float(train), float(val), float(dice), float(ema), float(lr),
                      float(epoch_s), float(it_s), tuple(float(d) for d in per_class),
                      float(wait))  # fmt: skip


def _point_list(point: EpochPoint) -> list[Any]:
    return [point.epoch, point.train_loss, point.val_loss, point.mean_fg_dice,
            point.ema_fg_dice, point.lr, point.epoch_time_s, point.iterations_per_s,
            list(point.dice_per_class), point.data_wait_share]  # fmt: skip
