"""What to launch and whether it may be: requests, their checks, and the roots they use.

Every reason not to launch, with the flag that fixes it. Arguments that name nothing (a
fold, a dataset, a configuration not in the plans) are usage errors, found before anything
is written. A run folder is free when no live job of the registry trains there, no live
claim holds it (fold_claims.py) and its status.json shows no earlier run (unless `--c`); start()
checks the folder once more under the claims lock. A resume uses the job's own roots.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from app.legacy import old_identity
from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import TRAIN, Job, Registry
from app.services.launch import engines, flag_check, stage_inputs
from app.services.launch import fold_claims as claims
from app.services.launch.busy_gpus import occupied_note
from app.services.launch.cpu_slots import cpu_slots, oversubscription_note, queue_note
from app.services.launch.engines import ENGINES, NNUI, NNUNET_MISSING, Engine, engine
from app.services.launch.fold_claims import ClaimRefused
from app.services.launch.niceness import (
    NICE_ENV,
    THREADS_ENV,
    env_int,
    inherited_warning,
    nice_problems,
)
from app.services.launch.plans_check import plans_problems
from app.services.launch.schedule import Schedule, resumed_schedule
from app.services.launch.trainer_flags import flag_value
from app.services.machine.gpus import MachineSnapshot
from app.services.machine.procs import proc_info, valid_pid
from trainer.schema.status import TERMINAL_STATES, State, read_status
from trainer.schema.tree import (
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    FOLDS,
    ROOT_ENVS,
    DatasetNotFound,
    Roots,
    find_dataset,
    run_dir,
)

MODES = ("per_gpu", "spawn", "torchrun")
RETRAIN_FLAG = "--retrain"  # nnui-train's: start a finished fold over (asked explicitly)


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
    engine: str = NNUI  # "nnui" (nnui's trainer) | "nnunet" (the real nnU-Net, engines.py)
    schedule: Schedule = field(
        default_factory=Schedule
    )  # --when-free, --retries, --on-event (schedule.py)
    nice: int | None = None  # the trainer's nice value (niceness.py); None: as nnui's
    threads: int | None = None  # CPU threads per trainer (OMP_NUM_THREADS); None: its own
    oversubscribe: bool = False  # CPU: start every fold now, more jobs than CPU slots

    @property
    def on_cpu_slots(self) -> bool:
        """Real CPU jobs, one per fold: they take CPU slots (cpu_slots.py)."""
        return self.device == "cpu" and not self.simulated and self.mode == "per_gpu"


@dataclass
class LaunchChecks:
    errors: list[str] = field(default_factory=list)  # every refusal (usage ones included)
    warnings: list[str] = field(default_factory=list)
    resumable_folds: list[str] = field(default_factory=list)  # folds with a stopped run
    usage_errors: list[str] = field(default_factory=list)  # arguments that name nothing
    confirmations: list[str] = field(default_factory=list)  # GPUs in use: ask (busy_gpus.py)


@dataclass(frozen=True)
class Identity:
    """What a request trains: its engine, the -tr it runs, the trainer name of its run
    folder (a nnU-Net wrapper trains in its base's folder) and its plans identifier."""

    engine: Engine
    trainer: str
    folder_trainer: str
    plans: str


def identity(request: LaunchRequest) -> Identity:
    chosen = engine(request.engine)
    trainer = chosen.trainer_arg(flag_value(request.trainer_args, "-tr", chosen.default_trainer))
    plans = flag_value(request.trainer_args, "-p", chosen.default_plans)
    return Identity(chosen, trainer, chosen.folder_trainer(trainer), plans)


def request_run_dir(request: LaunchRequest, roots: Roots, dataset_name: str, fold: str) -> Path:
    who = identity(request)
    return run_dir(
        roots.results, dataset_name, request.configuration, fold, who.folder_trainer, who.plans
    )


def effective_roots(request: LaunchRequest, roots: Roots) -> Roots:
    """The roots the trainer will use: a resume's own, then trainer flags, then the caller's."""
    base = request.roots or roots
    raw = flag_value(request.trainer_args, "--raw", "")
    preprocessed = flag_value(request.trainer_args, "--preprocessed", "")
    results = flag_value(request.trainer_args, "--results", "")
    return Roots(
        raw=_root(raw) if raw else base.raw,
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


def resume_request(job: Job) -> LaunchRequest:
    """Continue a job's fold on the same GPUs in the same mode (`--c`), in the job's own
    results and preprocessed roots (recorded in its environment), not the caller's."""
    args = [a for a in job.trainer_args if a != "--c"]
    # A job of nnui 0.1 ran under nnU-Net's names without saying so: name its folder's.
    old = old_identity(job.run_dir) if job.engine == NNUI else None  # app/legacy.py
    if old is not None:
        trainer, plans = old
        if flag_value(args, "-tr", DEFAULT_TRAINER) != trainer:
            args += ["-tr", trainer]
        if flag_value(args, "-p", DEFAULT_PLANS) != plans:
            args += ["-p", plans]
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
        engine=job.engine,
        schedule=resumed_schedule(job),
        nice=env_int(job.env, NICE_ENV),
        threads=env_int(job.env, THREADS_ENV),
    )


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
    cpu = request.device == "cpu" and not request.simulated
    errors += request.schedule.problems(request.sequential, cpu)
    errors += nice_problems(request.nice, request.threads)
    if request.engine not in ENGINES:
        return [*errors, f"unknown engine {request.engine!r} (one of {', '.join(ENGINES)})"]
    if request.engine != NNUI and not engines.nnunet_available():
        return [*errors, NNUNET_MISSING]
    try:
        dataset_name = find_dataset(roots.preprocessed, request.dataset)
    except DatasetNotFound as error:
        return [*errors, str(error)]
    who = identity(request)
    if flag_check.checked(request.trainer_entry):  # a typo refused here, not a dead job
        flags = tuple(request.trainer_args)
        problem = flag_check.flag_problem(
            request.engine, dataset_name, request.configuration, flags
        )
        errors += [problem] if problem else []
    how = f"nnui-preprocess {dataset_name}"
    if request.engine != NNUI:
        how = f"nnUNetv2_plan_and_preprocess -d {dataset_name}"
    folder, plans_file = roots.preprocessed / dataset_name, who.engine.plans_file(who.plans)
    return errors + plans_problems(folder, request.configuration, who.plans, plans_file, how)


def fold_assignments(request: LaunchRequest) -> tuple[list[tuple[str, list[str]]], list[str]]:
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
    if request.schedule.when_free:  # each fold waits for any free GPU of the set
        return [(fold, gpus) for fold in folds], []
    if len(gpus) == len(folds):
        return [(f, [g]) for f, g in zip(folds, gpus, strict=True)], []
    if len(gpus) == 1 or request.sequential:
        return [(f, [gpus[i % len(gpus)]]) for i, f in enumerate(folds)], []
    return [], [
        f"{len(folds)} folds on {len(gpus)} GPUs: give one GPU per fold, or --sequential "
        "to run several folds on a GPU one after another"
    ]


def fold_requests(request: LaunchRequest) -> list[tuple[str, LaunchRequest]]:
    """The request split into one request per fold, each with the GPUs it would get (so a
    dry run can say which folds would start and which not)."""
    assignments, errors = fold_assignments(request)
    if errors or request.mode != "per_gpu" or request.schedule.when_free:
        return [(fold, replace(request, folds=[fold])) for fold in request.folds]
    return [
        (fold, replace(request, folds=[fold], gpus=list(gpus), sequential=False))
        for fold, gpus in assignments
    ]


def _group_size(request: LaunchRequest) -> int:
    return max(1, len(request.gpus)) if request.mode != "per_gpu" else 1


def _ddp_group_checks(
    request: LaunchRequest, plans_batch_size: int | None, checks: LaunchChecks
) -> None:
    """A DDP group splits one global batch: enough distinct GPUs, and an even split."""
    size = _group_size(request)
    if size < 2:
        checks.errors.append(
            f"a {request.mode} DDP group needs at least 2 GPUs (on CPU, --gpus 0,1 "
            "means 2 processes)"
        )
    if len(set(request.gpus)) != len(request.gpus):
        checks.errors.append("a GPU is listed twice in the DDP group")
    if plans_batch_size is None:
        return
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


def _shared_gpu_warnings(request: LaunchRequest, checks: LaunchChecks) -> None:
    """per_gpu without --sequential: folds given the same GPU train on it at once."""
    used = [g for g in request.gpus]
    for gpu in sorted(set(used)):
        if used.count(gpu) > 1 and len(request.folds) > 1 and request.device == "cuda":
            checks.warnings.append(
                f"GPU {gpu} gets {used.count(gpu)} folds at once (add --sequential to queue them)"
            )


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
    if request.mode not in engine(request.engine).modes:
        checks.errors.append(
            f"nnU-Net trains DDP groups with -num_gpus only: use --ddp spawn, not {request.mode}"
        )
        return checks
    if request.mode != "per_gpu":
        _ddp_group_checks(request, plans_batch_size, checks)
    _, assignment_errors = fold_assignments(request)
    checks.errors.extend(assignment_errors)
    if request.mode == "per_gpu" and not (request.sequential or request.schedule.when_free):
        _shared_gpu_warnings(request, checks)
    if request.on_cpu_slots:
        _cpu_slot_warnings(request, registry, checks)
    inherited = inherited_warning(request.nice)
    if inherited is not None:
        checks.warnings.append(inherited)
    try:
        dataset_name = find_dataset(roots.preprocessed, request.dataset)
    except DatasetNotFound as error:
        checks.errors.append(str(error))
        return checks
    if snapshot is not None and (request.simulated or request.device == "cuda"):
        gpu_checks(request, snapshot, checks)
    _fold_checks(request, roots, dataset_name, registry, checks)
    return checks


def gpu_checks(request: LaunchRequest, snapshot: MachineSnapshot, checks: LaunchChecks) -> None:
    if snapshot.driver_problem:
        checks.errors.append(f"{snapshot.driver_problem} (use --cpu)")
        return
    for gpu in dict.fromkeys(request.gpus):
        reading = snapshot.slot(gpu)
        if reading is None:
            checks.errors.append(f"GPU {gpu} is not visible on this machine")
            continue
        if reading.lost:
            checks.errors.append(f"GPU {gpu} is lost (NVML: GPU is lost): it needs a reset")
            continue
        if reading.mig_enabled:
            devices = ", ".join(d.uuid for d in reading.mig) or "none yet"
            checks.errors.append(f"GPU {gpu} is partitioned (MIG): give one of its MIG devices "
                                 f"({devices})")  # fmt: skip
            continue
        if request.schedule.when_free:
            continue  # busy now is why it waits
        if reading.busy:
            util = reading.utilization_percent
            checks.warnings.append(
                f"GPU {gpu} is busy (memory {reading.memory_used_fraction or 0:.0%}, "
                f"utilisation {'n/a' if util is None else util}%)"
            )
        if reading.other_users:
            checks.warnings.append(f"GPU {gpu} is used by {', '.join(reading.other_users)}")
        note = occupied_note(gpu, reading)
        if note is not None:
            checks.confirmations.append(note)


def running_cpu_jobs(registry: Registry | None) -> list[Job]:
    """The live real-CPU trainings of this user (any dataset): they hold CPU slots. A
    cascade fold still waiting for its previous stage's folds holds none: queued behind
    it, those folds would never start (it waits for them)."""
    return [
        j
        for j in (registry.list() if registry else [])
        if j.device == "cpu" and not j.simulated and j.kind == TRAIN and j.exit_code is None
        and not (j.after_previous_stage and j.process("trainer") is None)
        and job_alive(j, proc_info)
    ]  # fmt: skip


def _cpu_slot_warnings(
    request: LaunchRequest, registry: Registry | None, checks: LaunchChecks
) -> None:
    slots = cpu_slots(request.threads)
    running = len(running_cpu_jobs(registry))
    note = (oversubscription_note if request.oversubscribe else queue_note)(
        len(request.folds), slots, running
    )
    if note is not None:
        checks.warnings.append(note)


def running_jobs(registry: Registry | None, dataset_name: str, configuration: str) -> list[Job]:
    return [
        j
        for j in (registry.list() if registry else [])
        if j.dataset == dataset_name
        and j.configuration == configuration
        and j.exit_code is None
        and job_alive(j, proc_info)
    ]


def folder_problem(
    folder: Path, fold: str, continue_training: bool, running_jobs: list[Job],
    retrain: bool = False,
) -> tuple[str | None, bool]:  # fmt: skip
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
        return _nnunet_folder_problem(folder, fold, continue_training)
    state = status.state if isinstance(status.state, str) else "unknown"
    pids = [p for p in status.pids if valid_pid(p)] if isinstance(status.pids, list) else []
    if state not in TERMINAL_STATES and any(_pid_alive(p) for p in pids):
        return f"fold {fold} is already running (pids {pids})", False
    if continue_training:
        return None, False
    if state == State.FINISHED:
        return (None, False) if retrain else (finished_refusal(fold, folder), False)
    return (
        f"fold {fold} has an earlier run ({state} at epoch {status.epoch}): "
        "resume it (nnui resume JOB, or launch with --c) or move its folder away"
    ), True


def finished_refusal(fold: str, folder: Path) -> str:
    """The one wording for a finished fold, nnui-train's too (trainer/run.py)."""
    return (
        f"fold {fold} already finished training in {folder}; move that folder to train it "
        "again, or pass --retrain"
    )


def _nnunet_folder_problem(
    folder: Path, fold: str, continue_training: bool
) -> tuple[str | None, bool]:
    """A fold folder of a stock nnU-Net run (its checkpoints, no nnui status.json)."""
    if continue_training:
        return None, False
    if (folder / "checkpoint_final.pth").is_file():
        return (
            f"fold {fold} already finished training in {folder}; move that folder to train it again"
        ), False  # nnU-Net's files: nnui never replaces them, so no --retrain here
    if any(folder.glob("checkpoint_*.pth")):
        return (
            f"fold {fold} has an earlier nnU-Net run in {folder}: continue it with --c "
            "(nnui resume, or launch with --c) or move its folder away"
        ), True
    return None, False


def _fold_checks(
    request: LaunchRequest,
    roots: Roots,
    dataset_name: str,
    registry: Registry | None,
    checks: LaunchChecks,
) -> None:
    running = running_jobs(registry, dataset_name, request.configuration)
    for fold in request.folds:
        folder = request_run_dir(request, roots, dataset_name, fold)
        try:
            problem, resumable = folder_problem(
                folder,
                fold,
                request.continue_training,
                running,
                retrain=RETRAIN_FLAG in request.trainer_args,
            )
        except ClaimRefused as refused:
            problem, resumable = str(refused), False
        if problem is not None:
            checks.errors.append(problem)
        if resumable:
            checks.resumable_folds.append(fold)
        if not request.schedule.after_previous_stage:
            _cascade_check(request, folder, roots, fold, checks)


def _cascade_check(
    request: LaunchRequest, folder: Path, roots: Roots, fold: str, checks: LaunchChecks
) -> None:
    """A cascade fold started now needs its previous stage's segmentations already: one
    line naming the folds that have not written them (--after-lowres waits for them)."""
    stage, folds, inputs = stage_inputs.missing_at(folder, roots.preprocessed, fold,
                                                   request.engine)  # fmt: skip
    if stage and folds and inputs is not None:
        checks.errors.append(
            stage_inputs.refusal(request.configuration, fold, stage, folds, inputs)
        )


def _pid_alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and not info.zombie
