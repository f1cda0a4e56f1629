"""The stall rule: when a running job counts as stalled (pure; the supervisor applies it).

A job is stalled when it wrote no event for much longer than its epochs take — a factor of
the median of its recent epoch times, never less than a floor — AND its trainer and workers
used (almost) no CPU meanwhile. Final validation writes no event between
`validation_started` and `validation_finished`, so it gets a larger allowance; before the
first epoch (data loading, compilation) the allowance is a multiple of the floor. Busy CPU
counts as progress everywhere: a long validation that computes is never flagged. (A GPU
kernel waited on keeps a CPU thread busy too, so CPU time covers GPU progress.)
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainer.schema.events import START_KINDS, Kind

STALL_FACTOR = 5.0  # allowed quiet time = this x the median epoch time ...
STALL_MIN_S = 300.0  # ... but at least this (the floor; `--stall-min-s`)
STARTUP_FACTOR = 3.0  # before the first epoch: floor x this
VALIDATION_EPOCHS = 30.0  # during final validation: this many median epochs ...
VALIDATION_FACTOR = 10.0  # ... but at least floor x this
RECENT_EPOCHS = 20
CPU_PROGRESS_MIN_S = 0.5  # CPU seconds gained that count as progress ...
CPU_PROGRESS_FRACTION = 0.1  # ... and at least this much of one core since the last progress


class StallAction(str, enum.Enum):
    NONE = "none"  # flag it only (status, the jobs table, the hook)
    STOP = "stop"  # graceful stop (SIGUSR1), a kill after a grace period
    KILL = "kill"  # kill at once (SIGTERM, SIGKILL after a grace period)

    def __str__(self) -> str:
        return self.value


STALL_ACTIONS = tuple(str(a) for a in StallAction)


def allowance_s(epoch_times_s: list[float], in_validation: bool, floor_s: float) -> float:
    """How long the job may stay without an event (and without CPU progress)."""
    typical_s = statistics.median(epoch_times_s) if epoch_times_s else 0.0
    if in_validation:
        return max(VALIDATION_EPOCHS * typical_s, VALIDATION_FACTOR * floor_s)
    if not epoch_times_s:
        return STARTUP_FACTOR * floor_s
    return max(STALL_FACTOR * typical_s, floor_s)


def cpu_progressed(gained_cpu_s: float, elapsed_s: float) -> bool:
    return gained_cpu_s >= max(CPU_PROGRESS_MIN_S, CPU_PROGRESS_FRACTION * elapsed_s)


@dataclass
class StallTracker:
    """What the rule needs from one attempt: its epoch times, whether it validates, when it
    last wrote an event and when its CPU time last advanced."""

    floor_s: float
    started_at: float  # the attempt's start: quiet time counts from here before any event
    epoch_times_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_EPOCHS))
    in_validation: bool = False
    last_event_t: float | None = None
    last_epoch_t: float | None = None
    cpu_mark: tuple[float, float] | None = None  # (wall s, CPU s) at the last progress

    def see(self, record: dict[str, Any]) -> None:
        """One of this attempt's events."""
        t, kind = record["t"], record["kind"]
        self.last_event_t = max(t, self.last_event_t or t)
        if kind in START_KINDS:
            self.in_validation, self.last_epoch_t = False, t
        elif kind == Kind.EPOCH_ENDED:
            took_s = record.get("epoch_time_s")
            if not isinstance(took_s, (int, float)) and self.last_epoch_t is not None:
                took_s = t - self.last_epoch_t
            if isinstance(took_s, (int, float)) and took_s >= 0:
                self.epoch_times_s.append(float(took_s))
            self.last_epoch_t = t
        elif kind == Kind.VALIDATION_STARTED:
            self.in_validation = True
        elif kind == Kind.VALIDATION_FINISHED:
            self.in_validation = False

    def sample_cpu(self, cpu_s: float | None, now: float) -> None:
        """The CPU seconds of the attempt's processes now (None: none readable)."""
        if cpu_s is None:
            return
        # The first sample, fewer CPU seconds (the pids changed), or progress: a new mark.
        mark = self.cpu_mark
        if mark is None or cpu_s < mark[1] or cpu_progressed(cpu_s - mark[1], now - mark[0]):
            self.cpu_mark = (now, cpu_s)

    def verdict(self, now: float) -> str | None:
        """Why the attempt is stalled now, or None: it is not."""
        allowed_s = allowance_s(list(self.epoch_times_s), self.in_validation, self.floor_s)
        quiet_s = now - (self.last_event_t or self.started_at)
        busy_t = self.cpu_mark[0] if self.cpu_mark is not None else self.started_at
        if quiet_s <= allowed_s or now - busy_t <= allowed_s:
            return None
        where = " in final validation" if self.in_validation else ""
        return f"no event for {quiet_s:.0f} s{where} (allowed {allowed_s:.0f} s), no CPU progress"
