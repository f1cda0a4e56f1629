"""The stall watchdog in a job's supervisor: applies the stall rule (stall.py) to the
running attempt and acts as `--stall-action` says. Views only read what it records.

Flagging (every job): `stalled_at` and `stall_reason` in the registry, the `stalled` job
event (log, hook, desktop notification); cleared when the run progresses again. Acting:
`stop` sends SIGUSR1 to the verified workers (the same plan as `nnui stop`), then, if the
run has not ended after the grace period, SIGTERM and SIGKILL as `nnui kill` would (never
to this supervisor); `kill` begins with SIGTERM. `stall_acted_at` marks the attempt as
ended by the watchdog: with `--retries` it counts as abnormal and is restarted.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from app.services.jobs.events import Scope
from app.services.jobs.registry import Job, Registry
from app.services.machine.procs import proc_info, process_cpu_s
from app.services.signals.send import send_stop, signal_job
from app.services.signals.targets import plan_stop
from app.services.supervisor.hooks import JobEvent
from app.services.supervisor.stall import STALL_MIN_S, StallAction, StallTracker

KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL
Announce = Callable[[Job, JobEvent, str], None]


def attempt_cpu_s(job: Job) -> float | None:
    """CPU seconds of the attempt's trainer and workers (the ones still there)."""
    total, seen = 0.0, False
    for record in job.processes:
        if record.role in ("trainer", "worker"):
            cpu_s = process_cpu_s(record.pid, record.start_ticks)
            if cpu_s is not None:
                total, seen = total + cpu_s, True
    return total if seen else None


class StallWatch:
    """One attempt's watchdog; `step` runs at each poll of the supervisor's RunWatch."""

    def __init__(
        self, registry: Registry, job: Job, started_at: float, announce: Announce,
        say: Callable[[str], None], clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        floor_s = job.stall_min_s or STALL_MIN_S
        self.registry, self.job_id, self.announce, self.say = registry, job.job_id, announce, say
        self.tracker = StallTracker(floor_s=floor_s, started_at=started_at)
        self.action = StallAction(job.stall_action)
        self.grace_s = max(floor_s, KILL_GRACE_S)  # stop -> kill
        self.clock = clock
        self.flagged = False
        self.stop_sent_at: float | None = None
        self.term_sent_at: float | None = None
        self.killed = False

    def step(self, job: Job, records: list[tuple[Scope, dict]], topology: Any) -> None:
        now = self.clock()
        for scope, record in records:
            if scope is Scope.MINE and record["t"] >= self.tracker.started_at - 1:
                self.tracker.see(record)
        self.tracker.sample_cpu(attempt_cpu_s(job), now)
        reason = self.tracker.verdict(now)
        if reason is not None and not self.flagged:
            self._flag(reason, now)
        elif reason is None and self.flagged and job.stall_acted_at is None:
            self.flagged = False  # it moves again: no longer stalled
            self.registry.update(self.job_id, stalled_at=None, stall_reason=None)
            self.say("progressing again: no longer stalled")
        if self.flagged and self.action is not StallAction.NONE:
            self._act(self.registry.get(self.job_id), topology, now)

    def _flag(self, reason: str, now: float) -> None:
        self.flagged = True
        self.say(f"stalled: {reason}")
        job = self.registry.update(self.job_id, stalled_at=now, stall_reason=reason)
        self.announce(job, JobEvent.STALLED, reason)

    def _act(self, job: Job, topology: Any, now: float) -> None:
        if job.stall_acted_at is None:
            self.registry.update(self.job_id, stall_acted_at=now)
        if self.action is StallAction.STOP and self.stop_sent_at is None:
            self.stop_sent_at = now
            self._stop(job, topology)
            return
        if self.stop_sent_at is not None and now - self.stop_sent_at < self.grace_s:
            return  # give the graceful stop its time
        if self.term_sent_at is None:
            self.term_sent_at = now
            self.say("the watchdog kills the stalled run (SIGTERM)")
            signal_job(job, self.registry, signal.SIGTERM)
        elif not self.killed and now - self.term_sent_at >= KILL_GRACE_S:
            self.killed = True
            self.say("still there: SIGKILL")
            signal_job(job, self.registry, signal.SIGKILL)

    def _stop(self, job: Job, topology: Any) -> None:
        plan = plan_stop(job, topology, None, proc_info) if topology else None
        if plan is None or not plan.ok:
            why = plan.reason if plan is not None else "no topology yet"
            self.say(f"the watchdog cannot stop the stalled run gracefully ({why}): kill later")
            return
        records = send_stop(plan, job, self.registry)
        sent = sum(r.result == "sent" for r in records)
        self.say(f"the watchdog stops the stalled run (SIGUSR1 to {sent} worker(s))")
