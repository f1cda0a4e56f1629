"""Predictions as jobs (`nnui predict`, the board's prediction form): one job per chosen GPU,
each predicting one part of the input folder (`nnui-predict -num_parts N -part_id K`), so
the parts cover every case exactly once.

A prediction job is a launcher.LaunchPlan of kind "predict": the same supervisor, registry,
topology-based stop (SIGUSR1 to the verified predictor only: it finishes the current case
and exits 0) and kill as a training. Its folder is its own, `<state dir>/predictions/<job>/`
(events.jsonl from `--events`, console.log): nothing of nnui's lands among the predictions
or in nnU-Net's folders. Every check runs before anything starts: usage mistakes (an input
without cases, OUT = IN, a fold without its checkpoint) are exit 2, a prediction already
writing to the same folder is a refusal.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import PREDICT, Job, Registry, new_job_id
from app.services.launch import fold_claims as claims
from app.services.launch import launcher
from app.services.launch.launcher import LaunchPlan
from app.services.launch.request import LaunchChecks, gpu_checks
from app.services.launch.trainer_flags import flag_value, without_flags
from app.services.machine.gpus import MachineSnapshot
from app.services.machine.procs import proc_info
from trainer.schema.nnunet import refuse_nnunet_output
from trainer.schema.tree import (
    CHECKPOINT_KINDS,
    CONSOLE_FILE,
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    EVENTS_FILE,
    FOLDS,
    IMAGE_ENDINGS,
    JOB_ID_ENV,
    ROOT_ENVS,
    DatasetNotFound,
    Roots,
    checkpoint_file,
    find_dataset,
    run_dir,
)

PREDICTIONS_DIR = "predictions"  # in the state dir: one folder per prediction job
# Test hook: run this script instead of `-m trainer.predict` (it must call its main()).
PREDICT_SCRIPT_ENV = "NNUI_PREDICT_SCRIPT"
_CHANNEL_0 = re.compile(r"^.+_0000(" + "|".join(re.escape(e) for e in IMAGE_ENDINGS) + ")$")


@dataclass(frozen=True)
class PredictRequest:
    input_dir: Path
    output_dir: Path
    dataset: str
    configuration: str
    folds: tuple[str, ...] = ("0", "1", "2", "3", "4")
    gpus: tuple[str, ...] = ()  # one part each; () on a real CPU: one part
    device: str = "cuda"  # "cuda" | "cpu"
    simulated: bool = False  # simulated GPUs: the parts run with -device cpu
    predict_args: tuple[str, ...] = field(default=())  # nnui-predict flags, passed through


@dataclass
class PredictChecks(LaunchChecks):
    """errors (usage_errors among them: exit 2), warnings (busy GPUs, other users)."""

    dataset_name: str = ""


def _input_problem(request: PredictRequest) -> str | None:
    in_dir = Path(request.input_dir)
    if not in_dir.is_dir():
        return f"input folder {in_dir} does not exist"
    try:
        names = [entry.name for entry in os.scandir(in_dir) if entry.is_file()]
    except OSError as error:
        return f"cannot read input folder {in_dir}: {error.strerror or error}"
    if not any(_CHANNEL_0.match(name) for name in names):
        return f"{in_dir} holds no images named CASE_0000<ending> ({', '.join(IMAGE_ENDINGS)})"
    out_dir = Path(request.output_dir)
    if out_dir.absolute().resolve() == in_dir.absolute().resolve():
        return f"-o {out_dir} is the input folder: choose another output folder"
    try:
        refuse_nnunet_output(out_dir)  # nnU-Net's predictions there would be replaced
    except ValueError as refused:
        return str(refused)
    return None


def _checkpoint_problems(request: PredictRequest, roots: Roots, dataset_name: str) -> list[str]:
    args = list(request.predict_args)
    chk = flag_value(args, "-chk", "checkpoint_final").removesuffix(".safetensors")
    kind = chk.removeprefix("checkpoint_")
    if kind not in CHECKPOINT_KINDS:
        return [f"-chk {chk}: choose checkpoint_final, checkpoint_best or checkpoint_latest"]
    trainer = flag_value(args, "-tr", DEFAULT_TRAINER)
    plans = flag_value(args, "-p", DEFAULT_PLANS)
    problems = []
    for fold in request.folds:
        folder = run_dir(roots.results, dataset_name, request.configuration, fold, trainer, plans)
        if not (folder / checkpoint_file(kind)).is_file():
            problems.append(
                f"fold {fold} has no {checkpoint_file(kind)} in {folder}: train it first or "
                "leave it out of -f"
            )
    return problems


def _usage_errors(request: PredictRequest, roots: Roots) -> tuple[list[str], str]:
    """(mistakes in the arguments, the dataset's folder name)."""
    problem = _input_problem(request)
    if problem is not None:
        return [problem], ""
    bad = [f for f in request.folds if f not in FOLDS]
    if bad or not request.folds:
        return [f"-f {' '.join(bad) or '(none)'}: folds are 0-4 or all"], ""
    if len(set(request.gpus)) != len(request.gpus):
        return ["a GPU is listed twice: each GPU predicts one part"], ""
    if request.device == "cuda" and not request.gpus:
        return ["no GPU chosen: pick GPUs (one part each) or run on CPU"], ""
    try:
        name = find_dataset(roots.preprocessed, request.dataset)
    except DatasetNotFound as error:
        return [str(error)], ""
    return _checkpoint_problems(request, roots, name), name


def writers_of(output_dir: Path, registry: Registry) -> list[Job]:
    """Live prediction jobs writing into this folder."""
    target = Path(output_dir).absolute()
    return [
        job
        for job in registry.list()
        if job.kind == PREDICT
        and job.output_dir is not None
        and Path(job.output_dir) == target
        and job.exit_code is None
        and job_alive(job, proc_info)
    ]


def check_prediction(
    request: PredictRequest,
    roots: Roots,
    registry: Registry,
    snapshot: MachineSnapshot | None = None,
) -> PredictChecks:
    checks = PredictChecks()
    checks.usage_errors, checks.dataset_name = _usage_errors(request, roots)
    checks.errors.extend(checks.usage_errors)
    if checks.usage_errors:
        return checks
    busy = writers_of(request.output_dir, registry)
    if busy:
        ids = ", ".join(j.job_id for j in busy)
        checks.errors.append(
            f"job {ids} is already predicting into {request.output_dir}: wait for it or stop it"
        )
    if snapshot is not None and not request.simulated and request.device == "cuda":
        gpu_checks(request, snapshot, checks)  # type: ignore[arg-type]  # reads .gpus only
    return checks


def predict_entry() -> list[str]:
    script = os.environ.get(PREDICT_SCRIPT_ENV)
    return [script] if script else ["-m", "trainer.predict"]


def _argv(request: PredictRequest, dataset_name: str, device: str, part: tuple[int, int],
          events: Path) -> list[str]:  # fmt: skip
    """nnui-predict's argv for one part (a list, never a shell string)."""
    part_id, num_parts = part
    user_args = without_flags(list(request.predict_args), ("-device", "-num_parts", "-part_id"))
    return [
        sys.executable, *predict_entry(),
        "-i", str(Path(request.input_dir).absolute()),
        "-o", str(Path(request.output_dir).absolute()),
        "-d", dataset_name, "-c", request.configuration, "-f", *request.folds,
        "-device", device, "-num_parts", str(num_parts), "-part_id", str(part_id),
        *user_args, "--events", str(events),
    ]  # fmt: skip


def plan_prediction(
    request: PredictRequest, roots: Roots, registry: Registry, dataset_name: str
) -> list[LaunchPlan]:
    """One plan per GPU (part k of N on GPU k), after check_prediction found no error."""
    device = "cpu" if request.simulated else request.device
    slots: list[str | None] = list(request.gpus) or [None]
    plans = []
    for part_id, gpu in enumerate(slots):
        job_id = new_job_id(str(part_id), tag="p")
        folder = registry.state_dir / PREDICTIONS_DIR / job_id
        argv = _argv(request, dataset_name, device, (part_id, len(slots)), folder / EVENTS_FILE)
        env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", JOB_ID_ENV: job_id}
        env.update({ROOT_ENVS[name]: str(getattr(roots, name)) for name in ROOT_ENVS})
        if device == "cuda" and gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        plans.append(
            LaunchPlan(
                job_id=job_id, fold=",".join(request.folds), argv=argv, env=env,
                gpus=[gpu] if gpu is not None else [], mode="single", run_dir=folder,
                console_path=folder / CONSOLE_FILE, after=None, dataset=dataset_name,
                configuration=request.configuration, device=device,
                simulated=request.simulated, trainer_args=tuple(request.predict_args),
                kind=PREDICT, part_id=part_id, num_parts=len(slots),
                output_dir=str(Path(request.output_dir).absolute()),
            )
        )  # fmt: skip
    return plans


def start_prediction(plans: list[LaunchPlan], registry: Registry) -> list[Job]:
    """Start every part, or none when a prediction into the same folder got in meanwhile
    (checked again under a lock every nnui of this user shares)."""
    if not plans:
        return []
    with claims.locked(registry.state_dir):
        output = Path(plans[0].output_dir or "")
        busy = writers_of(output, registry)
        if busy:
            raise claims.ClaimRefused(
                f"job {busy[0].job_id} is already predicting into {output}: wait for it or stop it"
            )
        return [launcher.start(plan, registry) for plan in plans]


def resume_plan(job: Job, registry: Registry) -> LaunchPlan:
    """The same part again, with --continue_prediction (the cases written are skipped), as
    a new job with its own folder; same GPU, roots and flags."""
    job_id = new_job_id(str(job.part_id or 0), tag="p")
    folder = registry.state_dir / PREDICTIONS_DIR / job_id
    argv = without_flags(list(job.argv), ("--events",))
    if "--continue_prediction" not in argv:
        argv.append("--continue_prediction")
    argv += ["--events", str(folder / EVENTS_FILE)]
    return LaunchPlan(
        job_id=job_id, fold=job.fold, argv=argv, env={**job.env, JOB_ID_ENV: job_id},
        gpus=list(job.gpus), mode=job.mode, run_dir=folder, console_path=folder / CONSOLE_FILE,
        after=None, dataset=job.dataset, configuration=job.configuration, device=job.device,
        simulated=job.simulated, trainer_args=tuple(job.trainer_args), kind=PREDICT,
        part_id=job.part_id, num_parts=job.num_parts, output_dir=job.output_dir,
    )  # fmt: skip
