"""Starting trainings: the Popen of each job's supervisor (docs/contract.md), which then starts the
trainer; this module and supervisor/main.py are the only Popen users.

A launch request (request.py: the request, its checks, its roots) becomes one plan
per job: argv list, environment additions, run folder. `start()` claims the run folder
atomically (fold_claims.py: the folder checks again, then an exclusive claim, under one lock
with the registration), runs the plan under a small supervisor in a new session with
stdin from /dev/null and stdout/stderr into the run folder's console.<job>.<attempt>.log, so the job
outlives nnui and the SSH session, and records it in the registry.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import app
from app.services.jobs.consoles import console_name
from app.services.jobs.registry import PREDICT, TRAIN, Job, ProcessRecord, Registry, new_job_id
from app.services.launch import fold_claims as claims
from app.services.launch.cpu_slots import cpu_slots, slot_chains
from app.services.launch.engines import NNUI, NNUNET
from app.services.launch.fold_claims import ClaimRefused
from app.services.launch.niceness import job_env
from app.services.launch.request import (
    RETRAIN_FLAG,
    Identity,
    LaunchRequest,
    check_request,
    effective_roots,
    fold_assignments,
    folder_problem,
    identity,
    request_run_dir,
    running_cpu_jobs,
    running_jobs,
)
from app.services.launch.schedule import Schedule
from app.services.launch.trainer_flags import without_flags
from app.services.machine.gpus import MachineSnapshot
from app.services.machine.procs import process_identity
from trainer.schema.nnunet import NNUNET_EXT_ENV, with_nnunet_ext_dir
from trainer.schema.tree import JOB_ID_ENV, ROOT_ENVS, Roots, find_dataset

# Supervisors started by this process; polled so they never linger as zombies under nnui.
_started: list[subprocess.Popen[bytes]] = []
# Test hook: run this script instead of `-m trainer` (the fake trainer in tests/).
TRAINER_SCRIPT_ENV = "NNUI_TRAINER_SCRIPT"
# Test hook: run this script instead of `-m trainer.nnunet_engine` (tests/fake_nnunet).
NNUNET_SCRIPT_ENV = "NNUI_NNUNET_SCRIPT"
# Test hook: run this script instead of `-m torch.distributed.run` (a torchrun that records
# the signals it receives; it must stay the launcher process, so it runs torchrun in-process).
TORCHRUN_SCRIPT_ENV = "NNUI_TORCHRUN_SCRIPT"


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
    engine: str = NNUI
    kind: str = TRAIN  # TRAIN | PREDICT (prediction.py plans those; start() runs both)
    part_id: int | None = None
    num_parts: int | None = None
    output_dir: str | None = None
    schedule: Schedule = field(
        default_factory=Schedule
    )  # wait for free GPUs, retries, hook (schedule.py)


def trainer_entry(request: LaunchRequest) -> list[str]:
    if request.trainer_entry:
        return list(request.trainer_entry)
    script = os.environ.get(TRAINER_SCRIPT_ENV)
    return [script] if script else ["-m", "trainer"]


def torchrun_entry() -> list[str]:
    script = os.environ.get(TORCHRUN_SCRIPT_ENV)
    return [script] if script else ["-m", "torch.distributed.run"]


def plan_launch(
    request: LaunchRequest,
    roots: Roots,
    plans_batch_size: int | None,
    snapshot: MachineSnapshot | None = None,
    registry: Registry | None = None,
    job_ids: Callable[[str], str] = new_job_id,
) -> tuple[list[LaunchPlan], list[str]]:
    """Plans for every job of the request, or no plans and the errors (warnings: check_request);
    `job_ids` names each fold's job (the launch form: the id its preview showed)."""
    checks = check_request(request, roots, plans_batch_size, snapshot, registry)
    if checks.errors:
        return [], checks.errors
    roots = effective_roots(request, roots)
    dataset_name = find_dataset(roots.preprocessed, request.dataset)
    assignments, _ = fold_assignments(request)
    who = identity(request)
    device = "cpu" if request.simulated else request.device
    job_mode = "single" if request.mode == "per_gpu" else request.mode
    plans: list[LaunchPlan] = []
    last_on = _cpu_slot_chains(request, registry)
    slots = cpu_slots(request.threads).count if request.on_cpu_slots else 1
    for index, (fold, gpus) in enumerate(assignments):
        job_id = job_ids(fold)
        folder = request_run_dir(request, roots, dataset_name, fold)
        argv = _argv(request, who, dataset_name, fold, device, job_mode, len(gpus))
        env = _plan_env(request, roots, who.engine.name, job_id, gpus if device == "cuda" else None)
        key = tuple(gpus) if gpus else ("cpu", fold)
        after = last_on.get(key) if request.sequential else None
        if request.on_cpu_slots and not request.oversubscribe:
            key = ("cpu-slot", str(index % slots))  # one job per CPU slot at a time
            after = last_on.get(key)
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
                console_path=folder / console_name(job_id),
                after=after,
                dataset=dataset_name,
                configuration=request.configuration,
                device=device,
                simulated=request.simulated,
                trainer_args=tuple(request.trainer_args),
                continue_training=request.continue_training,
                engine=who.engine.name,
                schedule=request.schedule,
            )
        )
    return plans, []


def _plan_env(
    request: LaunchRequest, roots: Roots, engine: str, job_id: str, gpus: Sequence[str] | None
) -> dict[str, str]:
    """A job's environment additions (`gpus`: its CUDA_VISIBLE_DEVICES, None on a CPU)."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", JOB_ID_ENV: job_id}
    env.update(job_env(request.nice, request.threads))  # --nice, --threads (niceness.py)
    # The trainer finds the same roots as nnui, whichever way nnui was given them.
    env.update({ROOT_ENVS[name]: str(getattr(roots, name)) for name in ROOT_ENVS})
    if engine == NNUNET:
        env[NNUNET_EXT_ENV] = with_nnunet_ext_dir(os.environ.get(NNUNET_EXT_ENV))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    return env


def _cpu_slot_chains(
    request: LaunchRequest, registry: Registry | None
) -> dict[tuple[str, ...], str]:
    """The CPU jobs already running, as the job each CPU slot's next job waits for."""
    if not request.on_cpu_slots or request.oversubscribe:
        return {}
    chains = slot_chains(cpu_slots(request.threads), running_cpu_jobs(registry))
    return {("cpu-slot", str(slot)): job_id for slot, job_id in chains.items()}


def _argv(
    request: LaunchRequest, who: Identity, dataset: str, fold: str, device: str, mode: str,
    size: int,
) -> list[str]:  # fmt: skip
    """The trainer's argv list (never a shell string) for one fold."""
    args = [dataset, request.configuration, fold]
    user_args = list(request.trainer_args)
    entry = trainer_entry(request)
    if who.engine.name == NNUNET:  # nnU-Net's own names for the identifiers, ours forced
        args += ["-tr", who.trainer, "-p", who.plans]
        user_args = without_flags(user_args, ("-tr", "-p"))
        script = os.environ.get(NNUNET_SCRIPT_ENV)
        entry = list(request.trainer_entry) or ([script] if script else list(who.engine.entry))
    args += ["-device", device, *user_args]
    if request.continue_training and "--c" not in args:
        args.append("--c")
    if mode == "spawn":
        return [sys.executable, *entry, *args, "-num_gpus", str(size)]
    if mode == "torchrun":
        return [sys.executable, *torchrun_entry(), "--standalone", f"--nproc_per_node={size}",
                *entry, *args]  # fmt: skip
    return [sys.executable, *entry, *args]


def preview(plan: LaunchPlan) -> str:
    """The exact command as copy-pasteable shell text (what start() runs, minus the supervisor)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
    wait = f"# after job {plan.after} ends\n" if plan.after else ""
    if plan.schedule.when_free:
        wait += f"# when a GPU of {','.join(plan.gpus)} is free (it is set then)\n"
    if plan.schedule.after_previous_stage:
        wait += "# when the previous stage's folds wrote its inputs (--after-lowres)\n"
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
    if plan.kind == PREDICT:  # its own folder in the state dir: no run folder to claim
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        return _register_and_start(plan, registry)
    results_root = plan.run_dir.parents[2]  # results/DatasetNNN_Name/T__P__C/fold_F
    with claims.locked(results_root):
        running = running_jobs(registry, plan.dataset, plan.configuration)
        problem, _ = folder_problem(
            plan.run_dir, plan.fold, plan.continue_training, running,
            retrain=RETRAIN_FLAG in plan.trainer_args,
        )  # fmt: skip
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
        engine=plan.engine,
        kind=plan.kind,
        part_id=plan.part_id,
        num_parts=plan.num_parts,
        output_dir=plan.output_dir,
        **plan.schedule.job_fields(plan.gpus),
    )
    registry.add(job)
    env = {**_without_launcher_leftovers(os.environ), **plan.env, "PYTHONPATH": _python_path()}
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


# A shell that once ran torchrun or srun keeps these; a job nnui starts must not inherit
# them (the trainer would take itself for a rank of that finished job). torchrun sets its own.
LAUNCHER_LEFTOVERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def _without_launcher_leftovers(environ: os._Environ | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k not in LAUNCHER_LEFTOVERS}


def reap_children() -> None:
    """Collect supervisors of this process that have exited (cheap; call it now and then)."""
    _started[:] = [p for p in _started if p.poll() is None]
