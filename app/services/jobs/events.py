"""The events of one job — the one filter every reader of a run folder goes through.

A run folder outlives its jobs: `nnui resume` starts a new job that appends to the same
events.jsonl, so the file holds earlier runs (history: their epochs still draw the curve)
and, seen from an ended job, later ones (they belong to that later job's view). A record
is this job's from the job's own `run_started` on (the first one written at or after the
job was created) until a later job's start. Order comes from the file, never from `t`: a
clock stepped back (NTP) gives a line an earlier `t` than the line before, and that never
moves a record out of its run. `t` only names which start is whose: the job's own is its
first start at or after its creation, a later job's is a start after the job's own one,
written after the job ended. Records come from the validated tail, so every one has a
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
    later: bool = False  # a later job's start was seen: the rest of the file is its

    def scope(self, job: Job, record: dict[str, Any]) -> Scope:
        if not self.later and record["kind"] in START_KINDS:
            t = record["t"]
            if not self.started:
                self.started = t >= job.created_at - CLOCK_SLACK_S
            elif job.ended_at is not None and t > job.ended_at + CLOCK_SLACK_S:
                self.later = True
        if self.later:
            return Scope.LATER
        return Scope.MINE if self.started else Scope.EARLIER


@dataclass
class EventBatch:
    reset: bool  # the file was truncated or replaced: forget what earlier batches said
    records: list[tuple[Scope, dict[str, Any]]] = field(default_factory=list)


class JobEvents:
    """One job's events, read incrementally: validated tail + filter + its topology."""

    def __init__(self, run_dir: str | Path) -> None:
        # The records are consumed as they come (no backlog kept: a long run has thousands).
        self.tail = JsonlTail(Path(run_dir) / EVENTS_FILE, max_records=0)
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

    def state(self) -> dict[str, Any] | None:
        """The reader's position and what the filter knows (restore() takes it back)."""
        position = self.tail.position()
        if position is None:
            return None
        return {**position, "started": self.filter.started, "later": self.filter.later,
                "topology": self.topology, "num_invalid": self.tail.num_invalid,
                "invalid": list(self.tail.invalid_samples)}  # fmt: skip

    def restore(self, state: dict[str, Any]) -> bool:
        """Continue where a state() left off; False: the state is not one."""
        topology = state["topology"]
        if not isinstance(topology, (dict, type(None))) or not isinstance(state["invalid"], list):
            return False
        self.tail.resume(state)
        self.filter = JobEventFilter(bool(state["started"]), bool(state["later"]))
        self.topology = topology
        self.tail.num_invalid = int(state["num_invalid"])
        self.tail.invalid_samples.extend(str(s) for s in state["invalid"])
        return True

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
