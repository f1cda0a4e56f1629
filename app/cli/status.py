"""`nnui status`: nnui's jobs, adopted runs and watch-only nnU-Net runs, as a table or JSON."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, cast

from app.cli.common import json_rows, looked_in, machine_snapshot, roots_of
from app.cli.schedule import schedule_notes
from app.services.cross_validation import cross_validation_eta_s
from app.services.jobs import listing as job_list
from app.services.jobs.discovery import RUN_ID_PREFIX as ADOPTED_PREFIX
from app.services.jobs.identity import results_tree, roots_hint, tree_label
from app.services.jobs.registry import PREDICT, Registry
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX
from app.services.jobs.views import JobTracker, JobView
from app.services.jobs.words import human_duration, state_label
from app.services.nnunet.runs import WatchOnlyRun
from app.services.signals.targets import topology_ranks
from trainer.schema.exits import EXIT_OK
from trainer.schema.status import ACTIVE_STATES, State

RECENT_S = 7 * 24 * 3600  # `nnui status` hides jobs that ended longer ago (--all shows them)


def _f(value: float | None, fmt: str = "{:.4f}") -> str:
    return "n/a" if value is None else fmt.format(value)


def view_dict(view: JobView) -> dict[str, Any]:
    job = view.job
    workers = [p.pid for p in job.processes if p.role == "worker"]
    return {
        "id": job.job_id,
        "dataset": job.dataset,
        "configuration": job.configuration,
        "fold": job.fold,
        "mode": job.mode,
        "device": job.device,
        "gpus": job.gpus,
        "simulated": job.simulated,
        "state": view.state,
        "epoch": view.epoch,
        "num_epochs": view.num_epochs,
        "train_loss": view.train_loss,
        "val_loss": view.val_loss,
        "mean_dice": view.mean_dice,
        "ema_dice": view.ema_dice,
        "it_per_s": view.it_per_s,
        "eta_s": view.eta_s,
        "exit_code": view.exit_code,
        "alerts": list(view.alerts),
        "num_invalid_events": view.num_invalid_events,
        "invalid_event_reason": view.invalid_event_reason,
        "after": job.after,
        "queued_stop": job.queued_stop,
        "worker_pids": workers,
        "run_dir": job.run_dir,
        "console_path": job.console_path,  # the current attempt's console file
        "created_at": job.created_at,
        "ended_at": job.ended_at,
        "watch_only": view.watch_only,
        "kind": job.kind,
        "num_cases": view.num_cases,
        "cases_done": view.cases_done,
        "seconds_per_case": view.seconds_per_case,
        "part_id": job.part_id,
        "num_parts": job.num_parts,
        "output_dir": job.output_dir,
        "when_free": job.when_free,
        "priority": job.priority,
        "waiting_reason": job.waiting_reason,
        "retries": job.retries,
        "restarts": list(job.restarts),
        "forgotten": getattr(job, "forgotten_at", None) is not None,  # `nnui forget` (--all)
        "state_text": state_label(view),  # what the table says ("killed by you", ...)
        "final_dice": view.final_dice,  # validation_finished's mean foreground Dice
        "validation_done": view.validation_done,  # while validating: cases done, of
        "validation_cases": view.validation_cases,
        "run_dir_gone": view.run_dir_gone,
        "data_wait_share": view.data_wait_share,  # newest epoch's share of waiting for data
        "slurm_state": view.slurm_state,  # the user's SLURM job (squeue), else null
        "slurm_job": view.job.env.get("SLURM_JOB_ID") if view.slurm_state else None,
    }


def progress_cells(view: JobView) -> tuple[str, str, str]:
    """(MODE, EPOCH, IT/S) cells: a prediction shows its part, cases and s/case there."""
    job = view.job
    if job.kind != PREDICT:
        epoch = "n/a" if view.epoch is None else f"{view.epoch}/{view.num_epochs or '?'}"
        return job.mode, epoch, _f(view.it_per_s, "{:.1f}")
    part = f"predict {(job.part_id or 0) + 1}/{job.num_parts or 1}"
    cases = "n/a" if view.num_cases is None else f"{view.cases_done}/{view.num_cases} cases"
    return part, cases, _f(view.seconds_per_case, "{:.1f} s/case")


def watch_only_dict(view: JobView) -> dict[str, Any]:
    """A watch-only row: the job keys (state, epoch, losses, ETA ...) plus what only an
    nnU-Net run nnui did not start has (owner, pids, trainer, per-class Dice, its log)."""
    run = cast(WatchOnlyRun, view.watch)  # an adopted run's row is adopted_dict's
    assert run is not None
    row = view_dict(view)
    row.update(
        {
            "watch_only": True,
            "owner": run.owner,
            "uid": run.uid,
            "pid": run.pid,
            "pids": list(run.pids),
            "worker_pids": [run.pid],
            "trainer": run.trainer,
            "plans": run.plans,
            "gpu_source": run.gpu_source,
            "phase": run.phase,
            "num_epochs_source": run.num_epochs_source,
            "dice_per_class": list(run.dice_per_class),
            "class_names": list(run.class_names),
            "lr": run.lr,
            "epoch_time_s": run.epoch_time_s,
            "median_epoch_time_s": run.median_epoch_time_s,
            "final_dice": run.final_dice,
            "sigusr1_handler": run.sigusr1_handler,
            "environ_readable": run.environ_readable,
            "log_path": run.log_path,
        }
    )
    return row


def adopted_dict(view: JobView) -> dict[str, Any]:
    """An adopted row: the job keys plus who started it, how, and its processes by role."""
    run = view.adopted
    assert run is not None
    row = view_dict(view)
    workers = [p for p in view.job.processes if p.role == "worker"]
    ranks = {r.get("pid"): r.get("global_rank") for r in topology_ranks(view.topology)}
    row.update(
        {
            "adopted": True,
            "watch_only": not run.own,
            "owner": run.owner,
            "uid": run.uid,
            "launcher": run.launcher,
            "num_ranks": run.world_size,
            "top_pid": run.top_pid,
            "processes": [
                {
                    "pid": m.pid,
                    "role": m.role,
                    "rank": m.rank if m.rank is not None else ranks.get(m.pid),
                }
                for m in run.members
            ],
            "worker_pids": [p.pid for p in workers],
            "run_dir_source": run.run_dir_source,
            "slurm_job": run.slurm_job,
            "slurm_step": run.slurm_step,
            "argv": list(run.argv),
        }
    )
    return row


def _row_dict(view: JobView) -> dict[str, Any]:
    if view.adopted is not None:
        return adopted_dict(view)
    if view.watch is not None:
        return watch_only_dict(view)
    adopted = view.job.job_id.startswith((ADOPTED_PREFIX, SLURM_ID_PREFIX))
    return {**view_dict(view), "adopted": adopted}


def watch_only_table(views: list[JobView]) -> str:
    header = ("ID", "OWNER", "DATASET", "CONFIG", "FOLD", "TRAINER", "GPUS", "EPOCH", "TRAIN",
              "VAL", "DICE(EMA)", "EPOCH-TIME", "ETA")  # fmt: skip
    rows = [header]
    for v in views:
        run = v.watch
        assert run is not None
        job = v.job  # an adopted run of another user is a WatchOnlyRun look-alike
        gpus = ",".join(run.gpus) or ("cpu" if job.device == "cpu" else "n/a")
        epoch = "n/a" if v.epoch is None else f"{v.epoch}/{v.num_epochs or '?'}"
        rows.append(
            (
                job.job_id, run.owner, job.dataset, job.configuration, job.fold, run.trainer,
                gpus, epoch, _f(v.train_loss), _f(v.val_loss), _f(v.ema_dice, "{:.3f}"),
                _f(v.mean_epoch_time_s, "{:.1f} s"), human_duration(v.eta_s),
            )
        )  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["watch-only runs (other users' or stock nnU-Net; never signalled by nnui):"]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def _with_tree(row: dict[str, Any], view: JobView, default: Path) -> dict[str, Any]:
    """The row's identity: its results tree, and the tree's short name when not the default."""
    tree = results_tree(view.job.run_dir or "")
    return {**row, "results": tree or None, "tree": tree_label(tree, default) or None}


def dataset_cell(job: Any, default: Path | None) -> str:
    """The dataset, with the short name of its tree when that is not the default one."""
    label = tree_label(results_tree(job.run_dir or ""), default)
    return f"{job.dataset} [{label}]" if label else job.dataset


def status_table(views: list[JobView], cv_eta_s: float | None, default: Path | None = None) -> str:
    header = ("ID", "DATASET", "CONFIG", "FOLD", "MODE", "GPUS", "STATE", "EPOCH", "TRAIN",
              "VAL", "DICE(EMA)", "IT/S", "ETA", "EXIT")  # fmt: skip
    rows = [header]
    for v in views:
        job = v.job
        gpus = ",".join(job.gpus) or "cpu"
        if job.simulated:
            gpus += " (sim)"
        mode, epoch, speed = progress_cells(v)
        rows.append(
            (
                job.job_id, dataset_cell(job, default), job.configuration, job.fold, mode, gpus,
                state_label(v),
                epoch, _f(v.train_loss), _f(v.val_loss), _f(v.ema_dice, "{:.3f}"),
                speed, human_duration(v.eta_s),
                "" if v.exit_code is None else str(v.exit_code),
            )
        )  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    for v in views:
        lines.extend(f"  {v.job.job_id}: {note}" for note in schedule_notes(v))
        if v.adopted is not None:
            run = v.adopted
            lines.append(f"  {v.job.job_id}: started outside nnui by {run.owner} ({run.launcher}, "
                         f"{run.world_size} rank{'s' if run.world_size > 1 else ''})")  # fmt: skip
        if v.slurm_state is not None:
            lines.append(f"  {v.job.job_id}: SLURM job {v.job.env.get('SLURM_JOB_ID')} "
                         f"{v.slurm_state}")  # fmt: skip
        if v.final_dice is not None:
            lines.append(f"  {v.job.job_id}: final validation Dice {v.final_dice:.3f}")
        for alert in v.alerts:
            lines.append(f"! {v.job.job_id}: {alert}")
        if v.state == State.FAILED and v.console_tail:
            lines.append(f"  {v.job.job_id} console (last lines):")
            lines.extend(f"    {line}" for line in v.console_tail[-5:])
    if cv_eta_s is not None:
        lines.append(f"cross-validation ETA: {human_duration(cv_eta_s)}")
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _watch_only_views(
    options: argparse.Namespace, tracker: JobTracker, roots: list[Path]
) -> list[JobView]:
    """Runs nnui did not start, found from /proc wherever they run and, once ended, under
    the trees looked in (after tracker.refresh())."""
    views = tracker.refresh_watch_only(roots)
    unknown = [v for v in views if v.watch and not v.watch.gpus and v.job.device == "cuda"]
    if unknown and options.simulate_gpus is None:  # NVML's process lists say which GPU
        views = tracker.refresh_watch_only(roots, snapshot=machine_snapshot(options))
    return views


def _on_real_gpus(view: JobView) -> bool:
    job = view.job
    return (
        view.state in ACTIVE_STATES
        and job.device == "cuda"
        and not job.simulated
        and bool(job.gpus)
    )


def cmd_status(options: argparse.Namespace, registry: Registry) -> int:
    tracker = JobTracker(registry, include_forgotten=options.all)  # see `nnui forget`
    views = tracker.refresh()
    if any(_on_real_gpus(v) for v in views):  # one NVML read: a lost or shared GPU is an alert
        views = tracker.refresh(machine_snapshot(options))
    roots = looked_in(options, [v.job for v in views], registry.state_dir)
    default = roots_of(options).results
    if not options.all:
        cutoff = time.time() - RECENT_S
        views = [v for v in views if v.job.ended_at is None or v.job.ended_at >= cutoff]
    watched = _watch_only_views(options, tracker, roots)
    adopted = [v for v in watched if v.watch is None or v.adopted is not None]
    if not options.all:
        cutoff = time.time() - RECENT_S
        adopted = [v for v in adopted if v.job.ended_at is None or v.job.ended_at >= cutoff]
    views = [*views, *[v for v in adopted if not v.watch_only]]
    watched = [v for v in watched if v.watch_only and (v.adopted is None or v in adopted)]
    if options.json:
        rows = [_with_tree(_row_dict(v), v, default) for v in [*views, *watched]]
        print(json_rows(_json_safe(row) for row in rows))
        return EXIT_OK
    if not views and not watched:
        # An unreadable job file is not "no jobs": the warning below names it.
        print("no readable jobs" if registry.list_problems else "no jobs")
        print(roots_hint(roots))
        return EXIT_OK
    if views:
        # One row per run folder (a resume continues its row); --all: every job, grouped.
        arranged = job_list.arrange(views, collapse=not options.all)
        print(status_table(arranged, cross_validation_eta_s(views), default))
    if watched:
        print(watch_only_table(watched))
    return EXIT_OK
