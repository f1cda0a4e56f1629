"""`nnui stop`, `nnui resume` and `nnui kill`: ending and continuing a job (or an adopted run),
after the same identity checks as the TUI."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import cast

from app.cli import adopted as cli_adopted
from app.cli import cluster as cli_cluster
from app.cli.common import error, looked_in, machine_snapshot, roots_of
from app.cli.launch import launch_plans, start_predictions
from app.cli.sending import not_confirmed, print_targets, send_and_report
from app.services.jobs.liveness import between_attempts
from app.services.jobs.registry import PREDICT, Job, Registry
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX
from app.services.jobs.views import JobTracker, JobView
from app.services.jobs.words import already_stopping, resume_from
from app.services.launch import prediction
from app.services.launch import request as launch_request
from app.services.machine.procs import proc_info
from app.services.nnunet.runs import RUN_ID_PREFIX, WatchOnlyRun, is_train_cmdline, stop_refusal
from app.services.signals.send import kill as kill_job
from app.services.signals.send import send_stop
from app.services.signals.targets import kill_plan, plan_stop
from trainer.schema.exits import EXIT_NOTHING, EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from trainer.schema.status import ENDED_STATES, State


def _view_of(registry: Registry, text: str) -> tuple[JobView | None, str | None]:
    try:
        job = registry.resolve(text)
    except KeyError as problem:
        return None, problem.args[0]
    views = JobTracker(registry).refresh()
    return next(v for v in views if v.job.job_id == job.job_id), None


def _watch_only_run(
    options: argparse.Namespace, registry: Registry, text: str
) -> WatchOnlyRun | None:
    pid_text = text.removeprefix(RUN_ID_PREFIX)
    if not pid_text.isdigit():
        return None
    tracker = JobTracker(registry)
    known = tracker.refresh()
    views = tracker.refresh_watch_only(
        looked_in(options, [v.job for v in known], registry.state_dir)
    )
    runs = [cast(WatchOnlyRun, v.watch) for v in views if v.watch]  # nnU-Net's, not adopted
    return next((run for run in runs if run.pid == int(pid_text)), None)


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
    code = cli_cluster.slurm_action(options, registry, action)  # nnui's SLURM scripts
    if code is not None:
        return code
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
    if action == "resume":  # a run nnui put on SLURM: its script again
        code = cli_cluster.resume_run_folder(view)
        if code is not None:
            return code
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
    if view.state == State.STOPPING and not job.queued_stop:
        print(already_stopping(view, time.time()))
        return EXIT_NOTHING
    waiting = view.state == State.QUEUED and between_attempts(job)  # for GPUs, or to restart
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
    print_targets(plan)
    if plan.already_signalled:
        print("nothing to do: these workers already received the stop; they end after this "
              f"{'case' if job.kind == PREDICT else 'epoch'}")  # fmt: skip
        return EXIT_NOTHING
    code = not_confirmed(options)
    if code is None:
        code = send_and_report(plan, job, registry)
    if code is not None:
        return code
    if job.kind == PREDICT:
        print("sent; the prediction writes its current case, then exits (resume: the rest)")
    else:
        print("sent; the job checkpoints and exits at the end of its current epoch")
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
    if view.state == State.FINISHED:
        print(f"nothing to do: job {view.job.job_id} finished training")
        return EXIT_NOTHING
    if view.job.kind == PREDICT:  # the rest of its cases (--continue_prediction)
        return start_predictions([prediction.resume_plan(view.job, registry)], registry)
    # In the job's own roots, not the current ones.
    request = launch_request.resume_request(view.job)
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
        snapshot = machine_snapshot(argparse.Namespace(simulate_gpus=None))
    elif request.simulated:
        highest = max((int(g) for g in request.gpus if g.isdigit()), default=0)
        count = options.simulate_gpus or highest + 1
        snapshot = machine_snapshot(argparse.Namespace(simulate_gpus=count))
    # On stderr: stdout stays one started job id per line, for scripts.
    print(f"resume {view.job.job_id}: {resume_from(view)}", file=sys.stderr)
    return launch_plans(request, roots_of(options), registry, snapshot, yes=options.yes)


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
