"""`nnui launch ... --slurm` and `nnui stop|kill|resume slurm:JOB`: folds on a SLURM cluster.

Stop: nnui's own scripts get `scancel --signal=USR1 --batch JOB` (their relay stops the
workers: checkpoint, exit 0); a pending job is cancelled (nothing trained); a user's own
script is stopped through its workers when they run here, else refused with the reason.
Kill: `scancel JOB`. Resume: the same script submitted again (it passes --c).
Exit codes as app/cli/common.py says.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.cli import adopted as cli_adopted
from app.cli.common import error, roots_of
from app.cli.sending import not_confirmed
from app.services.jobs.registry import Registry
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX
from app.services.jobs.views import JobView
from app.services.launch.request import LaunchRequest
from app.services.launch.trainer_flags import flag_value
from app.services.slurm.control import (
    ENDED,
    JobInfo,
    SlurmError,
    active_job_of,
    batch_script,
    cancel,
    graceful_stop,
    is_nnui_script,
    job_info,
    read_record,
    record_for_folder,
    submit,
    write_record,
)
from app.services.slurm.folds import (
    ClusterLimits,
    dependencies,
    expand_folds,
    fold_specs,
    submit_fold,
)
from app.services.slurm.script import render_script
from trainer.schema.exits import EXIT_NOTHING, EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from trainer.schema.status import State, read_status

# This machine's scheduling and manners: SLURM schedules a cluster fold (and --requeue
# restarts it); each is refused with --slurm rather than silently dropped.
_NOT_WITH_SLURM = ("gpus", "ddp", "sequential", "when_free", "simulate_gpus", "oversubscribe",
                   "retries", "on_event", "priority", "min_free_gib", "max_util", "share",
                   "nice", "threads")  # fmt: skip


def limits_of(options: argparse.Namespace) -> ClusterLimits | str:
    """The cluster limits of `nnui launch --slurm`, or the usage mistake."""
    clash = [name for name in _NOT_WITH_SLURM if getattr(options, name, None)]
    if clash:
        flag = "--" + clash[0].replace("_", "-")
        return (f"{flag} is for this machine's jobs; with --slurm SLURM schedules the folds "
                "(--gpus-per-node, --nodes, --partition, --requeue)")  # fmt: skip
    if not options.slurm_time:
        return "--slurm needs --time, each job's limit (e.g. --time 24:00:00)"
    gpus = options.gpus_per_node
    if gpus is None:
        gpus = 0 if options.cpu else 1
    if options.cpu and gpus:
        return "--cpu and --gpus-per-node do not go together (--cpu is --gpus-per-node 0)"
    return ClusterLimits(
        time_limit=options.slurm_time, partition=options.partition, account=options.account,
        nodes=options.nodes, gpus_per_node=gpus, procs_per_node=options.procs_per_node,
        cpus_per_task=options.cpus_per_task, signal_lead_s=options.signal_lead,
        requeue=options.requeue, output=Path(options.slurm_output),
    )  # fmt: skip


def cmd_launch_slurm(options: argparse.Namespace) -> int:
    limits = limits_of(options)
    if isinstance(limits, str):
        return error(limits, EXIT_USAGE)
    request = LaunchRequest(
        dataset=options.dataset, configuration=options.configuration,
        folds=expand_folds(options.folds), gpus=[], mode="torchrun",
        device="cuda" if limits.gpus_per_node else "cpu",
        trainer_args=list(options.trainer_args), simulated=False, engine=options.engine,
    )  # fmt: skip
    roots = roots_of(options)
    preprocessed = Path(flag_value(request.trainer_args, "--preprocessed", "") or
                        roots.preprocessed)  # fmt: skip
    try:
        specs = fold_specs(request, roots, limits)
        after = dependencies(specs, preprocessed, options.after_previous_stage)
    except ValueError as bad:
        return error(str(bad), EXIT_USAGE)
    if options.dry_run:  # the exact scripts, nothing written or submitted
        for spec, dependency in zip(specs, after, strict=True):
            print(f"# fold {spec.fold}: {spec.script_path}" +
                  (f" (--dependency={dependency})" if dependency else ""))  # fmt: skip
            print(render_script(spec))
        return EXIT_OK
    for spec, dependency in zip(specs, after, strict=True):
        try:
            job_id = submit_fold(spec, dependency)
        except (SlurmError, OSError) as problem:
            return error(f"fold {spec.fold} not submitted: {problem}", EXIT_REFUSED)
        shape = f"{spec.nodes} node(s) x {spec.gpus_per_node or 'cpu'}"
        wait = f"  after {dependency}" if dependency else ""
        print(f"{SLURM_ID_PREFIX}{job_id}  fold {spec.fold}  {shape}{wait}  {spec.run_folder}")
    print(
        f"follow: nnui status; stop: nnui stop {SLURM_ID_PREFIX}JOB; resume: nnui resume "
        f"{SLURM_ID_PREFIX}JOB (scripts in {limits.output.absolute()})",
        file=sys.stderr,
    )
    return EXIT_OK


def slurm_action(options: argparse.Namespace, registry: Registry, action: str) -> int | None:
    """Exit code of `nnui stop|kill|resume slurm:JOB`; None: not a SLURM id, or a user's
    own script whose workers run here (the adopted run's own stop handles it)."""
    text = options.job
    if not text.startswith(SLURM_ID_PREFIX):
        return None
    job_id = text.removeprefix(SLURM_ID_PREFIX)
    if not job_id.isdigit():
        return error(f"{text!r} is no SLURM job id (slurm:NUMBER, see nnui status)", EXIT_USAGE)
    try:
        job = job_info(job_id)
    except SlurmError as problem:
        return error(f"no SLURM job {job_id} known: {problem}", EXIT_USAGE)
    if action == "kill":
        return _kill(job)
    if action == "resume":
        return _resume(job)
    return _stop(options, registry, job)


def _stop(options: argparse.Namespace, registry: Registry, job: JobInfo) -> int | None:
    if job.state in ENDED or not job.state:
        print(f"nothing to do: SLURM job {job.job_id} is {job.state or 'over'}")
        return EXIT_NOTHING
    if job.state == "PENDING":
        return _cancel_pending(job)
    if not is_nnui_script(batch_script(job)):
        view = cli_adopted.find(options, registry, f"{SLURM_ID_PREFIX}{job.job_id}")
        if view is not None and view.adopted is not None:
            return None  # its workers run here: stopped through them
        return error(
            f"refused to stop {SLURM_ID_PREFIX}{job.job_id}: its batch script is not nnui's, "
            "so a USR1 to the batch shell would not reach the trainer; run nnui stop on the "
            f"node that trains it ({job.nodes or '?'}), or submit it with nnui launch --slurm "
            "(its relay stops gracefully)",
            EXIT_REFUSED,
        )
    print(f"SLURM job {job.job_id} on {job.nodes or '?'}: scancel --signal=USR1 --batch "
          f"{job.job_id} (the script's relay stops the workers)")  # fmt: skip
    code = not_confirmed(options)
    if code is not None:
        return code
    try:
        graceful_stop(job)
    except SlurmError as problem:
        return error(f"stop not sent: {problem}", EXIT_REFUSED)
    print("sent; the fold checkpoints and exits 0 at the end of its current epoch; resume: "
          f"nnui resume {SLURM_ID_PREFIX}{job.job_id}")  # fmt: skip
    return EXIT_OK


def _cancel_pending(job: JobInfo) -> int:
    try:
        cancel(job.job_id)
    except SlurmError as problem:
        return error(f"cannot cancel pending SLURM job {job.job_id}: {problem}", EXIT_REFUSED)
    print(f"cancelled pending SLURM job {job.job_id} (it had not started: nothing trained)")
    return EXIT_OK


def _kill(job: JobInfo) -> int:
    if job.state in ENDED or not job.state:
        print(f"nothing to do: SLURM job {job.job_id} is {job.state or 'over'}")
        return EXIT_NOTHING
    try:
        cancel(job.job_id)
    except SlurmError as problem:
        return error(f"refused to kill {SLURM_ID_PREFIX}{job.job_id}: {problem}", EXIT_REFUSED)
    print(f"scancel {job.job_id}: SLURM ends the job now (its current epoch is lost)")
    return EXIT_OK


def _resume(job: JobInfo) -> int:
    if job.state and job.state not in ENDED:
        print(f"nothing to do: SLURM job {job.job_id} is {job.state}")
        return EXIT_NOTHING
    record = read_record(job.job_id) or {}
    return resubmit(f"{SLURM_ID_PREFIX}{job.job_id}", job.script, record.get("run_folder"))


def resubmit(name: str, script: Path | None, run_folder: str | None) -> int:
    """Submit the script of `name` again (it passes --c); refused when it is gone, not
    nnui's, or the fold finished."""
    if script is None or not script.is_file():
        return error(f"cannot resume {name}: its job script {script or '(unknown)'} is gone; "
                     "write it again with the same nnui launch --slurm", EXIT_REFUSED)  # fmt: skip
    try:
        text = script.read_text()
    except OSError as problem:
        return error(f"cannot resume {name}: {problem}", EXIT_REFUSED)
    if not is_nnui_script(text):
        return error(f"cannot resume {name}: {script} is not nnui's script (it may not pass "
                     "--c); add --c to its trainer line and sbatch it yourself",
                     EXIT_REFUSED)  # fmt: skip
    status = read_status(Path(run_folder)) if run_folder else None
    if status is not None and status.state == State.FINISHED:
        print(f"nothing to do: {name} finished training in {run_folder}")
        return EXIT_NOTHING
    active = active_job_of(script)
    if active is not None:
        print(f"nothing to do: {SLURM_ID_PREFIX}{active} already runs {script} (queued or running)")
        return EXIT_NOTHING
    try:
        job_id = submit(script)
    except SlurmError as problem:
        return error(f"cannot resume {name}: {problem}", EXIT_REFUSED)
    write_record(job_id, script, Path(run_folder) if run_folder else None,
                 _fold_of(run_folder))  # fmt: skip
    print(f"resume {name}: sbatch {script} again (it passes --c)", file=sys.stderr)
    print(f"{SLURM_ID_PREFIX}{job_id}  {run_folder or ''}".rstrip())
    return EXIT_OK


def _fold_of(run_folder: str | None) -> str:
    return Path(run_folder).name.removeprefix("fold_") if run_folder else "?"


def resume_run_folder(view: JobView) -> int | None:
    """`nnui resume run:ID` of a run that nnui put on SLURM: its script submitted again;
    None when nnui submitted no job for that folder."""
    record = record_for_folder(view.job.run_dir) if view.job.run_dir else None
    if record is None:
        return None
    if view.state not in (State.STOPPED, State.FAILED, State.KILLED, State.LOST):
        print(f"nothing to do: run {view.job.job_id} is {view.state}")
        return EXIT_NOTHING
    return resubmit(view.job.job_id, Path(record["script"]), view.job.run_dir)
