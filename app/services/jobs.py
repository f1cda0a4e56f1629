"""What the UI shows about each job: registry + run folder + live processes, incrementally.

`JobTracker.refresh()` keeps one tail per job file, so a refresh reads only appended
bytes. It also finishes what the app promised: it records worker create_times the first
time a topology appears and delivers a stop that was queued before the workers were up.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.services.gpus import GpuMonitor, MachineSnapshot
from app.services.registry import Job, Registry
from app.services.signals import (
    job_alive,
    local_ranks,
    plan_stop,
    proc_info,
    remember_workers,
    send_stop,
)
from app.services.tail import JsonlTail, TextTail
from trainer.schema import EVENTS_FILE, Kind

STALL_MIN_S = 60.0
CLOCK_SLACK_S = 0.5
RECENT_EPOCHS = 5
CONSOLE_LINES = 40


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


@dataclass(frozen=True)
class JobView:
    job: Job
    state: str  # starting|running|stopping|stopped|finished|failed|lost|queued
    epoch: int | None  # epochs completed (last epoch_ended index + 1)
    num_epochs: int | None
    train_loss: float | None
    val_loss: float | None
    mean_dice: float | None
    ema_dice: float | None
    it_per_s: float | None
    eta_s: float | None
    alerts: tuple[str, ...]
    topology: dict | None
    history: tuple[EpochPoint, ...]
    console_tail: tuple[str, ...]
    exit_code: int | None
    mean_epoch_time_s: float | None = None
    last_event_t: float | None = None


def _num(value: Any) -> float:
    """JSON null (the trainer writes NaN as null) -> NaN, so curves keep their x positions."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _point(record: dict[str, Any]) -> EpochPoint:
    return EpochPoint(
        epoch=int(record.get("epoch", 0)),
        train_loss=_num(record.get("train_loss")),
        val_loss=_num(record.get("val_loss")),
        mean_fg_dice=_num(record.get("mean_fg_dice")),
        ema_fg_dice=_num(record.get("ema_fg_dice")),
        lr=_num(record.get("lr")),
        epoch_time_s=_num(record.get("epoch_time_s")),
        iterations_per_s=_num(record.get("iterations_per_s")),
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass
class _RunState:
    """Everything parsed from one job's events.jsonl so far (bounded)."""

    events: JsonlTail
    console: TextTail
    history: dict[int, EpochPoint] = field(default_factory=dict)
    num_epochs: int | None = None
    topology: dict | None = None
    last_kind: str | None = None  # last lifecycle event of THIS job (t >= job start)
    stop_requested: bool = False
    last_event_t: float | None = None
    nan_epoch: int | None = None
    mine: bool = False  # this job's run_started has been seen

    def absorb(self, job: Job, records: list[dict[str, Any]]) -> None:
        for record in records:
            t = _num(record.get("t"))
            kind = record.get("kind")
            if job.ended_at is not None and t > job.ended_at + CLOCK_SLACK_S:
                continue  # a later run (a resume) in the same folder: that job's view shows it
            # The folder may hold earlier runs (resume appends): only events from this job's
            # own run_started on describe this job; the earlier ones are history.
            if kind == Kind.RUN_STARTED and not t < job.created_at - CLOCK_SLACK_S:
                self.mine = True
                self.topology, self.last_kind, self.stop_requested = None, None, False
            mine = self.mine
            if kind == Kind.EPOCH_ENDED:
                point = _point(record)
                self.history[point.epoch] = point
                if len(self.history) > 20000:
                    self.history.pop(min(self.history))
                if mine and not (math.isfinite(point.train_loss) and math.isfinite(point.val_loss)):
                    self.nan_epoch = point.epoch
            if kind == Kind.RUN_STARTED and isinstance(record.get("num_epochs"), int):
                self.num_epochs = record["num_epochs"]
            if not mine:
                continue
            self.last_event_t = t
            if kind == Kind.TOPOLOGY:
                self.topology = record
            elif kind == Kind.STOP_REQUESTED:
                self.stop_requested = True
            if kind in (Kind.RUN_STARTED, Kind.STOPPED, Kind.FINISHED, Kind.FAILED):
                self.last_kind = kind
            elif kind == Kind.EPOCH_ENDED and self.last_kind is None:
                self.last_kind = Kind.RUN_STARTED


def derive_state(job: Job, run: _RunState, alive: bool) -> str:
    if job.exit_code is not None:
        if run.last_kind == Kind.FINISHED:
            return "finished"
        if run.last_kind == Kind.STOPPED or job.note == "stopped before it started":
            return "stopped"
        if job.exit_code != 0 or run.last_kind == Kind.FAILED:
            return "failed"
        return "finished"
    if not alive:
        if run.last_kind in (Kind.STOPPED, Kind.FINISHED):
            return "stopped" if run.last_kind == Kind.STOPPED else "finished"
        if run.last_kind == Kind.FAILED:
            return "failed"
        return "lost"
    if run.last_kind == Kind.STOPPED:
        return "stopped"
    if run.last_kind == Kind.FINISHED:
        return "finished"
    if run.last_kind == Kind.FAILED:
        return "failed"
    if job.after and not job.process("trainer"):
        return "stopping" if job.queued_stop else "queued"
    stop_sent = any(s.signal == "SIGUSR1" and s.result == "sent" for s in job.signals)
    if run.stop_requested or stop_sent or job.queued_stop:
        return "stopping"
    if run.topology is not None or (run.history and run.last_event_t):
        return "running"
    return "starting"


def simulated_gpu_load(registry: Registry) -> dict[int, list[tuple[int, str]]]:
    """{simulated GPU index: [(pid, name)]} of nnui's own live simulated jobs (for GpuMonitor)."""
    load: dict[int, list[tuple[int, str]]] = {}
    for job in registry.list():
        if not job.simulated or job.exit_code is not None:
            continue
        trainer = job.process("trainer")
        if trainer is None or not job_alive(job, proc_info):
            continue
        for gpu in job.gpus:
            if gpu.isdigit():
                load.setdefault(int(gpu), []).append((trainer.pid, f"nnui {job.job_id}"))
    return load


class JobTracker:
    def __init__(self, registry: Registry, gpu_monitor: GpuMonitor | None = None) -> None:
        self.registry = registry
        self.gpu_monitor = gpu_monitor
        self._runs: dict[str, _RunState] = {}
        self.views: list[JobView] = []

    def _run(self, job: Job) -> _RunState:
        run = self._runs.get(job.job_id)
        if run is None:
            folder = Path(job.run_dir)
            run = _RunState(JsonlTail(folder / EVENTS_FILE), TextTail(Path(job.console_path)))
            self._runs[job.job_id] = run
        while True:
            records = run.events.poll()
            if run.events.reset:
                run.history.clear()
                run.topology, run.last_kind, run.stop_requested = None, None, False
                run.mine, run.nan_epoch, run.last_event_t = False, None, None
            run.absorb(job, records)
            if not run.events.more:
                break
        while True:
            run.console.poll()
            if not run.console.more:
                break
        return run

    def refresh(self, snapshot: MachineSnapshot | None = None) -> list[JobView]:
        if snapshot is None and self.gpu_monitor is not None:
            snapshot = self.gpu_monitor.snapshot()
        views = []
        for job in self.registry.list():
            run = self._run(job)
            alive = job.exit_code is None and job_alive(job, proc_info)
            if alive and run.topology is not None:
                job = self._follow_topology(job, run)
            views.append(self._view(job, run, alive, snapshot))
        self.views = views
        return views

    def _follow_topology(self, job: Job, run: _RunState) -> Job:
        recorded = {p.pid for p in job.processes if p.role == "worker"}
        if recorded != {r["pid"] for r in local_ranks(run.topology)}:
            job = remember_workers(job, run.topology, self.registry)
        if job.queued_stop:
            plan = plan_stop(job, run.topology, self._last_epoch(run))
            if plan.ok:
                send_stop(plan, job, self.registry)
                job = self.registry.get(job.job_id)
        return job

    @staticmethod
    def _last_epoch(run: _RunState) -> int | None:
        return max(run.history) if run.history else None

    def _view(
        self, job: Job, run: _RunState, alive: bool, snapshot: MachineSnapshot | None
    ) -> JobView:
        state = derive_state(job, run, alive)
        history = tuple(run.history[k] for k in sorted(run.history))
        last = history[-1] if history else None
        recent = [p.epoch_time_s for p in history[-RECENT_EPOCHS:] if math.isfinite(p.epoch_time_s)]
        mean_epoch_s = statistics.fmean(recent) if recent else None
        done = last.epoch + 1 if last else (0 if run.num_epochs else None)
        eta = None
        active = state in ("running", "starting", "stopping", "queued")
        if active and mean_epoch_s is not None and run.num_epochs is not None and done is not None:
            eta = max(0, run.num_epochs - done) * mean_epoch_s
        alerts = self._alerts(job, run, state, mean_epoch_s, snapshot)
        console = tuple(run.console.lines)[-CONSOLE_LINES:]
        return JobView(
            job=job,
            state=state,
            epoch=done,
            num_epochs=run.num_epochs,
            train_loss=_finite(last.train_loss) if last else None,
            val_loss=_finite(last.val_loss) if last else None,
            mean_dice=_finite(last.mean_fg_dice) if last else None,
            ema_dice=_finite(last.ema_fg_dice) if last else None,
            it_per_s=_finite(last.iterations_per_s) if last else None,
            eta_s=eta,
            alerts=alerts,
            topology=run.topology,
            history=history,
            console_tail=console,
            exit_code=job.exit_code,
            mean_epoch_time_s=mean_epoch_s,
            last_event_t=run.last_event_t,
        )

    def _alerts(
        self,
        job: Job,
        run: _RunState,
        state: str,
        mean_epoch_s: float | None,
        snapshot: MachineSnapshot | None,
    ) -> tuple[str, ...]:
        alerts = []
        if run.nan_epoch is not None:
            alerts.append(f"NaN loss at epoch {run.nan_epoch}")
        if state == "running" and run.last_event_t is not None and mean_epoch_s is not None:
            quiet_s = time.time() - run.last_event_t
            if quiet_s > max(3 * mean_epoch_s, STALL_MIN_S):
                alerts.append(f"stalled: no event for {quiet_s:.0f} s")
        if run.events.malformed:
            alerts.append(f"{run.events.malformed} malformed event lines")
        if snapshot is not None and not snapshot.simulated and state in ("running", "starting"):
            for gpu in job.gpus:
                reading = snapshot.gpu(gpu) if gpu.isdigit() else None
                if reading is not None and reading.other_users:
                    alerts.append(f"GPU {gpu} also used by {', '.join(reading.other_users)}")
        return tuple(alerts)

    def cross_validation_eta_s(self, views: list[JobView]) -> float | None:
        """Time until every active job is done: queued chains add up, parallel ones overlap."""
        by_id = {v.job.job_id: v for v in views}
        active = [v for v in views if v.state in ("starting", "running", "stopping", "queued")]
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
            if num_epochs and fallback_epoch_s:
                return max(0, num_epochs - (view.epoch or 0)) * fallback_epoch_s
            return None

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
