"""status.json and the one list of job states with their named groups (docs/contract.md,
"States"). Standard library only."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from trainer.schema.tree import STATUS_FILE


class TextEnum(str, Enum):
    """A str that is also an enum member: JSON, ==, hashing and f-strings see the value."""

    __str__ = str.__str__

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class State(TextEnum):
    """The one list of job states. The trainer writes the first six in status.json; the
    app derives the last three for a job (waiting for an earlier one; gone without an end;
    ended by `nnui kill`)."""

    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"
    QUEUED = "queued"
    LOST = "lost"
    KILLED = "killed"
    VALIDATING = "validating"  # derived by the app: the final validation runs


TERMINAL_STATES = frozenset({State.STOPPED, State.FINISHED, State.FAILED})
ENDED_STATES = TERMINAL_STATES | {State.LOST, State.KILLED}  # nothing runs any more
ACTIVE_STATES = frozenset(
    {State.STARTING, State.QUEUED, State.RUNNING, State.STOPPING, State.VALIDATING}
)
# Named groups, so no caller spells a state as a string or a tuple of its own.
RUNNING_STATES = frozenset({State.RUNNING, State.VALIDATING})  # at work: counted running, ETA
WAITING_STATES = frozenset({State.QUEUED, State.STARTING})  # launched, not at work yet
WORKING_STATES = RUNNING_STATES | {State.STARTING}  # its trainer runs and was not told to stop
LIVE_STATES = ACTIVE_STATES - {State.QUEUED}  # its processes exist
FAILED_STATES = frozenset({State.FAILED, State.LOST})  # ended without finishing or a stop


@dataclass
class Status:
    """status.json: the latest state of one run in one small file."""

    state: str
    epoch: int = 0
    num_epochs: int = 0
    pids: list[int] = field(default_factory=list)
    last_checkpoint: str | None = None
    message: str | None = None
    updated_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Status:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def read_status(run_dir: Path) -> Status | None:
    try:
        return Status.from_dict(json.loads((run_dir / STATUS_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
