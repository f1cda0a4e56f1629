"""CPU slots behave like GPUs: one job per slot at a time, the rest wait their turn.

A CPU trainer uses every core it is given (torch's threads; `--threads T` sets
OMP_NUM_THREADS), so two on the same cores do not share them, they fight for them: measured
on a 2-core box, two demo folds at once took 12-13 s per epoch instead of ~1.5 s alone, about
5x less total throughput than one after the other. So the slot count is cores // threads per
job, and the folds of a CPU launch are chained over the slots (each starts when the job
before it on its slot ends, whatever the outcome), after the CPU jobs already running.
`--oversubscribe` starts them all at once, with the expected slowdown said first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from app.services.jobs.registry import Job


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuSlots:
    cores: int
    threads_per_job: int  # --threads, else every core (torch's default)

    @property
    def count(self) -> int:
        return max(1, self.cores // max(1, self.threads_per_job))

    def describe(self) -> str:
        plural = "s" if self.count != 1 else ""
        return (
            f"{self.count} CPU slot{plural} ({self.cores} cores, {self.threads_per_job} "
            "threads per job)"
        )


def cpu_slots(threads: int | None, cores: int | None = None) -> CpuSlots:
    cores = cores or usable_cores()
    return CpuSlots(cores, min(threads or cores, cores) if threads else cores)


def slot_chains(slots: CpuSlots, running: list[Job]) -> dict[int, str]:
    """{slot: the job a new job on it must wait for}: the CPU jobs already running, oldest
    first, fill the slots round robin (a free slot has no entry)."""
    chains: dict[int, str] = {}
    for index, job in enumerate(sorted(running, key=lambda j: j.created_at)):
        chains[index % slots.count] = job.job_id
    return chains


def queue_note(num_jobs: int, slots: CpuSlots, num_running: int) -> str | None:
    """The line that says folds will wait for a CPU slot (None when all start now)."""
    free = max(0, slots.count - num_running)
    if num_jobs <= free:
        return None
    return (
        f"{slots.describe()}, {num_running} in use: {min(num_jobs, free)} of {num_jobs} "
        "fold(s) start now, the rest one after another as slots free up (--oversubscribe "
        "starts all at once, slower)"
    )


def oversubscription_note(num_jobs: int, slots: CpuSlots, num_running: int) -> str | None:
    """--oversubscribe: how much slower each job will be (None when it fits anyway)."""
    total = num_jobs + num_running
    if total <= slots.count:
        return None
    ratio = total * slots.threads_per_job / slots.cores
    return (
        f"--oversubscribe: {total} CPU jobs on {slots.describe()}: each at least {ratio:.0f}x "
        "slower per epoch, often worse (measured: 2 jobs on 2 cores, 8x per epoch)"
    )
