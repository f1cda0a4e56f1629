"""The scheduler's side of the headless CLI: the schedule flags of `nnui launch`, the
waiting and restart notes of `nnui status`, `nnui watch` and `nnui priority`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from app.services.jobs.liveness import waiting
from app.services.jobs.registry import Registry
from app.services.launch.schedule import Schedule
from app.services.supervisor import job_log
from app.services.supervisor.hooks import parse_hook
from trainer.schema.exits import EXIT_NOTHING, EXIT_OK, EXIT_USAGE
from trainer.schema.status import RUNNING_STATES, WAITING_STATES, State


def schedule_notes(view: Any) -> list[str]:
    """`waiting: GPU 2: 37 GiB used by user bob (pid 4411)`, `restarts 1/3: exit 137 (SIGKILL)`."""
    job, notes = view.job, []
    if job.waiting_reason and view.state == State.QUEUED:
        notes.append(f"waiting: {job.waiting_reason}")
    if job.restarts:
        notes.append(f"restarts {len(job.restarts)}/{job.retries}: {'; '.join(job.restarts)}")
    if job.stall_acted_at is not None and view.state not in WAITING_STATES | RUNNING_STATES:
        notes.append(f"ended by the stall watchdog ({job.stall_action}): {job.stall_reason}")
    return notes


def schedule_of(options: argparse.Namespace) -> Schedule:
    """The launch's schedule from its flags; ValueError (one line) for a hook that cannot
    be split (the other checks are the request's: Schedule.problems)."""
    hook = parse_hook(options.on_event) if options.on_event is not None else []
    return Schedule(
        when_free=options.when_free,
        min_free_gib=options.min_free_gib,
        max_util_percent=options.max_util,
        share=options.share,
        priority=options.priority,
        retries=options.retries,
        on_event=tuple(hook),
        stall_action=getattr(options, "stall_action", "none"),
        stall_min_s=getattr(options, "stall_min_s", None),
        after_previous_stage=getattr(options, "after_previous_stage", False),
    )


WATCH_POLL_S = 0.5


def cmd_watch(options: argparse.Namespace, registry: Registry) -> int:
    """Follow the job event log until interrupted (one line, or one JSON object, each)."""
    reader = job_log.JobLogReader(registry.state_dir, from_start=options.all)
    try:
        while True:
            for record in reader.poll():
                print(json.dumps(record) if options.json else job_log.describe(record), flush=True)
            time.sleep(WATCH_POLL_S)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_priority(options: argparse.Namespace, registry: Registry) -> int:
    """Re-order a waiting job: its supervisor reads the new priority at its next poll."""
    try:
        job = registry.resolve(options.job)
    except KeyError as problem:
        print(f"error: {problem.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    if not waiting(job):
        print(f"nothing to do: job {job.job_id} is not waiting for a GPU")
        return EXIT_NOTHING
    registry.update(job.job_id, priority=options.priority)
    print(f"job {job.job_id}: priority {options.priority} (higher starts first)")
    return EXIT_OK
