"""The job-state rule: a job's State from its registry record, what its run folder's events
said so far and whether its processes live (trainer.schema.status.State). Read-only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from trainer.schema.events import Kind
from trainer.schema.status import State

if TYPE_CHECKING:
    from app.services.jobs.registry import Job


class RunFacts(Protocol):
    """What the rule reads of a run folder's events (jobs.views keeps them per job)."""

    last_kind: str | None
    last_event_t: float | None
    validation: tuple[int, int] | None
    stop_requested: bool
    history: Any

    @property
    def topology(self) -> Any: ...


def run_dir_gone(job: Job, run: RunFacts) -> bool:
    """The results folder this job wrote its events into no longer exists (moved, deleted)."""
    started = run.last_event_t is not None or job.exit_code is not None
    started = started or job.process("trainer") is not None
    return started and not os.path.isdir(job.run_dir)


_ENDING: dict[str, State] = {
    Kind.STOPPED: State.STOPPED,
    Kind.FINISHED: State.FINISHED,
    Kind.FAILED: State.FAILED,
}


def derive_state(job: Job, run: RunFacts, alive: bool) -> State:
    """The one job-state rule: the job's record (exit code, kill, restarts, queue, signals)
    and what its run folder says (its last event, validation, topology), while the
    processes are alive or after they are gone."""
    ending = _ENDING.get(run.last_kind) if run.last_kind else None
    if job.killed_at is not None and (job.exit_code is not None or not alive):
        return State.KILLED  # killed by the user, whatever exit code the kill caused
    if job.exit_code is not None:
        if ending in (State.FINISHED, State.STOPPED):
            return ending
        if job.note == "stopped before it started":
            return State.STOPPED
        return State.FAILED if job.exit_code != 0 or ending else State.FINISHED
    if not alive:
        return ending or State.LOST
    if job.restarts and not job.process("trainer"):
        return State.QUEUED  # between attempts: restarted with --c after the back-off
    if ending is not None:
        return ending
    if run.validation is not None:
        return State.VALIDATING
    waits_for_inputs = getattr(job, "after_previous_stage", False)
    if (job.after or job.when_free or waits_for_inputs) and not job.process("trainer"):
        return State.STOPPING if job.queued_stop else State.QUEUED
    stop_sent = any(s.signal == "SIGUSR1" and s.result == "sent" for s in job.signals)
    if run.stop_requested or stop_sent or job.queued_stop:
        return State.STOPPING
    if run.topology is not None or (run.history and run.last_event_t):
        return State.RUNNING
    return State.STARTING
