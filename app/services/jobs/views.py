"""What the UI shows about each job: registry + run folder + live processes, incrementally.

`JobTracker.refresh()` keeps one reader per job file, so a refresh reads only appended
bytes. `JobTracker.refresh_watch_only()` adds the nnU-Net runs nnui did not start
(nnunet/runs.py) as views with `watch_only=True`: never stopped, resumed or killed.
It only reads: it never writes the registry and never signals (docs/contract.md) — the
job's supervisor records the workers and delivers a stop queued before they were up.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from app.services.jobs.adopted import EndedScan, adopted_job
from app.services.jobs.alerts import job_alerts
from app.services.jobs.curves import EpochPoint, RunningPoint
from app.services.jobs.discovery import AdoptedRun, discover, is_related
from app.services.jobs.events import JobEvents
from app.services.jobs.job_state import derive_state, run_dir_gone
from app.services.jobs.known_trees import TreeMemory
from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import PREDICT, Job, ProcessRecord, Registry
from app.services.jobs.run_state import CONSOLE_LINES, RunState, restored, summary
from app.services.jobs.slurm_jobs import (
    SLURM_ID_PREFIX,
    SlurmJob,
    SlurmWatcher,
    trains_in,
    with_job,
)
from app.services.jobs.summaries import SummaryCache, job_key
from app.services.machine.gpus import GpuMonitor, MachineSnapshot
from app.services.machine.procs import ProcRow, proc_info, process_table
from app.services.nnunet.log import STARTING_PHASE, EpochStats
from app.services.nnunet.runs import NnunetRunWatcher, WatchOnlyRun, is_train_cmdline
from app.services.tail import TextTail
from trainer.schema.status import ACTIVE_STATES, ENDED_STATES, State

RECENT_EPOCHS = 5
ENDED_RECHECK_S = 30.0  # an ended run's unchanged job: its view is made again this often
# Ended in these, a job's console is not shown by a row or the CLI (failed ones show its
# last lines): it is read when the job's detail opens.
QUIET_CONSOLE_STATES = frozenset({State.FINISHED, State.STOPPED, State.KILLED})

__all__ = ["JobTracker", "JobView"]


@dataclass(frozen=True)
class JobView:
    job: Job
    state: State
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
    num_invalid_events: int = 0  # lines of events.jsonl skipped as invalid (never fatal)
    invalid_event_reason: str | None = None  # why the last one was skipped
    watch_only: bool = False  # an nnU-Net run nnui did not start (`watch`): no actions
    watch: WatchOnlyRun | AdoptedRun | None = None  # owner, pids, trainer, Dice, log path
    # A prediction job (job.kind == "predict"): cases of its part done / in all, s per case.
    num_cases: int | None = None
    cases_done: int | None = None
    seconds_per_case: float | None = None
    running_loss: tuple[RunningPoint, ...] = ()  # train_loss_running points, in file order
    final_dice: float | None = None  # validation_finished's mean foreground Dice
    validation_done: int | None = None  # final validation: cases done (while validating)
    validation_cases: int | None = None  # ... of all the validation cases
    run_dir_gone: bool = False  # the job's results folder no longer exists
    # checkpoint_saved events of every run in the folder: (kind, epochs completed), newest
    # save of each kind (what a --c resume can continue from, if the file is still there).
    checkpoints: tuple[tuple[str, int], ...] = ()
    data_wait_share: float | None = None  # newest epoch: share of step time spent waiting
    class_names: tuple[str, ...] = ()  # names of dice_per_class's entries (run_started)
    # A run nnui did not launch (discovery.py); watch_only when it is another user's.
    adopted: AdoptedRun | None = None
    slurm_state: str | None = None  # the user's SLURM job: PENDING, RUNNING ... (squeue)
    started_t: float | None = None  # the job's own first run_started (GPU-hours count from it)
    # An ended run's view: `history` and `running_loss` hold only the newest points (the
    # row's); JobTracker.want_curves() makes the next views whole.
    partial_history: bool = False
    stop_requested_at: float | None = None  # the run's first stop_requested (its own clock)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def training_eta_s(
    num_remaining: int, epoch_s: float, last_epoch_t: float | None, now: float
) -> float | None:
    """Seconds until the remaining epochs are done, counting down between epoch ends (from
    the newest epoch_ended's time); never 0 while an epoch remains (an overrunning epoch
    still leaves the ones after it, and at least a second)."""
    if num_remaining <= 0:
        return None
    total = num_remaining * epoch_s
    if last_epoch_t is None:
        return total
    elapsed = max(0.0, now - last_epoch_t)
    return max(total - elapsed, (num_remaining - 1) * epoch_s, 1.0)


def _watch_point(stats: EpochStats) -> EpochPoint:
    return EpochPoint(
        epoch=stats.epoch, train_loss=stats.train_loss, val_loss=stats.val_loss,
        mean_fg_dice=stats.mean_fg_dice, ema_fg_dice=stats.ema_fg_dice, lr=stats.lr,
        epoch_time_s=stats.epoch_time_s, iterations_per_s=math.nan,
        dice_per_class=tuple(stats.dice_per_class),
    )  # fmt: skip


def watch_only_view(run: WatchOnlyRun, console_tail: tuple[str, ...] = ()) -> JobView:
    """A watch-only run as a job row: a Job built from its process (never in the registry;
    its job_id is the run id `nnunet:<pid>`, its run_dir the fold folder, its console the
    nnU-Net training log)."""
    args = run.args
    job = Job(
        job_id=run.run_id, created_at=run.start_time or 0.0, dataset=run.dataset,
        configuration=args.configuration, fold=args.fold,
        mode="spawn" if args.num_gpus > 1 else "single", device=args.device,
        gpus=list(run.gpus), simulated=False, argv=list(run.cmdline), env={},
        run_dir=run.fold_dir, console_path=run.log_path,
        processes=[ProcessRecord(run.pid, run.start_time or 0.0, "trainer", None,
                                 run.start_ticks)],
    )  # fmt: skip
    it_per_s = None
    if run.iterations_per_epoch and run.epoch_time_s:
        it_per_s = run.iterations_per_epoch / run.epoch_time_s
    return JobView(
        job=job, state=State.STARTING if run.phase == STARTING_PHASE else State.RUNNING,
        epoch=run.epoch, num_epochs=run.num_epochs, train_loss=run.train_loss,
        val_loss=run.val_loss, mean_dice=run.mean_fg_dice, ema_dice=run.ema_fg_dice,
        it_per_s=it_per_s, eta_s=run.eta_s, alerts=(), topology=None,
        history=tuple(_watch_point(s) for s in run.history), console_tail=console_tail,
        exit_code=None, mean_epoch_time_s=run.median_epoch_time_s,
        last_event_t=run.log_mtime, watch_only=True, watch=run, class_names=run.class_names,
    )  # fmt: skip


def slurm_view(entry: SlurmJob, seen_at: float) -> JobView:
    """A SLURM training with no process on this machine: pending, or on another node."""
    args = entry.args
    where = f" on {entry.node}" if entry.node else ""
    job = Job(
        job_id=f"{SLURM_ID_PREFIX}{entry.job_id}", created_at=seen_at, dataset=args.dataset,
        configuration=args.configuration, fold=args.fold, mode="single", device=args.device,
        gpus=[], simulated=False, argv=[], env={"SLURM_JOB_ID": entry.job_id}, run_dir="",
        console_path=os.devnull, waiting_reason=f"SLURM {entry.state} ({entry.reason}){where}",
        note=f"SLURM job {entry.job_id} ({entry.name})",
    )  # fmt: skip
    state = State.QUEUED if entry.state == "PENDING" else State.STARTING
    return JobView(job=job, state=state, epoch=None, num_epochs=None, train_loss=None,
                   val_loss=None, mean_dice=None, ema_dice=None, it_per_s=None, eta_s=None,
                   alerts=(), topology=None, history=(), console_tail=(), exit_code=None,
                   slurm_state=entry.state)  # fmt: skip


class JobTracker:
    def __init__(
        self,
        registry: Registry,
        gpu_monitor: GpuMonitor | None = None,
        include_forgotten: bool = True,
    ) -> None:
        self.registry = registry
        # False: jobs marked by `nnui forget` are left out (and their files never read).
        self.include_forgotten = include_forgotten
        self.gpu_monitor = gpu_monitor
        self._runs: dict[str, RunState] = {}
        self.views: list[JobView] = []
        self._watcher = NnunetRunWatcher()
        self._watch_consoles: dict[str, TextTail] = {}
        self.watch_only: list[JobView] = []
        self.adopted: list[JobView] = []
        self._adopted: dict[str, tuple[Job, AdoptedRun]] = {}  # seen live: kept once ended
        # What was read of each run, kept across nnui's starts (summaries.py).
        self._summaries = SummaryCache(getattr(registry, "state_dir", None))
        self._want_curves: set[str] = set()  # jobs whose whole curves a screen shows
        self._ended_views: dict[str, tuple[Job, float, JobView]] = {}  # _ended_view()
        self._ended = EndedScan(self._summaries)
        self._slurm = SlurmWatcher()
        self._slurm_seen: dict[str, float] = {}  # SLURM job id -> first seen (its row's age)
        self.problems: list[str] = []  # job files the newest refresh() could not read
        # The trees runs started by hand were seen in (found again once they ended).
        self.trees = TreeMemory(getattr(registry, "state_dir", None))

    def refresh_watch_only(
        self,
        results_roots: list[Path],
        snapshot: MachineSnapshot | None = None,
        procs: list[ProcRow] | None = None,
    ) -> list[JobView]:
        """Views of the runs nnui did not start: stock nnU-Net runs (watch-only) and adopted
        nnui-train runs (call after refresh(): the folders of nnui's own active jobs are
        left out). One /proc reading serves both. Reads only, like refresh()."""
        active = [v.job.run_dir for v in self.views if v.state in ACTIVE_STATES]
        if procs is None:
            procs = process_table(detail=lambda _: True,
                                  roots=lambda c: is_train_cmdline(c) or is_related(c))  # fmt: skip
        runs = self._watcher.refresh(results_roots, procs, snapshot, exclude_dirs=active)
        consoles = {}
        for run in runs:
            tail = self._watch_consoles.get(run.log_path) or TextTail(Path(run.log_path))
            tail.poll()
            consoles[run.log_path] = tail
        self._watch_consoles = consoles
        self.watch_only = [
            watch_only_view(r, tuple(consoles[r.log_path].lines)[-CONSOLE_LINES:]) for r in runs
        ]
        # The folders of live stock nnU-Net runs are not "ended unseen" either.
        busy = [*active, *(r.fold_dir for r in runs)]
        self.adopted = self.refresh_adopted(results_roots, procs, snapshot, busy)
        # What the board shows between two readings of /proc (tui.py reads `watch_only`).
        self.watch_only = [*self.watch_only, *self.adopted]
        return self.watch_only

    def refresh_adopted(
        self,
        results_roots: list[Path],
        procs: list[ProcRow],
        snapshot: MachineSnapshot | None,
        active: list[str],
    ) -> list[JobView]:
        """Adopted runs: live ones, those seen live that ended since, and those that ended
        while nnui was not looking (their folder's newest run, claimed by no job)."""
        live = discover(results_roots, procs, exclude_dirs=active)
        self.trees.note(run.run_dir for run in live if run.run_dir)  # found again once ended
        live_ids = {run.run_id for run in live}
        for run in live:
            self._adopted[run.run_id] = (adopted_job(run, snapshot), run)
        for run_id, (job, _) in list(self._adopted.items()):
            if run_id not in live_ids and not job.run_dir:
                del self._adopted[run_id]  # gone, and no folder to say how it ended
        views = [self._adopted_view(job, run, job.job_id in live_ids, snapshot)
                 for job, run in self._adopted.values()]  # fmt: skip
        folders = {job.run_dir for job, _ in self._adopted.values() if job.run_dir}
        jobs = self.registry.list(copies=False)  # refresh()'s list while the folder is as it was
        for job in self._ended.runs(results_roots, jobs, folders | set(active)):
            views.append(self._ended_view(job) or self._live_view(job, snapshot, False))
        self._summaries.save_if_due()
        return self._with_slurm(views)

    def _with_slurm(self, views: list[JobView]) -> list[JobView]:
        """The user's SLURM trainings: the state on the run found here, else a row of its own
        (pending, or running on another node)."""
        slurm = self._slurm.jobs()
        by_job = {
            v.adopted.slurm_job: i
            for i, v in enumerate(views)
            if v.adopted is not None and v.adopted.slurm_job and v.state in ACTIVE_STATES
        }
        for entry in slurm:
            index = by_job.get(entry.job_id)
            if index is not None:
                views[index] = with_job(views[index], entry, remote=False)
                continue
            # On another node: the row of its run folder (the shared results tree), if any.
            index = next((i for i, v in enumerate(views) if v.adopted is None
                          and v.slurm_state is None and trains_in(entry.args, v.job.run_dir)),
                         None)  # fmt: skip
            if index is not None:
                views[index] = with_job(views[index], entry, remote=True)
                continue
            seen = self._slurm_seen.setdefault(entry.job_id, time.time())
            views.append(slurm_view(entry, seen))
        self._slurm_seen = {k: v for k, v in self._slurm_seen.items()
                            if k in {e.job_id for e in slurm}}  # fmt: skip
        return views

    def _adopted_view(
        self, job: Job, run: AdoptedRun, alive: bool, snapshot: MachineSnapshot | None
    ) -> JobView:
        if not job.run_dir:  # another user's run under an unwatched root: processes only
            view = JobView(job=job, state=State.STARTING, epoch=None, num_epochs=None,
                           train_loss=None, val_loss=None, mean_dice=None, ema_dice=None,
                           it_per_s=None, eta_s=None, alerts=(), topology=None, history=(),
                           console_tail=(), exit_code=None)  # fmt: skip
        else:
            state = self._run(job)
            if not alive and job.ended_at is None:
                job.ended_at = state.last_event_t or time.time()
            view = self._view(job, state, alive, snapshot)
        own = run.own
        return replace(view, adopted=run, watch_only=not own, watch=None if own else run)

    def want_curves(self, job_ids: Iterable[str]) -> None:
        """These jobs' views carry their whole curves from the next refresh on (an ended
        run's view otherwise holds only its newest epochs): a detail screen opened."""
        self._want_curves.update(job_ids)

    def _run(self, job: Job) -> RunState:
        run = self._runs.get(job.job_id)
        if run is None or (run.compact and job.job_id in self._want_curves):
            run = self._runs[job.job_id] = self._new_run(job)
        if run.console.path != Path(job.console_path):  # a restart: the new attempt's file
            run.follow_console(Path(job.console_path))
        run.absorb(run.events.poll(job))
        if run.compact:
            key = job_key(job.job_id, job.run_dir, job.created_at, job.ended_at)
            self._summaries.put(key, summary(run))
        return run

    def _new_run(self, job: Job) -> RunState:
        """A compact state for a job that ended (from the cache when it holds one), else a
        whole one (a live job, or one whose curves are shown)."""
        console = TextTail(Path(job.console_path))
        ended = job.ended_at is not None or job.exit_code is not None
        if not ended or job.kind == PREDICT or job.job_id in self._want_curves:
            return RunState(JobEvents(job.run_dir), console)
        held = self._summaries.get(job_key(job.job_id, job.run_dir, job.created_at, job.ended_at))
        run = restored(held, job.run_dir, console) if held is not None else None
        return run or RunState(JobEvents(job.run_dir), console, compact=True)

    def refresh(self, snapshot: MachineSnapshot | None = None) -> list[JobView]:
        """Views of every job. Reads only: no registry write, no signal (docs/contract.md)."""
        if snapshot is None and self.gpu_monitor is not None:
            snapshot = self.gpu_monitor.snapshot()
        views = []
        for job in self.registry.list(copies=False):  # views only read their jobs
            if job.forgotten_at is not None and not self.include_forgotten:
                continue
            views.append(self._ended_view(job) or self._live_view(job, snapshot))
        self.views = views
        self.problems = list(getattr(self.registry, "list_problems", ()))
        self._summaries.save_if_due()
        return views

    def _ended_view(self, job: Job) -> JobView | None:
        """The view of an ended job whose record did not change, for ENDED_RECHECK_S after it
        was made: a lab's hundreds of finished runs cost nothing per refresh (the view of a
        job that ended takes nothing from the clock, and its events end with its run)."""
        held = self._ended_views.get(job.job_id)
        if held is None or held[0] is not job or job.job_id in self._want_curves:
            return None
        return held[2] if time.monotonic() < held[1] else None

    def _live_view(
        self, job: Job, snapshot: MachineSnapshot | None, alive: bool | None = None
    ) -> JobView:
        run = self._run(job)
        if alive is None:
            alive = job.exit_code is None and job_alive(job, proc_info)
        view = self._view(job, run, alive, snapshot)
        if run.compact and not alive and view.state in ENDED_STATES:
            held = self._ended_views.get(job.job_id)
            if held is not None and held[2] == view:
                # The recheck found nothing new: the very same view object, so the board,
                # which redraws a row only for a new view, does not rebuild hundreds of rows.
                view = held[2]
            self._ended_views[job.job_id] = (job, time.monotonic() + ENDED_RECHECK_S, view)
        else:
            self._ended_views.pop(job.job_id, None)
        return view

    def _view(
        self, job: Job, run: RunState, alive: bool, snapshot: MachineSnapshot | None
    ) -> JobView:
        state = derive_state(job, run, alive)
        if state not in QUIET_CONSOLE_STATES or job.job_id in self._want_curves:
            run.poll_console()
        history = run.history_points()
        last = history[-1] if history else None
        recent = [p.epoch_time_s for p in history[-RECENT_EPOCHS:] if math.isfinite(p.epoch_time_s)]
        mean_epoch_s = statistics.fmean(recent) if recent else None
        done = last.epoch + 1 if last else (0 if run.num_epochs else None)
        eta = self._eta_s(job, run, state, statistics.median(recent) if recent else None, done)
        alerts = self._alerts(job, run, state, mean_epoch_s, snapshot)
        console = run.console_tail()
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
            num_invalid_events=run.events.num_invalid,
            invalid_event_reason=run.events.tail.last_invalid_reason,
            num_cases=run.cases.num_cases,
            cases_done=run.cases.num_done,
            seconds_per_case=run.cases.seconds_per_case,
            running_loss=run.running_points(),
            final_dice=run.final_dice,
            validation_done=run.validation[0] if run.validation else None,
            validation_cases=run.validation[1] if run.validation else None,
            run_dir_gone=run_dir_gone(job, run),
            checkpoints=tuple(run.checkpoints.items()),
            data_wait_share=_finite(last.data_wait_share) if last else None,
            class_names=run.class_names,
            started_t=run.started_t,
            partial_history=run.compact,
            stop_requested_at=run.stop_requested_t,
        )

    def _eta_s(
        self, job: Job, run: RunState, state: State, epoch_s: float | None, done: int | None
    ) -> float | None:
        if state not in ACTIVE_STATES:
            return None
        if job.kind == PREDICT:
            return run.cases.eta_s()
        now = time.time()
        if state == State.VALIDATING and run.validation and run.validation_t is not None:
            num_done, num_cases = run.validation
            if num_done <= 0:
                return None  # no case done yet: no honest figure
            per_case_s = max(0.0, now - run.validation_t) / num_done
            return max(1.0, (num_cases - num_done) * per_case_s)
        if epoch_s is None or run.num_epochs is None or done is None:
            return None
        return training_eta_s(run.num_epochs - done, epoch_s, run.last_epoch_t, now)

    def _alerts(
        self,
        job: Job,
        run: RunState,
        state: State,
        mean_epoch_s: float | None,
        snapshot: MachineSnapshot | None,
    ) -> tuple[str, ...]:
        return job_alerts(job, run, state, snapshot)
