"""Auto-resume (`--retries N`): which ends of a trainer earn a restart with `--c`.

A trainer that ended abnormally — a non-zero exit code other than 2 (a usage error), or a
signal nnui did not send (the OOM killer, a `kill -9`) — is started again with `--c` after
a back-off, at most N times. Never after a NaN loss (the run would only fail again), a
user's stop or kill, or a clean end. Pure decisions over the job and its attempt's events;
the supervisor acts on them.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

from app.services.jobs.events import JobEvents, Scope
from app.services.jobs.registry import Job
from trainer.schema.events import Kind

USAGE_EXIT = 2
BACKOFF_FIRST_S = 2.0
BACKOFF_MAX_S = 300.0


@dataclass(frozen=True)
class AttemptEnd:
    exit_code: int  # Popen's: negative = the signal that ended it
    nan_loss: bool  # an epoch of this attempt had a NaN loss (or it failed of one)
    started_at: float  # when this attempt's trainer started


def describe_exit(code: int) -> str:
    """`exit 137 (SIGKILL)` for a signal, `exit 3` for an exit code (what a shell shows)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exit {128 - code} ({name})"
    return f"exit {code}"


def ended_by_watchdog(job: Job, since: float) -> bool:
    """The stall watchdog stopped or killed this attempt (stall_watch.py)."""
    return job.stall_acted_at is not None and job.stall_acted_at >= since


def ended_by_user(job: Job, since: float) -> bool:
    """A stop or kill of this attempt (or one queued for it) came from the user; the
    signals the stall watchdog sent (from its first action on) are not the user's."""
    acted = job.stall_acted_at
    until = acted if acted is not None and ended_by_watchdog(job, since) else math.inf
    sent = any(s.result == "sent" and since <= s.t < until for s in job.signals)
    return sent or job.queued_stop or job.killed_at is not None


def restart_reason(job: Job, end: AttemptEnd) -> str | None:
    """Why this attempt is restarted (its end, for the record), or None: it is not."""
    if len(job.restarts) >= job.retries or end.nan_loss or ended_by_user(job, end.started_at):
        return None
    if ended_by_watchdog(job, end.started_at):  # abnormal even when it stopped cleanly
        return (
            f"stalled ({job.stall_reason}), ended by the watchdog: {describe_exit(end.exit_code)}"
        )
    if end.exit_code == 0 or end.exit_code == USAGE_EXIT:
        return None
    return describe_exit(end.exit_code)


def backoff_s(num_restarts_done: int) -> float:
    """Seconds before restart number `num_restarts_done + 1`: 2, 4, 8 ... up to 5 min."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2**num_restarts_done)


def with_continue(argv: list[str]) -> list[str]:
    """The trainer's argv with `--c` (resume from its newest checkpoint), added once.

    Under torchrun the flag goes to the trainer, which is last on the line either way."""
    return argv if "--c" in argv else [*argv, "--c"]


def attempt_nan_loss(job: Job, since: float) -> bool:
    """Did this attempt (its events from `since` on) hit a NaN loss?"""
    events = JobEvents(job.run_dir)
    batch = events.poll(job)
    return any(
        _is_nan(r) for scope, r in batch.records if scope is Scope.MINE and r["t"] >= since - 1
    )


def _is_nan(record: dict[str, Any]) -> bool:
    if record["kind"] == Kind.EPOCH_ENDED:
        losses = (record.get("train_loss"), record.get("val_loss"))
        # NaN is written as null (strict JSON); `nan_loss` says so where the trainer sets it.
        not_finite = any(
            v is None or (isinstance(v, float) and not math.isfinite(v)) for v in losses
        )
        return bool(record.get("nan_loss")) or not_finite
    if record["kind"] == Kind.FAILED:
        return "nan" in str(record.get("message", "")).lower()
    return False
