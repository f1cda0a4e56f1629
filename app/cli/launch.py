"""`nnui launch`: a launch request, its checks, the confirmation and the start of its jobs
(also the start of prediction parts, for `nnui predict` and a resumed prediction)."""

from __future__ import annotations

import argparse
import sys

from app.cli.cluster import cmd_launch_slurm
from app.cli.common import confirm, error, machine_snapshot, roots_of
from app.cli.schedule import schedule_of
from app.services.jobs.registry import Registry
from app.services.launch import busy_gpus, catalog, launcher, prediction
from app.services.launch import request as launch_request
from app.services.launch.fold_claims import ClaimRefused
from app.services.machine.gpus import MachineSnapshot
from app.services.slurm.folds import expand_folds
from trainer.schema.exits import EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from trainer.schema.tree import DatasetNotFound, Roots, find_dataset


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


def launch_plans(
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
        if not confirm("start anyway?"):
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
    if options.slurm:  # one nnui sbatch job per fold
        return cmd_launch_slurm(options)
    folds = expand_folds(options.folds)
    try:
        schedule = schedule_of(options)
    except ValueError as bad:
        return error(str(bad), EXIT_USAGE)
    if options.gpus.strip() == "any":
        if not schedule.when_free or options.ddp:
            return error("--gpus any goes with --when-free and single-GPU folds", EXIT_USAGE)
        options.gpus = ",".join(str(g.index) for g in machine_snapshot(options).gpus)
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
    snapshot = None if options.cpu else machine_snapshot(options)
    return launch_plans(
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
