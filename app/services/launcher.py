"""Starting trainings — the only subprocess.Popen user (DESIGN §4).

A launch request becomes one plan per job (argv list, environment additions, run folder),
checked first: arguments that name nothing (a fold, a dataset, a configuration not in the
plans) are usage errors, refused before anything is written. `start()` claims the run
folder atomically (claims.py: the checks again, then an exclusive claim, under one lock with
the registration), runs the plan under a small supervisor in a new session with stdin from
/dev/null and stdout/stderr into the run folder's console.log, so the job outlives nnui and
the SSH session, and records it in the registry. A resume continues in the job's own roots.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import app
from app.services import claims
from app.services.claims import ClaimRefused
from app.services.gpus import MachineSnapshot
from app.services.registry import Job, ProcessRecord, Registry, new_job_id, valid_pid
from app.services.signals import job_alive, proc_info, process_identity
from trainer.schema import (
    CONSOLE_FILE,
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    FOLDS,
    JOB_ID_ENV,
    ROOT_ENVS,
    TERMINAL_STATES,
    DatasetNotFound,
    Roots,
    find_dataset,
    read_status,
    run_dir,
)

MODES = ("per_gpu", "spawn", "torchrun")
# Supervisors started by this process; polled so they never linger as zombies under nnui.
_started: list[subprocess.Popen[bytes]] = []
# Test hook: run this script instead of `-m trainer` (the fake trainer in tests/).
TRAINER_SCRIPT_ENV = "NNUI_TRAINER_SCRIPT"
# Test hook: run this script instead of `-m torch.distributed.run` (a torchrun that records
# the signals it receives; it must stay the launcher process, so it runs torchrun in-process).
TORCHRUN_SCRIPT_ENV = "NNUI_TORCHRUN_SCRIPT"


@dataclass(frozen=True)
class LaunchRequest:
    dataset: str
    configuration: str
    folds: list[str]
    gpus: list[str]  # one per fold (per_gpu), or the DDP group; simulated indices when simulated
    mode: str  # "per_gpu" | "spawn" | "torchrun"
    device: str  # "cuda" | "cpu"
    trainer_args: list[str]
    simulated: bool
    continue_training: bool = False
    sequential: bool = False  # several folds on one GPU (or one group) run one after another
    trainer_entry: tuple[str, ...] = field(default=())  # default: ("-m", "trainer")
    roots: Roots | None = None  # a resume: the job's own roots, whatever the caller's are


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str
    fold: str
    argv: list[str]
    env: dict[str, str]
    gpus: list[str]
    mode: str  # job mode: "single" | "spawn" | "torchrun"
    run_dir: Path
    console_path: Path
    after: str | None
    dataset: str = ""  # the resolved DatasetNNN_Name
    configuration: str = ""
    device: str = "cuda"
    simulated: bool = False
    trainer_args: tuple[str, ...] = ()
    continue_training: bool = False


@dataclass
class LaunchChecks:
    errors: list[str] = field(default_factory=list)  # every refusal (usage ones included)
    warnings: list[str] = field(default_factory=list)
    resumable_folds: list[str] = field(default_factory=list)  # folds with a stopped run
    usage_errors: list[str] = field(default_factory=list)  # arguments that name nothing


def trainer_entry(request: LaunchRequest) -> list[str]:
    if request.trainer_entry:
        return list(request.trainer_entry)
    script = os.environ.get(TRAINER_SCRIPT_ENV)
    return [script] if script else ["-m", "trainer"]


def torchrun_entry() -> list[str]:
    script = os.environ.get(TORCHRUN_SCRIPT_ENV)
    return [script] if script else ["-m", "torch.distributed.run"]


def flag_value(args: list[str], flag: str, default: str) -> str:
    """The value of `flag V` or `flag=V` in trainer flags (the last one wins, as in argparse)."""
    value = default
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            value = args[index + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def effective_roots(request: LaunchRequest, roots: Roots) -> Roots:
    """The roots the trainer will use: a resume's own, then trainer flags, then the caller's."""
    base = request.roots or roots
    preprocessed = flag_value(request.trainer_args, "--preprocessed", "")
    results = flag_value(request.trainer_args, "--results", "")
    return Roots(
        raw=base.raw,
        preprocessed=_root(preprocessed) if preprocessed else base.preprocessed,
        results=_root(results) if results else base.results,
    )


def _root(text: str) -> Path:
    return Path(text).expanduser().absolute()


def job_roots(job: Job) -> Roots | None:
    """The roots a job was launched with (its environment additions), None if not recorded."""
    values = {name: job.env.get(variable) for name, variable in ROOT_ENVS.items()}
    if not all(values.values()):
        return None
    return Roots(**{name: Path(value) for name, value in values.items() if value})


def configuration_names(dataset_folder: Path, plans: str) -> list[str] | None:
    """Configurations in the plans file (stock cascade ones included); None: no plans file."""
    for name in (f"{plans}.json", "plans.json"):
        try:
            data = json.loads((dataset_folder / name).read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError):
            return []
        configurations = data.get("configurations") if isinstance(data, dict) else None
        return sorted(configurations) if isinstance(configurations, dict) else []
    return None


def check_arguments(request: LaunchRequest, roots: Roots) -> list[str]:
    """Usage errors: a fold, dataset or configuration that does not exist (exit 2)."""
    errors = []
    if not request.folds:
        errors.append("no fold chosen")
    for fold in request.folds:
        if fold not in FOLDS:
            errors.append(f"fold {fold!r} is not one of {', '.join(FOLDS)}")
    if len(set(request.folds)) != len(request.folds):
        errors.append("a fold is listed twice")
    try:
        dataset_name = find_dataset(roots.preprocessed, request.dataset)
    except DatasetNotFound as error:
        return [*errors, str(error)]
    plans = flag_value(request.trainer_args, "-p", DEFAULT_PLANS)
    names = configuration_names(roots.preprocessed / dataset_name, plans)
    if names is None:
        errors.append(
            f"{dataset_name} has no plans {plans}.json in {roots.preprocessed / dataset_name}: "
            f"preprocess it first (nnui-preprocess {dataset_name})"
        )
    elif request.configuration not in names:
        known = ", ".join(names) or "none"
        errors.append(
            f"unknown configuration {request.configuration!r} for {dataset_name} "
            f"(plans {plans} has: {known})"
        )
    return errors


def _assignments(request: LaunchRequest) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(fold, gpus of its job) in launch order, or errors."""
    folds, gpus = list(request.folds), list(request.gpus)
    if request.mode != "per_gpu":
        group = gpus if gpus else []
        if len(folds) > 1 and not request.sequential:
            return [], ["a DDP group trains one fold at a time: pick one fold or --sequential"]
        return [(fold, group) for fold in folds], []
    if request.device == "cpu" and not request.simulated:
        return [(fold, []) for fold in folds], []
    if not gpus:
        return [], ["no GPU chosen: pick GPUs or run on CPU"]
    if len(gpus) == len(folds):
        return [(f, [g]) for f, g in zip(folds, gpus, strict=True)], []
    if len(gpus) == 1 or request.sequential:
        return [(f, [gpus[i % len(gpus)]]) for i, f in enumerate(folds)], []
    return [], [
        f"{len(folds)} folds on {len(gpus)} GPUs: give one GPU per fold, or --sequential "
        "to run several folds on a GPU one after another"
    ]


def _group_size(request: LaunchRequest) -> int:
    return max(1, len(request.gpus)) if request.mode != "per_gpu" else 1


def check_request(
    request: LaunchRequest,
    roots: Roots,
    plans_batch_size: int | None,
    snapshot: MachineSnapshot | None = None,
    registry: Registry | None = None,
) -> LaunchChecks:
    """Every reason not to launch (errors) or to think twice (warnings)."""
    checks = LaunchChecks()
    roots = effective_roots(request, roots)
    if request.mode not in MODES:
        checks.errors.append(f"unknown mode {request.mode!r} (one of {', '.join(MODES)})")
        return checks
    checks.usage_errors = check_arguments(request, roots)
    checks.errors.extend(checks.usage_errors)
    if checks.usage_errors:
        return checks
    if request.mode != "per_gpu":
        size = _group_size(request)
        if size < 2:
            checks.errors.append(
                f"a {request.mode} DDP group needs at least 2 GPUs (on CPU, --gpus 0,1 "
                "means 2 processes)"
            )
        if len(set(request.gpus)) != len(request.gpus):
            checks.errors.append("a GPU is listed twice in the DDP group")
        if plans_batch_size is not None:
            if size > plans_batch_size:
                checks.errors.append(
                    f"group of {size} GPUs > global batch size {plans_batch_size}: "
                    "each GPU needs at least one sample; use fewer GPUs"
                )
            elif plans_batch_size % size:
                checks.errors.append(
                    f"global batch size {plans_batch_size} is not divisible by {size} GPUs: "
                    "ranks would get unequal batches; pick a group size that divides it"
                )
    _, assignment_errors = _assignments(request)
    checks.errors.extend(assignment_errors)
    if request.mode == "per_gpu" and not request.sequential:
        used = [g for g in request.gpus]
        for gpu in sorted(set(used)):
            if used.count(gpu) > 1 and len(request.folds) > 1 and request.device == "cuda":
                checks.warnings.append(
                    f"GPU {gpu} gets {used.count(gpu)} folds at once "
                    "(add --sequential to queue them)"
                )
    try:
        dataset_name = find_dataset(roots.preprocessed, request.dataset)
    except DatasetNotFound as error:
        checks.errors.append(str(error))
        return checks
    if snapshot is not None and not request.simulated and request.device == "cuda":
        _gpu_checks(request, snapshot, checks)
    _fold_checks(request, roots, dataset_name, registry, checks)
    return checks


def _gpu_checks(request: LaunchRequest, snapshot: MachineSnapshot, checks: LaunchChecks) -> None:
    if snapshot.driver_problem:
        checks.errors.append(f"{snapshot.driver_problem} (use --cpu)")
        return
    for gpu in dict.fromkeys(request.gpus):
        reading = snapshot.gpu(gpu) if gpu.isdigit() else None
        if reading is None:
            checks.errors.append(f"GPU {gpu} is not visible on this machine")
            continue
        if reading.busy:
            util = reading.utilization_percent
            checks.warnings.append(
                f"GPU {gpu} is busy (memory {reading.memory_used_fraction or 0:.0%}, "
                f"utilisation {'n/a' if util is None else util}%)"
            )
        if reading.other_users:
            checks.warnings.append(f"GPU {gpu} is used by {', '.join(reading.other_users)}")


def _running_jobs(registry: Registry | None, dataset_name: str, configuration: str) -> list[Job]:
    return [
        j
        for j in (registry.list() if registry else [])
        if j.dataset == dataset_name
        and j.configuration == configuration
        and j.exit_code is None
        and job_alive(j, proc_info)
    ]


def folder_problem(
    folder: Path, fold: str, continue_training: bool, running_jobs: list[Job]
) -> tuple[str | None, bool]:
    """(why this run folder cannot take a new run, resumable?) — (None, False) when free.

    The same check runs once more inside start()'s claim, under the lock.
    """
    if any(j.fold == fold and j.run_dir == str(folder) for j in running_jobs):
        return f"fold {fold} is already running (see nnui status)", False
    claimed = claims.check(folder, fold)
    if claimed is not None:
        return claimed, False
    status = read_status(folder)
    if status is None:
        return None, False
    state = status.state if isinstance(status.state, str) else "unknown"
    pids = [p for p in status.pids if valid_pid(p)] if isinstance(status.pids, list) else []
    if state not in TERMINAL_STATES and any(_pid_alive(p) for p in pids):
        return f"fold {fold} is already running (pids {pids})", False
    if continue_training:
        return None, False
    if state == "finished":
        return (
            f"fold {fold} already finished training in {folder}; move that folder to train it again"
        ), False
    return (
        f"fold {fold} has an earlier run ({state} at epoch {status.epoch}): "
        "resume it (nnui resume JOB, or launch with --c) or move its folder away"
    ), True


def _fold_checks(
    request: LaunchRequest,
    roots: Roots,
    dataset_name: str,
    registry: Registry | None,
    checks: LaunchChecks,
) -> None:
    trainer = flag_value(request.trainer_args, "-tr", DEFAULT_TRAINER)
    plans = flag_value(request.trainer_args, "-p", DEFAULT_PLANS)
    running_jobs = _running_jobs(registry, dataset_name, request.configuration)
    for fold in request.folds:
        folder = run_dir(roots.results, dataset_name, request.configuration, fold, trainer, plans)
        try:
            problem, resumable = folder_problem(
                folder, fold, request.continue_training, running_jobs
            )
        except ClaimRefused as refused:
            problem, resumable = str(refused), False
        if problem is not None:
            checks.errors.append(problem)
        if resumable:
            checks.resumable_folds.append(fold)


def _pid_alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and not info.zombie


def plan_launch(
    request: LaunchRequest,
    roots: Roots,
    plans_batch_size: int | None,
    snapshot: MachineSnapshot | None = None,
    registry: Registry | None = None,
) -> tuple[list[LaunchPlan], list[str]]:
    """Plans for every job of the request, or no plans and the errors (warnings: check_request)."""
    checks = check_request(request, roots, plans_batch_size, snapshot, registry)
    if checks.errors:
        return [], checks.errors
    roots = effective_roots(request, roots)
    dataset_name = find_dataset(roots.preprocessed, request.dataset)
    assignments, _ = _assignments(request)
    trainer = flag_value(request.trainer_args, "-tr", DEFAULT_TRAINER)
    plans_name = flag_value(request.trainer_args, "-p", DEFAULT_PLANS)
    device = "cpu" if request.simulated else request.device
    job_mode = "single" if request.mode == "per_gpu" else request.mode
    plans: list[LaunchPlan] = []
    last_on: dict[tuple[str, ...], str] = {}
    for fold, gpus in assignments:
        job_id = new_job_id(fold)
        folder = run_dir(
            roots.results, dataset_name, request.configuration, fold, trainer, plans_name
        )
        args = [dataset_name, request.configuration, fold, "-device", device]
        args += list(request.trainer_args)
        if request.continue_training and "--c" not in args:
            args.append("--c")
        entry = trainer_entry(request)
        size = len(gpus)
        if job_mode == "spawn":
            argv = [sys.executable, *entry, *args, "-num_gpus", str(size)]
        elif job_mode == "torchrun":
            argv = [
                sys.executable, *torchrun_entry(), "--standalone",
                f"--nproc_per_node={size}", *entry, *args,
            ]  # fmt: skip
        else:
            argv = [sys.executable, *entry, *args]
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", JOB_ID_ENV: job_id}
        # The trainer finds the same roots as nnui, whichever way nnui was given them.
        env.update({ROOT_ENVS[name]: str(getattr(roots, name)) for name in ROOT_ENVS})
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        key = tuple(gpus) if gpus else ("cpu", fold)
        after = last_on.get(key) if request.sequential else None
        last_on[key] = job_id
        plans.append(
            LaunchPlan(
                job_id=job_id,
                fold=fold,
                argv=argv,
                env=env,
                gpus=list(gpus) if (device == "cuda" or request.simulated) else [],
                mode=job_mode,
                run_dir=folder,
                console_path=folder / CONSOLE_FILE,
                after=after,
                dataset=dataset_name,
                configuration=request.configuration,
                device=device,
                simulated=request.simulated,
                trainer_args=tuple(request.trainer_args),
                continue_training=request.continue_training,
            )
        )
    return plans, []


def preview(plan: LaunchPlan) -> str:
    """The exact command as copy-pasteable shell text (what start() runs, minus the supervisor)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    wait = f"# after job {plan.after} ends\n" if plan.after else ""
    return f"{wait}cd {shlex.quote(os.getcwd())} && {env} {shlex.join(plan.argv)}"


def _python_path() -> str:
    """Make `app` and `trainer` importable in the children even without an install."""
    root = str(Path(app.__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH")
    return root if not existing else f"{root}{os.pathsep}{existing}"


def start(plan: LaunchPlan, registry: Registry) -> Job:
    """Claim the run folder, register the job and start its supervisor, detached from nnui
    and the terminal. ClaimRefused (one line) when the fold was taken meanwhile: then
    nothing of this job is written.

    Check, claim and registration happen under one lock shared by every nnui process and
    user of the results root, so of several launches of one fold at the same moment exactly
    one gets in; the claim is handed to the supervisor, whose life it then follows.
    """
    results_root = plan.run_dir.parents[2]  # results/DatasetNNN_Name/T__P__C/fold_F
    with claims.locked(results_root):
        running = _running_jobs(registry, plan.dataset, plan.configuration)
        problem, _ = folder_problem(plan.run_dir, plan.fold, plan.continue_training, running)
        if problem is not None:
            raise ClaimRefused(problem)
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        claims.take(plan.run_dir, plan.fold, plan.job_id)
        try:
            job = _register_and_start(plan, registry)
        except BaseException:
            claims.release(plan.run_dir, plan.job_id)
            raise
        supervisor = job.process("supervisor")
        assert supervisor is not None
        claims.hand_over(plan.run_dir, plan.job_id, supervisor.pid)
    return job


def _register_and_start(plan: LaunchPlan, registry: Registry) -> Job:
    job = Job(
        job_id=plan.job_id,
        created_at=time.time(),
        dataset=plan.dataset,
        configuration=plan.configuration,
        fold=plan.fold,
        mode=plan.mode,
        device=plan.device,
        gpus=list(plan.gpus),
        simulated=plan.simulated,
        argv=list(plan.argv),
        env=dict(plan.env),
        run_dir=str(plan.run_dir),
        console_path=str(plan.console_path),
        after=plan.after,
        trainer_args=list(plan.trainer_args),
        continue_training=plan.continue_training,
    )
    registry.add(job)
    env = {**os.environ, **plan.env, "PYTHONPATH": _python_path()}
    supervisor = [
        sys.executable, "-m", "app.services.supervisor",
        "--job-id", plan.job_id, "--state-dir", str(registry.state_dir), "--", *plan.argv,
    ]  # fmt: skip
    try:
        with open(plan.console_path, "ab") as console:
            header = f"[nnui] job {plan.job_id}: {preview(plan)}\n"
            console.write(header.encode())
            console.flush()
            process = subprocess.Popen(
                supervisor,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as error:
        registry.update(
            plan.job_id, exit_code=127, ended_at=time.time(), note=f"start failed: {error}"
        )
        raise
    _started.append(process)
    ticks, create_time = process_identity(process.pid)
    record = ProcessRecord(process.pid, create_time or time.time(), "supervisor", None, ticks)
    return registry.add_process(plan.job_id, record)


def reap_children() -> None:
    """Collect supervisors of this process that have exited (cheap; call it now and then)."""
    _started[:] = [p for p in _started if p.poll() is None]


def resume_request(job: Job) -> LaunchRequest:
    """Continue a job's fold on the same GPUs in the same mode (`--c`), in the job's own
    results and preprocessed roots (recorded in its environment), not the caller's."""
    args = [a for a in job.trainer_args if a != "--c"]
    mode = "per_gpu" if job.mode == "single" else job.mode
    return LaunchRequest(
        dataset=job.dataset,
        configuration=job.configuration,
        folds=[job.fold],
        gpus=list(job.gpus),
        mode=mode,
        device="cuda" if job.device == "cuda" else "cpu",
        trainer_args=args,
        simulated=job.simulated,
        continue_training=True,
        roots=job_roots(job),
    )
