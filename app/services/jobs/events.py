"""The events of one job — the one filter every reader of a run folder goes through.

A run folder outlives its jobs: `nnui resume` starts a new job that appends to the same
events.jsonl, so the file holds earlier runs (history: their epochs still draw the curve)
and, seen from an ended job, later ones (they belong to that later job's view). A record
is this job's from the job's own `run_started` on (one written at or after the job was
created) until the job ended. Records come from the validated tail, so every one has a
finite `t` and the keys of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from app.services.jobs.registry import Job
from app.services.tail import JsonlTail
from trainer.schema.events import START_KINDS, Kind
from trainer.schema.tree import EVENTS_FILE

# Job times come from nnui's clock, event times from the trainer's: the same wall clock,
# read a moment apart, which adjustments move by up to about this much.
CLOCK_SLACK_S = 0.5


class Scope(Enum):
    EARLIER = "earlier"  # an earlier run in the same folder (a resumed fold's history)
    MINE = "mine"  # this job's run
    LATER = "later"  # written after this job ended: a later job's


@dataclass
class JobEventFilter:
    """Classifies records in file order; remembers whether the job's own start was seen."""

    started: bool = False

    def scope(self, job: Job, record: dict[str, Any]) -> Scope:
        t = record["t"]
        if job.ended_at is not None and t > job.ended_at + CLOCK_SLACK_S:
            return Scope.LATER
        if record["kind"] in START_KINDS and t >= job.created_at - CLOCK_SLACK_S:
            self.started = True
        return Scope.MINE if self.started else Scope.EARLIER


@dataclass
class EventBatch:
    reset: bool  # the file was truncated or replaced: forget what earlier batches said
    records: list[tuple[Scope, dict[str, Any]]] = field(default_factory=list)


class JobEvents:
    """One job's events, read incrementally: validated tail + filter + its topology."""

    def __init__(self, run_dir: str | Path) -> None:
        self.tail = JsonlTail(Path(run_dir) / EVENTS_FILE)
        self.filter = JobEventFilter()
        self.topology: dict[str, Any] | None = None  # the newest of this job's current run

    @property
    def num_invalid(self) -> int:
        return self.tail.num_invalid

    def poll(self, job: Job) -> EventBatch:
        """Everything appended since the last poll (the whole file on the first one)."""
        batch = EventBatch(reset=False)
        while True:
            records = self.tail.poll()
            if self.tail.reset:
                batch = EventBatch(reset=True)
                self.filter, self.topology = JobEventFilter(), None
            for record in records:
                scope = self.filter.scope(job, record)
                batch.records.append((scope, record))
                self._follow(scope, record)
            if not self.tail.more:
                return batch

    def _follow(self, scope: Scope, record: dict[str, Any]) -> None:
        if scope is not Scope.MINE:
            return
        if record["kind"] in START_KINDS:
            self.topology = None  # a new start (a restart with --c): new workers to come
        elif record["kind"] == Kind.TOPOLOGY:
            self.topology = record


def latest_topology(job: Job) -> dict[str, Any] | None:
    """The newest topology of this job's own run, read once from the whole file."""
    events = JobEvents(job.run_dir)
    events.poll(job)
    return events.topology
