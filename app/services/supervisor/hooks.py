"""Event hooks (`--on-event CMD`): what a job's hook command is told, in its environment.

The command is split once at launch (shlex) and stored as an argv list; the supervisor runs
it (never through a shell) when the job starts after waiting, is restarted, stalls,
finishes or fails. The event and the job travel in environment variables, so a script
needs no parsing: NNUI_EVENT, NNUI_JOB_ID, NNUI_DATASET, NNUI_CONFIGURATION, NNUI_FOLD, NNUI_GPUS,
NNUI_RUN_DIR, NNUI_EXIT_CODE, NNUI_REASON and NNUI_DICE (the final validation's mean
foreground Dice, else the last epoch's EMA pseudo Dice; empty when there is none).
"""

from __future__ import annotations

import enum
import math
import shlex

from app.services.jobs.events import JobEvents, Scope
from app.services.jobs.registry import Job
from trainer.schema.events import Kind
from trainer.schema.tree import JOB_ID_ENV


class JobEvent(str, enum.Enum):
    STARTED = "started"  # its trainer started after waiting for GPUs
    RESTARTED = "restarted"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"
    STALLED = "stalled"  # the stall watchdog flagged it (stall.py); NNUI_REASON says why

    def __str__(self) -> str:
        return self.value


HOOK_EVENTS = frozenset(JobEvent)


def parse_hook(text: str) -> list[str]:
    """`--on-event` text to an argv list; ValueError (one line) when it cannot be split."""
    try:
        argv = shlex.split(text)
    except ValueError as error:
        raise ValueError(f"--on-event {text!r}: {error}") from None
    if not argv:
        raise ValueError("--on-event needs a command")
    return argv


def final_dice(job: Job) -> float | None:
    """The job's final validation Dice, else its last EMA pseudo Dice (None: none yet)."""
    events = JobEvents(job.run_dir)
    dice: float | None = None
    validated: float | None = None
    for scope, record in events.poll(job).records:
        if scope is not Scope.MINE:
            continue
        if record["kind"] == Kind.VALIDATION_FINISHED:
            validated = record.get("mean_fg_dice")
        elif record["kind"] == Kind.EPOCH_ENDED:
            dice = record.get("ema_fg_dice")
    value = validated if validated is not None else dice
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def hook_env(
    job: Job, event: JobEvent, reason: str = "", exit_code: int | None = None
) -> dict[str, str]:
    """Environment additions for the hook command of one event."""
    dice = (
        final_dice(job) if event in (JobEvent.FINISHED, JobEvent.FAILED, JobEvent.STOPPED) else None
    )
    return {
        "NNUI_EVENT": str(event),
        JOB_ID_ENV: job.job_id,
        "NNUI_DATASET": job.dataset,
        "NNUI_CONFIGURATION": job.configuration,
        "NNUI_FOLD": job.fold,
        "NNUI_GPUS": ",".join(job.gpus),
        "NNUI_RUN_DIR": job.run_dir,
        "NNUI_EXIT_CODE": "" if exit_code is None else str(exit_code),
        "NNUI_REASON": reason,
        "NNUI_DICE": "" if dice is None else f"{dice:.4f}",
    }


def final_kind(job: Job) -> str | None:
    """How the job's run ended by its own events: stopped, finished or failed (None: none)."""
    last: str | None = None
    for scope, record in JobEvents(job.run_dir).poll(job).records:
        if scope is Scope.MINE and record["kind"] in (Kind.STOPPED, Kind.FINISHED, Kind.FAILED):
            last = record["kind"]
    return last


def log_record(job: Job, env: dict[str, str]) -> dict[str, object]:
    """The job event log's line (job_log.py) for one event, from its hook environment."""
    code = env["NNUI_EXIT_CODE"]
    return {
        "event": env["NNUI_EVENT"],
        "job_id": job.job_id,
        "dataset": job.dataset,
        "configuration": job.configuration,
        "fold": job.fold,
        "gpus": list(job.gpus),
        "exit_code": int(code) if code else None,
        "reason": env["NNUI_REASON"],
        "dice": env["NNUI_DICE"],
        "run_dir": job.run_dir,
    }
