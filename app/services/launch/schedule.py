"""How a launch is scheduled: wait for free GPUs, restart after a crash, tell a hook.

One frozen value the launch request carries (`--when-free`, `--min-free-gib`, `--max-util`,
`--share`, `--priority`, `--retries`, `--on-event`), checked once, then written into each
job's registry record, where the job's supervisor reads it (waiting.py, retries.py,
hooks.py). The default schedules nothing: a job starts at once and is never restarted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_RETRIES = 1000


@dataclass(frozen=True)
class Schedule:
    when_free: bool = False
    min_free_gib: float | None = None
    max_util_percent: int | None = None
    share: bool = False
    priority: int = 0
    retries: int = 0
    on_event: tuple[str, ...] = ()  # argv, split once at launch (hooks.parse_hook)
    stall_action: str = "none"  # the stall watchdog's action (stall.py): none | stop | kill
    stall_min_s: float | None = None  # the stall rule's floor (None: stall.STALL_MIN_S)
    # A cascade fold waits until the previous stage's folds wrote its inputs (--after-lowres).
    after_previous_stage: bool = False

    def problems(self, sequential: bool, cpu: bool) -> list[str]:
        """Usage errors, each naming the flag to change."""
        errors = []
        waits = self.min_free_gib is not None or self.max_util_percent is not None or self.share
        if waits and not self.when_free:
            errors.append("--min-free-gib, --max-util and --share go with --when-free")
        if self.share and self.min_free_gib is None and self.max_util_percent is None:
            errors.append("--share needs --min-free-gib or --max-util (how much it may take)")
        if self.when_free and sequential:
            errors.append("--when-free already queues the folds: drop --sequential")
        if self.when_free and cpu:
            errors.append("--when-free waits for GPUs: not with --cpu")
        if self.min_free_gib is not None and not self.min_free_gib >= 0:
            errors.append("--min-free-gib must be >= 0")
        if self.max_util_percent is not None and not 0 <= self.max_util_percent <= 100:
            errors.append("--max-util must be 0..100 (percent)")
        if not 0 <= self.retries <= MAX_RETRIES:
            errors.append(f"--retries must be 0..{MAX_RETRIES}")
        if self.stall_min_s is not None and not self.stall_min_s > 0:
            errors.append("--stall-min-s must be > 0 (seconds)")
        return errors

    def job_fields(self, gpus: list[str]) -> dict[str, Any]:
        """The registry fields of a job launched with this schedule on `gpus` (its set)."""
        return {
            "when_free": self.when_free,
            "gpu_pool": list(gpus) if self.when_free else [],
            "min_free_gib": self.min_free_gib,
            "max_util_percent": self.max_util_percent,
            "share": self.share,
            "priority": self.priority,
            "retries": self.retries,
            "on_event": list(self.on_event),
            "stall_action": self.stall_action,
            "stall_min_s": self.stall_min_s,
            "after_previous_stage": self.after_previous_stage,
        }


def resumed_schedule(job: Any) -> Schedule:
    """A resume keeps the job's retries and hook; it runs on the job's own GPUs at once. A
    cascade fold still waits for its previous stage's inputs (none missing: no wait), so a
    fold stopped while it waited for them is resumed the same way."""
    return Schedule(
        retries=job.retries, on_event=tuple(job.on_event),
        stall_action=getattr(job, "stall_action", "none"),
        stall_min_s=getattr(job, "stall_min_s", None),
        after_previous_stage=bool(getattr(job, "after_previous_stage", False)),
    )  # fmt: skip
