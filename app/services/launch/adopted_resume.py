"""Continuing an adopted run (a run nnui did not launch) through nnui: the launch that runs
its own argv again with `--c`, in its own roots, under a supervisor from then on."""

from __future__ import annotations

import sys
from pathlib import Path

from app.services.jobs.adopted import flag_in, newest_run, roots_env
from app.services.jobs.consoles import console_name
from app.services.jobs.registry import Job, new_job_id
from app.services.launch.launcher import LaunchPlan, torchrun_entry
from trainer.schema.tree import JOB_ID_ENV


def resume_plan(job: Job) -> LaunchPlan | str:
    """The launch that continues an adopted run as it was started (its own argv + `--c`,
    in its own roots, the same launcher and rank count), as an nnui job with a supervisor
    from then on; or why it cannot (one line)."""
    run = newest_run(job.run_dir) if job.run_dir else None
    if run is None or not run.argv:
        return f"no run_started with its argv in {job.run_dir or 'an unknown folder'}"
    if run.launcher not in ("single", "spawn", "torchrun"):
        return (f"it was started by {run.launcher} (srun/SLURM): submit its job script again "
                "with --c")  # fmt: skip
    args = [a for a in run.argv if a != "--c"] + ["--c"]
    argv = [sys.executable, *trainer_entry_argv(), *args]
    if run.launcher == "torchrun":
        argv = [sys.executable, *torchrun_entry(), "--standalone",
                f"--nproc_per_node={run.world_size}", *trainer_entry_argv(), *args]  # fmt: skip
    job_id = new_job_id(run.fold)
    env = {JOB_ID_ENV: job_id, **roots_env(job.run_dir)}
    positional = args[3:]
    return LaunchPlan(
        job_id=job_id, fold=run.fold, argv=argv, env=env, gpus=[], mode=job.mode,
        run_dir=Path(job.run_dir), console_path=Path(job.run_dir) / console_name(job_id),
        after=None, dataset=run.dataset, configuration=run.configuration,
        device="cpu" if flag_in(run.argv, "-device") == "cpu" else "cuda",
        trainer_args=tuple(a for a in positional if a != "--c"), continue_training=True,
    )  # fmt: skip


def trainer_entry_argv() -> list[str]:
    return ["-m", "trainer"]
