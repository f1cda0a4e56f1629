"""The headless subcommands (status, stop, resume, kill, launch): the TUI's twin for scripts.

Same services, same safety checks, same registry as the TUI. Output on stdout, one-line
`error: ...` on stderr; exit codes as documented in app/main.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app import cli_adopted, cli_cv, cli_history
from app.cli_schedule import cmd_priority, cmd_watch, schedule_notes, schedule_of
from app.services.jobs import listing as job_list
from app.services.jobs.discovery import RUN_ID_PREFIX as ADOPTED_PREFIX
from app.services.jobs.liveness import between_attempts
from app.services.jobs.registry import PREDICT, Job, Registry
from app.services.jobs.simulated_load import simulated_gpu_load
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX
from app.services.jobs.views import JobTracker, JobView
from app.services.jobs.words import human_duration, resume_from, state_label
from app.services.launch import busy_gpus, catalog, launcher, prediction
from app.services.launch import request as launch_request
from app.services.launch.fold_claims import ClaimRefused
from app.services.machine.gpus import GpuMonitor, MachineSnapshot
from app.services.machine.procs import proc_info
from app.services.nnunet.runs import RUN_ID_PREFIX, WatchOnlyRun, is_train_cmdline, stop_refusal
from app.services.signals.send import kill as kill_job
from app.services.signals.send import send_stop
from app.services.signals.targets import kill_plan, plan_stop, topology_ranks
from trainer.schema import (
    ACTIVE_STATES,
    ENDED_STATES,
    DatasetNotFound,
    Roots,
    find_dataset,
    resolve_roots,
)

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3
RECENT_S = 7 * 24 * 3600  # `nnui status` hides jobs that ended longer ago (--all shows them)


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def roots_of(options: argparse.Namespace) -> Roots:
    return resolve_roots(options.raw, options.preprocessed, options.results)


Handler = Callable[[argparse.Namespace, Registry], int]


def run(options: argparse.Namespace, more: dict[str, Handler] | None = None) -> int:
    """The subcommand's handler; `more` adds those of other modules (cli_predict.py)."""
    registry = Registry()
    handlers = {
        "status": cmd_status,
        "stop": cmd_stop,
        "resume": cmd_resume,
        "kill": cmd_kill,
        "launch": cmd_launch,
        "export": cli_history.cmd_export,
        "forget": cli_history.cmd_forget,
        "watch": cmd_watch,
        "priority": cmd_priority,
        "cv": cli_cv.cmd_cv,
        **(more or {}),
    }
    code = handlers[options.command](options, registry)
    for problem in registry.problems:
        print(f"warning: {problem}", file=sys.stderr)
    return code


# ---- formatting ------------------------------------------------------------------------


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
    run = view.watch
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


def status_table(views: list[JobView], cv_eta_s: float | None) -> str:
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
                job.job_id, job.dataset, job.configuration, job.fold, mode, gpus, state_label(v),
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
        if v.state == "failed" and v.console_tail:
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


# ---- commands --------------------------------------------------------------------------


def _watch_only_views(options: argparse.Namespace, tracker: JobTracker) -> list[JobView]:
    """nnU-Net runs nnui did not start, under the results root (after tracker.refresh())."""
    roots = [roots_of(options).results]
    views = tracker.refresh_watch_only(roots)
    unknown = [v for v in views if v.watch and not v.watch.gpus and v.job.device == "cuda"]
    if unknown and options.simulate_gpus is None:  # NVML's process lists say which GPU
        views = tracker.refresh_watch_only(roots, snapshot=_snapshot(options))
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
        views = tracker.refresh(_snapshot(options))
    if not options.all:
        cutoff = time.time() - RECENT_S
        views = [v for v in views if v.job.ended_at is None or v.job.ended_at >= cutoff]
    watched = _watch_only_views(options, tracker)
    adopted = [v for v in watched if v.watch is None or v.adopted is not None]
    if not options.all:
        cutoff = time.time() - RECENT_S
        adopted = [v for v in adopted if v.job.ended_at is None or v.job.ended_at >= cutoff]
    views = [*views, *[v for v in adopted if not v.watch_only]]
    watched = [v for v in watched if v.watch_only and (v.adopted is None or v in adopted)]
    if options.json:
        rows = [_row_dict(v) for v in [*views, *watched]]
        print(json.dumps([_json_safe(row) for row in rows], indent=1))
        return EXIT_OK
    if not views and not watched:
        # An unreadable job file is not "no jobs": the warning below names it.
        print("no readable jobs" if registry.list_problems else "no jobs")
        return EXIT_OK
    if views:
        # One row per run folder (a resume continues its row); --all: every job, grouped.
        rows = job_list.arrange(views, collapse=not options.all)
        print(status_table(rows, tracker.cross_validation_eta_s(views)))
    if watched:
        print(watch_only_table(watched))
    return EXIT_OK


def _view_of(registry: Registry, text: str) -> tuple[JobView | None, str | None]:
    try:
        job = registry.resolve(text)
    except KeyError as problem:
        return None, problem.args[0]
    views = JobTracker(registry).refresh()
    return next(v for v in views if v.job.job_id == job.job_id), None


def _confirm(question: str) -> bool:
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def _watch_only_run(
    options: argparse.Namespace, registry: Registry, text: str
) -> WatchOnlyRun | None:
    pid_text = text.removeprefix(RUN_ID_PREFIX)
    if not pid_text.isdigit():
        return None
    tracker = JobTracker(registry)
    tracker.refresh()
    views = tracker.refresh_watch_only([roots_of(options).results])
    return next((v.watch for v in views if v.watch and v.watch.pid == int(pid_text)), None)


def _refuse_watch_only(options: argparse.Namespace, registry: Registry, text: str) -> int | None:
    """Exit code of `nnui stop` for a watch-only run (always refused), None if `text` is none.

    nnui never signals a process it did not start: stock nnU-Net has no SIGUSR1 handler
    and dies of the signal (the reason proves it from SigCgt)."""
    run = _watch_only_run(options, registry, text)
    if run is None:
        pid_text = text.removeprefix(RUN_ID_PREFIX)
        info = proc_info(int(pid_text)) if pid_text.isdigit() else None
        if info is None or not is_train_cmdline(info.cmdline):
            return None
        return error(  # an nnU-Net training whose log is not (yet) under the results root
            f"refused to stop {text}: pid {info.pid} is an nnU-Net training nnui did not start "
            f"(watch-only); nnui never signals it; nothing sent",
            EXIT_REFUSED,
        )
    refusal = stop_refusal(run)
    code = error(f"refused to stop {run.run_id}: {refusal.reason}", EXIT_REFUSED)
    for hint in refusal.hints:
        print(hint, file=sys.stderr)
    return code


def _adopted(options: argparse.Namespace, registry: Registry, action: str) -> int | None:
    """Exit code of `action` on an adopted run (`run:PID`, or a pid of one), None: not one."""
    text = options.job
    if not (cli_adopted.is_adopted_id(text) or text.isdigit() or text.startswith(SLURM_ID_PREFIX)):
        return None
    if text.isdigit():
        try:
            registry.resolve(text)
            return None  # a job of nnui's own
        except KeyError:
            pass
    view = cli_adopted.find(options, registry, text)
    if view is None:
        if text.isdigit():
            return None
        return error(f"no run {text!r} on this machine (see nnui status)", EXIT_USAGE)
    return getattr(cli_adopted, action)(options, registry, view)


def cmd_stop(options: argparse.Namespace, registry: Registry) -> int:
    code = _adopted(options, registry, "stop")
    if code is not None:
        return code
    if options.job.startswith(RUN_ID_PREFIX):
        code = _refuse_watch_only(options, registry, options.job)
        if code is None:
            return error(f"no watch-only nnU-Net run {options.job!r} (see nnui status)", EXIT_USAGE)
        return code
    view, problem = _view_of(registry, options.job)
    if view is None:
        code = _refuse_watch_only(options, registry, options.job)  # a bare pid
        return error(problem or "unknown job", EXIT_USAGE) if code is None else code
    job = view.job
    if view.state in ENDED_STATES:
        print(f"nothing to do: job {job.job_id} is {view.state}")
        return EXIT_NOTHING
    waiting = view.state == "queued" and between_attempts(job)  # for GPUs, or to restart
    plan = plan_stop(job, None if waiting else view.topology, view.epoch)
    if plan.queued:
        if job.queued_stop:
            print(f"nothing to do: a stop for job {job.job_id} is already queued")
            return EXIT_NOTHING
        registry.update(job.job_id, queued_stop=True)
        print(f"stop queued for job {job.job_id}: {plan.reason}")
        return EXIT_OK
    if not plan.ok:
        send_stop(plan, job, registry)  # records the refusal
        return error(f"refused to stop {job.job_id}: {plan.reason}", EXIT_REFUSED)
    where = f"epoch {plan.epoch if plan.epoch is not None else 'n/a'}"
    if job.kind == PREDICT:
        where = f"case {view.cases_done if view.cases_done is not None else 'n/a'}/" + (
            f"{view.num_cases if view.num_cases is not None else '?'}"
        )
    print(f"job {job.job_id} ({where}): SIGUSR1 to")
    for target in plan.targets:
        print(f"  pid {target.pid}  rank {target.rank}  local rank {target.local_rank}  "
              f"device {target.device}  host {target.host}")  # fmt: skip
    if plan.already_signalled:
        print("nothing to do: these workers already received the stop; they end after this "
              f"{'case' if job.kind == PREDICT else 'epoch'}")  # fmt: skip
        return EXIT_NOTHING
    if not options.yes and not sys.stdin.isatty():
        # A script that forgot --yes must not stop a training nobody confirmed.
        return error("no terminal to confirm the stop: add --yes to send it", EXIT_REFUSED)
    if not options.yes and not _confirm("send the graceful stop?"):
        print("not sent")
        return EXIT_NOTHING
    records = send_stop(plan, job, registry)
    failed = [r for r in records if r.result != "sent"]
    for record in failed:
        print(f"  pid {record.pid}: {record.result}", file=sys.stderr)
    if failed and len(failed) == len(records):
        return error("no worker received the signal", EXIT_REFUSED)
    if job.kind == PREDICT:
        print("sent; the prediction writes its current case, then exits (resume: the rest)")
    else:
        print("sent; the job checkpoints and exits at the end of its current epoch")
    return EXIT_OK


def _snapshot(options: argparse.Namespace) -> MachineSnapshot:
    load = None if options.simulate_gpus is None else lambda: simulated_gpu_load(Registry())
    monitor = GpuMonitor(simulate=options.simulate_gpus, simulated_load=load)
    try:
        return monitor.snapshot()
    finally:
        monitor.close()


def report_checks(checks: launch_request.LaunchChecks) -> int | None:
    """Print the warnings and errors of a launch's (or a prediction's) checks; the exit code
    when there are errors: arguments that name nothing are usage errors, the rest refusals."""
    for warning in checks.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not checks.errors:
        return None
    for problem in checks.errors[1:]:
        print(f"error: {problem}", file=sys.stderr)
    return error(checks.errors[0], EXIT_USAGE if checks.usage_errors else EXIT_REFUSED)


def _batch_of(request: launch_request.LaunchRequest, roots: Roots) -> int | None:
    try:
        used = launch_request.effective_roots(request, roots)
        dataset_name = find_dataset(used.preprocessed, request.dataset)
        who = launch_request.identity(request)
        plans_file = who.engine.plans_file(who.plans)
        return catalog.plans_batch_size(used, dataset_name, request.configuration, plans_file)
    except (DatasetNotFound, ValueError):
        return None  # check_request reports the missing dataset or the unknown engine


def _launch_plans(
    request: launch_request.LaunchRequest,
    roots: Roots,
    registry: Registry,
    snapshot: MachineSnapshot | None,
    dry_run: bool = False,
    yes: bool = False,
) -> int:
    batch = _batch_of(request, roots)
    checks = launch_request.check_request(request, roots, batch, snapshot, registry)
    if dry_run and not checks.usage_errors:
        for warning in checks.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        return dry_run_folds(request, roots, batch, snapshot, registry)
    refused = report_checks(checks)
    if refused is not None:
        return refused
    if checks.confirmations and not yes:
        if not sys.stdin.isatty():  # a script must not crowd a GPU nobody agreed to share
            return error(busy_gpus.refusal(checks.confirmations), EXIT_REFUSED)
        for note in checks.confirmations:
            print(f"note: {note}", file=sys.stderr)
        if not _confirm("start anyway?"):
            print("not started")
            return EXIT_OK
    plans, problems = launcher.plan_launch(request, roots, batch, snapshot, registry)
    if problems:
        return error(problems[0], EXIT_REFUSED)
    for plan in plans:
        try:
            job = launcher.start(plan, registry)
        except ClaimRefused as refused:  # another launch of this fold got in first
            return error(f"refused to start fold {plan.fold}: {refused}", EXIT_REFUSED)
        gpus = ",".join(job.gpus) or "cpu"
        after = f" after {job.after}" if job.after else ""
        print(f"{job.job_id}  fold {job.fold}  {job.mode}  gpus {gpus}{after}  {job.run_dir}")
    return EXIT_OK


def dry_run_folds(
    request: launch_request.LaunchRequest,
    roots: Roots,
    batch: int | None,
    snapshot: MachineSnapshot | None,
    registry: Registry,
) -> int:
    """Every fold's command, and which folds would be refused and why (exit 1 if any)."""
    plans, problems = launcher.plan_launch(request, roots, batch, snapshot, registry)
    if not problems:
        checks = launch_request.check_request(request, roots, batch, snapshot, registry)
        for plan in plans:
            print(launcher.preview(plan))
        for note in checks.confirmations:
            print(f"note: {note} (--yes)", file=sys.stderr)
        return EXIT_OK
    num_refused = 0
    for fold, fold_request in launch_request.fold_requests(request):
        got, why = launcher.plan_launch(fold_request, roots, batch, snapshot, registry)
        for plan in got:
            print(launcher.preview(plan))
        for problem in why:
            print(f"refused: fold {fold}: {problem}", file=sys.stderr)
        num_refused += bool(why)
    if not num_refused:  # a problem of the whole request (e.g. folds vs GPUs)
        for problem in problems:
            print(f"refused: {problem}", file=sys.stderr)
    return EXIT_REFUSED


def chosen_gpus(options: argparse.Namespace) -> tuple[list[str], str | None]:
    """--gpus as a list, or the usage mistake (launch and predict alike)."""
    gpus = [g.strip() for g in options.gpus.split(",") if g.strip()]
    if options.simulate_gpus is not None:
        if options.cpu:
            return gpus, "--cpu and --simulate-gpus do not go together"
        bad = [g for g in gpus if not g.isdigit() or int(g) >= options.simulate_gpus]
        if bad:
            return gpus, f"GPU {bad[0]} does not exist on the simulated machine"
    if not gpus and not options.cpu:
        return gpus, "give --gpus (e.g. --gpus 0,1) or --cpu"
    return gpus, None


def cmd_launch(options: argparse.Namespace, registry: Registry) -> int:
    folds = [f.strip() for f in options.folds.split(",") if f.strip()]
    try:
        schedule = schedule_of(options)
    except ValueError as problem:
        return error(str(problem), EXIT_USAGE)
    if options.gpus.strip() == "any":
        if not schedule.when_free or options.ddp:
            return error("--gpus any goes with --when-free and single-GPU folds", EXIT_USAGE)
        options.gpus = ",".join(str(g.index) for g in _snapshot(options).gpus)
    gpus, problem = chosen_gpus(options)
    if problem is not None:
        return error(problem, EXIT_USAGE)
    simulated = options.simulate_gpus is not None
    request = launch_request.LaunchRequest(
        dataset=options.dataset,
        configuration=options.configuration,
        folds=folds,
        gpus=gpus,
        mode=options.ddp or "per_gpu",
        device="cpu" if options.cpu or simulated else "cuda",
        trainer_args=list(options.trainer_args),
        simulated=simulated,
        continue_training=options.continue_training,
        sequential=options.sequential,
        engine=options.engine,
        schedule=schedule,
        nice=options.nice,
        threads=options.threads,
        oversubscribe=options.oversubscribe,
    )
    snapshot = None if options.cpu else _snapshot(options)
    return _launch_plans(
        request, roots_of(options), registry, snapshot, options.dry_run, options.yes
    )


def start_predictions(plans: list[launcher.LaunchPlan], registry: Registry) -> int:
    """Start prediction parts (all or none) and list them."""
    try:
        jobs = prediction.start_prediction(plans, registry)
    except ClaimRefused as refused:
        return error(f"refused to start the prediction: {refused}", EXIT_REFUSED)
    for job in jobs:
        gpus = ",".join(job.gpus) or "cpu"
        part = f"part {(job.part_id or 0) + 1}/{job.num_parts or 1}"
        print(f"{job.job_id}  predict {part}  gpus {gpus}  -> {job.output_dir}")
    print("follow: nnui status; stop after the current case: nnui stop JOB")
    return EXIT_OK


def cmd_resume(options: argparse.Namespace, registry: Registry) -> int:
    code = _adopted(options, registry, "resume")
    if code is not None:
        return code
    view, problem = _view_of(registry, options.job)
    if view is None:
        return error(problem or "unknown job", EXIT_USAGE)
    if view.state not in ENDED_STATES:
        print(f"nothing to do: job {view.job.job_id} is {view.state}")
        return EXIT_NOTHING
    if view.state == "finished":
        print(f"nothing to do: job {view.job.job_id} finished training")
        return EXIT_NOTHING
    if view.job.kind == PREDICT:  # the rest of its cases (--continue_prediction)
        return start_predictions([prediction.resume_plan(view.job, registry)], registry)
    request = launch_request.resume_request(
        view.job
    )  # in the job's own roots, not the current ones
    folder = launch_request.effective_roots(request, roots_of(options))
    expected = Path(view.job.run_dir)
    planned = launch_request.request_run_dir(request, folder, view.job.dataset, view.job.fold)
    if planned != expected:
        return error(
            f"cannot resume {view.job.job_id}: it would train in {planned}, not in its own run "
            f"folder {expected}",
            EXIT_REFUSED,
        )
    # A CPU job needs no GPU readings; a CUDA or simulated one gets the busy checks.
    snapshot = None
    if request.device == "cuda" and not request.simulated:
        snapshot = _snapshot(argparse.Namespace(simulate_gpus=None))
    elif request.simulated:
        highest = max((int(g) for g in request.gpus if g.isdigit()), default=0)
        count = options.simulate_gpus or highest + 1
        snapshot = _snapshot(argparse.Namespace(simulate_gpus=count))
    # On stderr: stdout stays one started job id per line, for scripts.
    print(f"resume {view.job.job_id}: {resume_from(view)}", file=sys.stderr)
    return _launch_plans(request, roots_of(options), registry, snapshot, yes=options.yes)


def cmd_kill(options: argparse.Namespace, registry: Registry) -> int:
    if not options.yes:
        return error(
            "kill loses the current epoch; confirm with --yes (or use nnui stop)", EXIT_USAGE
        )
    code = _adopted(options, registry, "kill")
    if code is not None:
        return code
    if options.job.startswith(RUN_ID_PREFIX):  # a watch-only nnU-Net run: never nnui's to end
        return error(
            f"refused to kill {options.job}: an nnU-Net training nnui did not start "
            "(watch-only); nnui never signals it; nothing sent",
            EXIT_REFUSED,
        )
    try:
        job: Job = registry.resolve(options.job)
    except KeyError as problem:
        return error(problem.args[0], EXIT_USAGE)
    plan = kill_plan(job)
    if job.exit_code is not None or not (plan.targets or plan.refused):
        print(f"nothing to do: job {job.job_id} is not running")
        return EXIT_NOTHING
    for info in plan.targets:
        print(f"  pid {info.pid}  {' '.join(info.cmdline)[:80]}")
    # kill() plans again every round (a trainer recorded meanwhile is reached too) and waits
    # for the supervisor to record the exit code.
    records = kill_job(job, registry, grace_s=options.grace)
    for record in records:
        refused = record.result.startswith("refused")
        print(f"  {record.signal} -> pid {record.pid}: {record.result}",
              file=sys.stderr if refused else sys.stdout)  # fmt: skip
    if not any(r.result == "sent" for r in records):
        reasons = [r.result.removeprefix("refused: ") for r in records if r.result != "sent"]
        why = reasons[0] if reasons else "no process of the job passed the identity checks"
        return error(f"refused to kill {job.job_id}: {why}", EXIT_REFUSED)
    return EXIT_OK
