"""`nnui stop|kill|resume|export run:PID`: the headless actions on adopted runs.

An adopted run (app/services/jobs/discovery.py) has no registry record: it is found again from
/proc and its run folder at each command. The user's own runs get the same stop as a
launched job (SIGUSR1 to the verified workers only, or `scancel --signal=USR1` to an srun
step whose tasks are the workers); another user's are refused with one line.
Exit codes as app/cli/common.py says: 0 ok, 1 refused, 2 usage, 3 nothing to do.
"""

from __future__ import annotations

import argparse
import sys
import time

from app.cli.common import error, looked_in
from app.cli.sending import not_confirmed, print_targets, send_and_report
from app.services.jobs.discovery import RUN_ID_PREFIX
from app.services.jobs.registry import Registry
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX, cancel_pending
from app.services.jobs.views import JobTracker, JobView
from app.services.jobs.words import already_stopping
from app.services.launch import launcher
from app.services.launch.adopted_resume import resume_plan
from app.services.launch.fold_claims import ClaimRefused
from app.services.signals.send import kill as kill_job
from app.services.signals.send import slurm_step_of
from app.services.signals.targets import plan_stop
from trainer.schema.exits import EXIT_NOTHING, EXIT_OK, EXIT_REFUSED
from trainer.schema.status import ENDED_STATES, State


def is_adopted_id(text: str) -> bool:
    return text.startswith(RUN_ID_PREFIX)


def find(options: argparse.Namespace, registry: Registry, text: str) -> JobView | None:
    """The adopted (or ended-unseen) run `run:PID`, or the live one a bare pid belongs to."""
    tracker = JobTracker(registry)
    known = tracker.refresh()
    roots = looked_in(options, [v.job for v in known], registry.state_dir)
    views = [v for v in tracker.refresh_watch_only(roots) if _is_adopted(v)]
    found = next((v for v in views if v.job.job_id == text), None)
    if found is None and text.startswith(SLURM_ID_PREFIX):  # a SLURM job whose run is here
        job_id = text.removeprefix(SLURM_ID_PREFIX)
        found = next((v for v in views if v.adopted and v.adopted.slurm_job == job_id), None)
    if found is None and text.isdigit():
        pid = int(text)
        found = next((v for v in views if v.adopted and pid in v.adopted.pids), None)
    return found


def _is_adopted(view: JobView) -> bool:
    return view.adopted is not None or view.job.job_id.startswith((RUN_ID_PREFIX, SLURM_ID_PREFIX))


def _slurm_only(view: JobView, action: str) -> int | None:
    """A SLURM training with no process here: a pending one is cancelled (nothing trained
    yet); a running one on another node is refused (its workers are not ours to see)."""
    if not view.job.job_id.startswith(SLURM_ID_PREFIX):
        return None
    job_id = view.job.job_id.removeprefix(SLURM_ID_PREFIX)
    if view.slurm_state != "PENDING":
        return error(f"refused to {action} {view.job.job_id}: SLURM job {job_id} is "
                      f"{view.slurm_state} with no worker on this machine; run nnui on the "
                      "node that trains it", EXIT_REFUSED)  # fmt: skip
    result = cancel_pending(job_id)
    if result != "sent":
        return error(f"cannot cancel pending SLURM job {job_id}: {result}", EXIT_REFUSED)
    print(f"cancelled pending SLURM job {job_id} (it had not started: nothing trained)")
    return EXIT_OK


def _others(view: JobView, action: str) -> int | None:
    run = view.adopted
    if run is not None and not run.own:
        return error(run.refusal_line(action), EXIT_REFUSED)
    return None


def stop(options: argparse.Namespace, registry: Registry, view: JobView) -> int:
    job = view.job
    refused = _others(view, "stop")
    if refused is None:
        refused = _slurm_only(view, "stop")
    if refused is not None:
        return refused
    if view.state in ENDED_STATES:
        print(f"nothing to do: run {job.job_id} is {view.state}")
        return EXIT_NOTHING
    if view.state == State.STOPPING:
        print(already_stopping(view, time.time()))
        return EXIT_NOTHING
    plan = plan_stop(job, view.topology, view.epoch)
    if not plan.ok:
        return error(f"refused to stop {job.job_id}: {plan.reason}", EXIT_REFUSED)
    print(f"run {job.job_id} (adopted, epoch {plan.epoch if plan.epoch is not None else 'n/a'})"
          ": SIGUSR1 to")  # fmt: skip
    print_targets(plan)
    code = not_confirmed(options)
    if code is not None:
        return code
    step = slurm_step_of(plan, job)
    if step is not None:  # the workers are the step's tasks: SLURM signals exactly them
        print(f"  via scancel --signal=USR1 {step} (the step's tasks; never the batch shell)")
    code = send_and_report(plan, job, registry)
    if code is not None:
        return code
    print("sent; the run checkpoints and exits at the end of its current epoch")
    return EXIT_OK


def kill(options: argparse.Namespace, registry: Registry, view: JobView) -> int:
    refused = _others(view, "kill")
    if refused is None:
        refused = _slurm_only(view, "kill")
    if refused is not None:
        return refused
    if view.state in ENDED_STATES or view.adopted is None:
        print(f"nothing to do: run {view.job.job_id} is {view.state}")
        return EXIT_NOTHING
    records = kill_job(view.job, registry, grace_s=options.grace)
    for record in records:
        print(f"  {record.signal} -> pid {record.pid}: {record.result}")
    if not any(r.result == "sent" for r in records):
        return error(f"refused to kill {view.job.job_id}: no process passed the identity "
                      "checks", EXIT_REFUSED)  # fmt: skip
    return EXIT_OK


def resume(options: argparse.Namespace, registry: Registry, view: JobView) -> int:
    job = view.job
    refused = _others(view, "resume")
    if refused is not None:
        return refused
    if view.state not in ENDED_STATES:
        print(f"nothing to do: run {job.job_id} is {view.state}")
        return EXIT_NOTHING
    if view.state == State.FINISHED:
        print(f"nothing to do: run {job.job_id} finished training")
        return EXIT_NOTHING
    plan = resume_plan(job)
    if isinstance(plan, str):
        return error(f"cannot resume {job.job_id}: {plan}", EXIT_REFUSED)
    try:
        started = launcher.start(plan, registry)
    except ClaimRefused as refused:
        return error(f"cannot resume {job.job_id}: {refused}", EXIT_REFUSED)
    except OSError as problem:
        return error(f"cannot resume {job.job_id}: {problem}", EXIT_REFUSED)
    # On stderr: stdout stays one started job id per line, for scripts.
    print(f"resume {job.job_id} as it was started, with --c: {launcher.preview(plan)}",
          file=sys.stderr)  # fmt: skip
    print(f"{started.job_id}  fold {started.fold}  {started.mode}  {started.run_dir}")
    return EXIT_OK
