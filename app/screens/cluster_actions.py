"""s, k and r on cluster folds (the board's `slurm:JOB` rows, and stopped runs nnui put on
SLURM): the same keys as for local jobs, SLURM's commands behind them (the CLI's twin:
app/cli/cluster.py). Each is confirmed with the exact command first; the SLURM calls run
off the UI thread and their results come back as one notification.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.screens.confirm import LaunchConfirmScreen
from app.screens.seam import AppSeam
from app.services.jobs.slurm_jobs import SLURM_ID_PREFIX
from app.services.jobs.views import JobView
from app.services.slurm.control import (
    ENDED,
    SlurmError,
    active_job_of,
    batch_script,
    cancel,
    graceful_stop,
    is_nnui_script,
    job_info,
    record_for_folder,
    submit,
    write_record,
)
from trainer.schema.status import ACTIVE_STATES


def split(views: list[JobView], action: str) -> tuple[list[JobView], list[JobView]]:
    """(the views SLURM acts on, the others): `slurm:JOB` rows for stop and kill; for resume
    the ended runs whose folder nnui submitted a job for (their script goes again)."""
    if action == "resume":
        mine = [v for v in views if v.state not in ACTIVE_STATES and v.job.run_dir
                and record_for_folder(v.job.run_dir) is not None]  # fmt: skip
    else:
        mine = [v for v in views if v.job.job_id.startswith(SLURM_ID_PREFIX)]
    return mine, [v for v in views if v not in mine]


def act(app: AppSeam, views: list[JobView], action: str) -> None:
    """Confirm, then run `action` on each view's SLURM job and notify the results."""
    work: dict[str, Callable[[JobView], str]] = {"stop": _stop, "kill": _kill,
                                                 "resume": _resume}  # fmt: skip
    commands = {"stop": "scancel --signal=USR1 --batch JOB (nnui's script: graceful stop; "
                        "pending: scancel JOB)", "kill": "scancel JOB (the epoch is lost)",
                "resume": "sbatch SCRIPT again (it passes --c)"}  # fmt: skip
    previews = [f"{v.job.job_id}: {v.job.run_dir or v.job.note}" for v in views]
    title = f"{action.capitalize()} on SLURM: {commands[action]}"

    def confirmed(ok: Any) -> None:
        if ok:
            app.run_in_thread(lambda: [work[action](v) for v in views], done)

    def done(result: Any) -> None:
        text = str(result) if isinstance(result, Exception) else "\n".join(result)
        app.notify(text, title=action, timeout=10)
        app.poll_jobs()

    app.push_screen(LaunchConfirmScreen(title, previews, []), confirmed)


def _job_id(view: JobView) -> str:
    return view.job.job_id.removeprefix(SLURM_ID_PREFIX)


def _stop(view: JobView) -> str:
    name = view.job.job_id
    try:
        job = job_info(_job_id(view))
        if job.state in ENDED or not job.state:
            return f"{name}: nothing to do, SLURM job is {job.state or 'over'}"
        if job.state == "PENDING":
            cancel(job.job_id)
            return f"{name}: pending job cancelled (nothing trained)"
        if not is_nnui_script(batch_script(job)):
            return (f"{name}: refused: its batch script is not nnui's (no USR1 relay); stop it "
                    f"on the node that trains it ({job.nodes or '?'})")  # fmt: skip
        graceful_stop(job)
    except SlurmError as problem:
        return f"{name}: {problem}"
    return f"{name}: USR1 to its batch shell: the fold checkpoints and exits after this epoch"


def _kill(view: JobView) -> str:
    try:
        cancel(_job_id(view))
    except SlurmError as problem:
        return f"{view.job.job_id}: {problem}"
    return f"{view.job.job_id}: scancel sent"


def _resume(view: JobView) -> str:
    record = record_for_folder(view.job.run_dir) or {}
    script = Path(str(record.get("script")))
    name = view.job.job_id
    active = active_job_of(script)
    if active is not None:
        return f"{name}: nothing to do, {SLURM_ID_PREFIX}{active} already runs {script}"
    try:
        job_id = submit(script)
    except SlurmError as problem:
        return f"{name}: {problem}"
    write_record(job_id, script, Path(view.job.run_dir), view.job.fold)
    return f"{name}: {script.name} submitted again as {SLURM_ID_PREFIX}{job_id} (--c)"
