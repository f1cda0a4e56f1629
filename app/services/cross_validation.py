"""The cross-validation view: one row per dataset x configuration x trainer x plans with
the state of folds 0-4, the final validation Dice of the finished ones (mean and spread),
the GPU-hours spent and the ETA of the rest — and the launches that queue exactly the
missing or failed folds (`--c` where a checkpoint exists, `--when-free`).

Aggregation only (no rendering): the CLI (`nnui cv`) and the TUI screen draw it.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.services.jobs.identity import RunIdentity, run_identity, tree_label
from app.services.jobs.registry import TRAIN, Job
from app.services.jobs.views import JobView
from app.services.launch.request import LaunchRequest, job_roots
from app.services.launch.schedule import Schedule
from trainer.schema.status import ACTIVE_STATES, State
from trainer.schema.tree import (
    CHECKPOINT_KINDS,
    STATUS_FILE,
    SUMMARY_FILE,
    VALIDATION_DIR,
    Roots,
    checkpoint_file,
)

FOLDS = ("0", "1", "2", "3", "4")
MISSING = "missing"
UNKNOWN = "unknown"
# Every job state as the view's fold state: live ones stay live (a validating or stopping fold
# is never "failed", never offered to the queue); a test keeps this total over State.
FOLD_STATE: dict[State, str] = {
    State.QUEUED: "waiting", State.STARTING: "running", State.RUNNING: "running",
    State.STOPPING: "stopping", State.VALIDATING: "validating",
    State.STOPPED: "stopped", State.KILLED: "stopped", State.FAILED: "failed",
    State.LOST: "failed", State.FINISHED: "finished",
}  # fmt: skip
TO_QUEUE = (MISSING, FOLD_STATE[State.FAILED])
NNUNET_CHECKPOINTS = ("checkpoint_latest.pth", "checkpoint_final.pth", "checkpoint_best.pth")


@dataclass(frozen=True)
class FoldCell:
    fold: str
    state: str  # MISSING or a FOLD_STATE value
    dice: float | None = None  # final validation mean foreground Dice (finished folds)
    resumable: bool = False  # queue it with --c (needs_continue)


@dataclass(frozen=True)
class CvRow:
    results: str  # the results tree: a row never mixes folds of two trees
    label: str  # '' in the default tree, else its short name (what the row shows)
    dataset: str
    configuration: str
    trainer: str
    plans: str
    folds: tuple[FoldCell, ...]
    mean_dice: float | None
    std_dice: float | None  # population spread over the finished folds (0 for one)
    gpu_hours: float
    eta_s: float | None
    gpus: tuple[str, ...]  # the GPUs its folds ran on (queue them there)
    template: Job  # the newest job: its trainer flags, device, engine

    @property
    def to_queue(self) -> tuple[FoldCell, ...]:
        return tuple(c for c in self.folds if c.state in TO_QUEUE)


def summary_dice(run_dir: str) -> float | None:
    """validation/summary.json's mean foreground Dice (nnU-Net's file), None: none."""
    try:
        data = json.loads((Path(run_dir) / VALIDATION_DIR / SUMMARY_FILE).read_text())
        value = data["foreground_mean"]["Dice"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def needs_continue(run_dir: str) -> bool:
    """Queue the fold with --c: its folder has a checkpoint to continue from, or an earlier
    run that a plain launch would refuse to overwrite (--c then starts from scratch)."""
    folder = Path(run_dir)
    names = [checkpoint_file(k) for k in CHECKPOINT_KINDS] + list(NNUNET_CHECKPOINTS)
    return any((folder / name).is_file() for name in [*names, STATUS_FILE])


def uses_gpus(job: Job) -> bool:
    return bool(job.gpus) and (job.device == "cuda" or job.simulated)


def gpu_hours(view: JobView, now: float) -> float:
    """Wall time of its attempts (its own first run_started, kept by the view and by the
    summary cache of ended runs: no events file is read here) x its (simulated) GPUs."""
    job = view.job
    if not uses_gpus(job) or view.started_t is None:
        return 0.0
    return max(0.0, (job.ended_at or now) - view.started_t) * len(job.gpus) / 3600.0


def fold_cell(fold: str, view: Any | None) -> FoldCell:
    if view is None:
        return FoldCell(fold, MISSING)
    try:
        state = FOLD_STATE[State(str(view.state))]
    except ValueError:  # not a state at all: say so, never guess "failed" (it would be queued)
        state = UNKNOWN
    dice = None
    if state == State.FINISHED:
        # The job's own validation_finished first (the view read it from its own run's
        # events, in file order): the number `nnui status` and the board show (a later run
        # in the same folder is another job's); summary.json only when the events have none
        # (runs whose events predate validation_finished, nnU-Net's runs).
        dice = getattr(view, "final_dice", None)
        if dice is None:
            dice = summary_dice(view.job.run_dir)
    return FoldCell(fold, state, dice, needs_continue(view.job.run_dir))


def cross_validation_eta_s(views: list[JobView]) -> float | None:
    """Time until every active job is done: queued chains add up, parallel ones overlap."""
    views = [v for v in views if v.job.kind == TRAIN]  # predictions have their own ETA
    by_id = {v.job.job_id: v for v in views}
    active = [v for v in views if v.state in ACTIVE_STATES]
    if not active:
        return None
    known = [v.mean_epoch_time_s for v in views if v.mean_epoch_time_s]
    fallback_epoch_s = statistics.fmean(known) if known else None
    epochs_known = [v.num_epochs for v in views if v.num_epochs]
    fallback_epochs = max(epochs_known) if epochs_known else None
    active_ids = {v.job.job_id for v in active}

    def own(view: JobView) -> float | None:
        if view.eta_s is not None:
            return view.eta_s
        num_epochs = view.num_epochs or fallback_epochs
        remaining = max(0, (num_epochs or 0) - (view.epoch or 0))
        if remaining and fallback_epoch_s:
            return remaining * fallback_epoch_s
        return None  # e.g. its final validation, no case done yet: unknown, not "0s"

    def chain(view: JobView, depth: int = 0) -> float | None:
        mine = own(view)
        if mine is None:
            return None
        before = by_id.get(view.job.after or "")
        if before is None or depth > 20 or before.job.job_id not in active_ids:
            return mine
        earlier = chain(before, depth + 1)
        return None if earlier is None else earlier + mine

    totals = [chain(v) for v in active]
    if any(t is None for t in totals):
        return None
    return max(t for t in totals if t is not None)


def _row(key: RunIdentity, label: str, views: list[Any], now: float) -> CvRow:
    newest = {}
    for view in sorted(views, key=lambda v: v.job.created_at):
        newest[view.job.fold] = view  # the newest job of each fold says its state
    cells = tuple(fold_cell(f, newest.get(f)) for f in FOLDS)
    dices = [c.dice for c in cells if c.dice is not None]
    gpus = sorted({g for v in views for g in v.job.gpus}, key=lambda g: (len(g), g))
    template = max((v.job for v in views), key=lambda j: j.created_at)
    return CvRow(
        results=key.results, label=label, dataset=key.dataset, configuration=key.configuration,
        trainer=key.trainer, plans=key.plans, folds=cells,
        mean_dice=statistics.fmean(dices) if dices else None,
        std_dice=statistics.pstdev(dices) if dices else None,
        gpu_hours=sum(gpu_hours(v, now) for v in views),
        eta_s=cross_validation_eta_s(list(newest.values())), gpus=tuple(gpus), template=template,
    )  # fmt: skip


def cv_rows(
    views: list[Any], now: float | None = None, default_results: str | Path | None = None
) -> list[CvRow]:
    """The rows of the view, from the job views (nnui's trainings; watch-only skipped): one
    per results tree x dataset x configuration x trainer x plans, the default tree's first;
    the others labelled with their tree's short name."""
    now = time.time() if now is None else now
    groups: dict[RunIdentity, list[Any]] = {}
    for view in views:
        job = view.job
        if view.watch_only or job.kind != TRAIN or job.fold not in FOLDS:
            continue
        key = run_identity(job)
        groups.setdefault(RunIdentity(key.results, key.dataset, key.trainer, key.plans,
                                      key.configuration, ""), []).append(view)  # fmt: skip
    labels = {key: tree_label(key.results, default_results) for key in groups}
    order = sorted(groups, key=lambda k: (labels[k] != "", labels[k], k.results, k.dataset,
                                          k.configuration, k.trainer, k.plans))  # fmt: skip
    return [_row(key, labels[key], groups[key], now) for key in order]


# ---- queueing the missing folds -----------------------------------------------------------


@dataclass(frozen=True)
class QueueLaunch:
    """One `nnui launch` of the folds of a row to queue (new ones, or resumed with --c)."""

    folds: tuple[str, ...]
    continue_training: bool
    gpus: tuple[str, ...]  # () with a CPU template
    row: CvRow
    simulate_gpus: int | None = None  # the simulated machine's GPUs (simulated jobs)

    @property
    def after_inputs(self) -> bool:
        """A cascade row: its folds wait for the previous stage's, as their jobs did."""
        return bool(getattr(self.row.template, "after_previous_stage", False))

    @property
    def schedule(self) -> Schedule:
        return Schedule(when_free=bool(self.gpus), after_previous_stage=self.after_inputs)

    def roots(self, caller: Roots | None = None) -> Roots | None:
        """The row's own roots: its newest job's, else the caller's with the row's tree."""
        own = job_roots(self.row.template)
        if own is not None and os.path.realpath(own.results) == self.row.results:
            return own
        if caller is None or not self.row.results:
            return own
        return Roots(caller.raw, caller.preprocessed, Path(self.row.results))

    def request(self, caller: Roots | None = None) -> LaunchRequest:
        """What the launch confirm dialog plans and starts (the same as `command`), in the
        row's own results tree."""
        job = self.row.template
        simulated = self.simulate_gpus is not None and bool(self.gpus)
        return LaunchRequest(
            dataset=job.dataset, configuration=self.row.configuration, folds=list(self.folds),
            gpus=list(self.gpus), mode="per_gpu",
            device="cuda" if self.gpus and not simulated else "cpu",
            trainer_args=list(job.trainer_args), simulated=simulated,
            continue_training=self.continue_training, engine=job.engine, schedule=self.schedule,
            roots=self.roots(caller),
        )  # fmt: skip

    def command(self) -> list[str]:
        """The headless equivalent, for the confirm dialog and `nnui cv --json`."""
        job = self.row.template
        argv = ["nnui", "launch", job.dataset, self.row.configuration,
                "--folds", ",".join(self.folds)]  # fmt: skip
        if self.simulate_gpus is not None and self.gpus:
            argv += ["--simulate-gpus", str(self.simulate_gpus)]
        if self.gpus:
            argv += ["--gpus", ",".join(self.gpus), "--when-free"]
        else:
            argv.append("--cpu")
        if self.continue_training:
            argv.append("--c")
        if self.after_inputs:
            argv.append("--after-lowres")
        if self.row.label:  # another tree than the default one: say which
            argv += ["--results", self.row.results]
            own = job_roots(job)
            if own is not None:
                argv += ["--preprocessed", str(own.preprocessed)]
        if job.trainer_args:
            argv += ["--", *job.trainer_args]
        return argv

    def text(self) -> str:
        return shlex.join(self.command())


def queue_launches(
    row: CvRow, all_gpus: list[str], simulate_gpus: int | None = None
) -> list[QueueLaunch]:
    """The launches that queue exactly the row's missing and failed folds: resumable ones
    with --c, each waiting for a free GPU of those the row used (else of all GPUs)."""
    gpus = tuple(row.gpus or all_gpus) if uses_gpus(row.template) else ()
    if row.template.simulated and simulate_gpus is None:
        simulate_gpus = max((int(g) + 1 for g in gpus if g.isdigit()), default=1)
    fresh = tuple(c.fold for c in row.to_queue if not c.resumable)
    resumed = tuple(c.fold for c in row.to_queue if c.resumable)
    launches = []
    if fresh:
        launches.append(QueueLaunch(fresh, False, gpus, row, simulate_gpus))
    if resumed:
        launches.append(QueueLaunch(resumed, True, gpus, row, simulate_gpus))
    return launches
