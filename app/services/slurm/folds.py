"""`nnui launch D C --folds 0-4 --slurm`: one `nnui sbatch` job per fold (a multi-node DDP
fold is one job), a cascade's --after-lowres as SLURM `afterok` dependencies.

The jobs train in the same results tree as the board reads (the roots are exported in the
script), so a cluster fold is followed like any other; nnui records each job it submits
(slurm_control.py) so that stop, kill and resume find its script again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from app.services.jobs.slurm_jobs import SlurmJob, SlurmWatcher
from app.services.launch.engines import NNUNET
from app.services.launch.request import LaunchRequest
from app.services.launch.stage_inputs import missing_at
from app.services.slurm.control import submit, write_record
from app.services.slurm.script import (
    JobSpec,
    UsageError,
    check_preprocessed,
    fold_folder,
    write_script,
)
from trainer.schema.nnunet import NNUNET_EXT_DIR, NNUNET_EXT_ENV
from trainer.schema.status import State, read_status
from trainer.schema.tree import FOLDS, ROOT_ENVS, Roots


@dataclass(frozen=True)
class ClusterLimits:
    """What `--slurm` asks the cluster for (the same for every fold of one launch)."""

    time_limit: str  # [D-]HH:MM:SS
    partition: str | None = None
    account: str | None = None
    nodes: int = 1
    gpus_per_node: int = 1  # 0: a CPU run
    procs_per_node: int = 1  # CPU runs: processes per node
    cpus_per_task: int | None = None
    signal_lead_s: int = 600
    requeue: bool = False
    output: Path = Path("nnui_slurm")  # the scripts and the jobs' logs


def expand_folds(text: str) -> list[str]:
    """`0-4`, `0,2,3`, `1-2,4` or `all` as the list of folds (order and repeats kept: the
    launch checks refuse a fold given twice)."""
    folds: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        low, dash, high = part.partition("-")
        if dash and low.isdigit() and high.isdigit() and int(low) <= int(high):
            folds += [str(f) for f in range(int(low), int(high) + 1)]
        elif part:
            folds.append(part)
    return folds


def fold_specs(request: LaunchRequest, roots: Roots, limits: ClusterLimits) -> list[JobSpec]:
    """One job spec per fold; UsageError (one line) for a fold that cannot go."""
    env = {ROOT_ENVS[name]: str(getattr(roots, name)) for name in ("raw", "preprocessed",
                                                                    "results")}  # fmt: skip
    if request.engine == NNUNET:
        env[NNUNET_EXT_ENV] = str(NNUNET_EXT_DIR)
    specs = []
    for index, fold in enumerate(request.folds):
        if fold in request.folds[:index]:
            raise UsageError(f"fold {fold} is given twice")
        if fold not in FOLDS:
            raise UsageError(f"fold {fold!r} is not one of {', '.join(FOLDS)}")
        spec = JobSpec(
            dataset=request.dataset, configuration=request.configuration, fold=fold,
            nodes=limits.nodes, gpus_per_node=limits.gpus_per_node,
            time_limit=limits.time_limit, procs_per_node=limits.procs_per_node,
            signal_lead_s=limits.signal_lead_s, partition=limits.partition,
            account=limits.account, cpus_per_task=limits.cpus_per_task,
            output_dir=limits.output.absolute(), workdir=Path.cwd(),
            trainer_args=tuple(request.trainer_args), env=env, engine=request.engine,
        )  # fmt: skip
        spec.validate()
        name = check_preprocessed(spec)
        spec = replace(spec, run_folder=fold_folder(spec, name), requeue=limits.requeue)
        _refuse_finished(spec)
        specs.append(spec)
    return specs


def _refuse_finished(spec: JobSpec) -> None:
    folder = spec.run_folder
    status = read_status(folder) if folder is not None else None
    if (
        status is not None
        and status.state == State.FINISHED
        and "--retrain" not in (spec.trainer_args)
    ):
        raise UsageError(
            f"fold {spec.fold} already finished training in {folder}; move that folder to "
            "train it again, or pass --retrain after --"
        )


def lowres_dependency(
    spec: JobSpec, preprocessed: Path, queued: list[SlurmJob] | None = None
) -> str | None:
    """`afterok:J1:J2` on the SLURM jobs of the previous stage's folds whose segmentations
    this cascade fold still misses; None when none is missing. UsageError when a missing
    fold has no job queued or running."""
    assert spec.run_folder is not None
    stage, folds, _ = missing_at(spec.run_folder, preprocessed, spec.fold, spec.engine)
    if stage is None or not folds:
        return None
    jobs = SlurmWatcher().jobs() if queued is None else queued
    wanted = {str(f) for f in folds}
    dataset = spec.run_folder.parents[1].name
    found = {j.args.fold: j.job_id for j in jobs
             if j.args.configuration == stage and j.args.fold in wanted
             and _same_dataset(j.args.dataset, dataset)}  # fmt: skip
    absent = sorted(wanted - set(found))
    if absent:
        raise UsageError(
            f"{spec.configuration} fold {spec.fold} needs {stage} fold(s) {', '.join(absent)} "
            f"first and no SLURM job of yours trains them: nnui launch {spec.dataset} {stage} "
            f"--folds {','.join(absent)} --slurm ..."
        )
    return "afterok:" + ":".join(found[f] for f in sorted(found))


def _same_dataset(given: str, name: str) -> bool:
    """`4`, `004` or the full name against `Dataset004_Name`."""
    if given == name:
        return True
    number = name.removeprefix("Dataset").split("_", 1)[0]
    return given.isdigit() and number.isdigit() and int(given) == int(number)


def dependencies(
    specs: list[JobSpec], preprocessed: Path, after_previous_stage: bool
) -> list[str | None]:
    """Each fold's `afterok:...` (--after-lowres), all checked before any job is submitted."""
    return [lowres_dependency(s, preprocessed) if after_previous_stage else None for s in specs]


def submit_fold(spec: JobSpec, dependency: str | None) -> str:
    """Write the fold's script, submit it and record the job; its SLURM job id."""
    script = write_script(spec)
    job_id = submit(script, dependency)
    write_record(job_id, script, spec.run_folder, spec.fold)
    return job_id
