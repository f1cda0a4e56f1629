"""A `--when-free` job's wait for its GPUs — done by its supervisor, so it outlives nnui.

Every poll: read the machine (gpus.py), the live machine-wide claims of every user
(gpu_claims.py), and this user's other waiting jobs (the registry). The queue is FIFO per
user with `--priority` first: jobs ahead in it are given GPUs first in this round, so this
job takes only what is left (gpu_rule.choose with `taken`). A GPU chosen is claimed (all of a
DDP group together), the machine is read once more and the rule checked again right before
start; a GPU that got busy meanwhile is released and the wait goes on. The reason of the wait
is written to the job (`waiting_reason`) whenever it changes: the jobs table shows it.
A stop of the waiting job (queued stop) or its kill ends the wait: no trainer starts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app.services.jobs.liveness import job_alive, waiting
from app.services.jobs.registry import Job, Registry
from app.services.machine.gpus import GpuMonitor, MachineSnapshot
from app.services.machine.procs import proc_info
from app.services.supervisor.free_rule import Choice, WaitRule, choose
from app.services.supervisor.gpu_claims import GpuClaims, live_holders

log = logging.getLogger("nnui.waiting")

POLL_S = 1.0


def rule_of(job: Job) -> WaitRule:
    return WaitRule(job.min_free_gib, job.max_util_percent, job.share)


def group_size(job: Job) -> int:
    """A single-GPU fold takes any one GPU of its set; a DDP group needs all of it."""
    return 1 if job.mode == "single" else max(1, len(job.gpu_pool))


def queue_order(jobs: list[Job]) -> list[Job]:
    """This user's waiting jobs, first served first: higher priority, then older."""
    return sorted(
        (j for j in jobs if waiting(j)), key=lambda j: (-j.priority, j.created_at, j.job_id)
    )


def turn_choice(
    me: Job,
    queue: list[Job],
    snapshot: MachineSnapshot,
    holders: dict,
    alive: Callable[[Job], bool],
) -> Choice:
    """What `me` may take this round, after the jobs ahead of it took theirs."""
    taken: set[str] = set()
    for job in queue:
        if job.job_id == me.job_id:
            break
        if not alive(job):
            continue  # its supervisor is gone: it never takes anything
        ahead = choose(
            snapshot, job.gpu_pool, group_size(job), rule_of(job), holders, frozenset(taken)
        )
        if ahead.gpus:
            taken.update(ahead.gpus)
    return choose(snapshot, me.gpu_pool, group_size(me), rule_of(me), holders, frozenset(taken))


def cancelled(job: Job) -> bool:
    return (
        job.queued_stop or job.killed_at is not None or any(s.result == "sent" for s in job.signals)
    )


def wait_for_gpus(
    registry: Registry,
    job_id: str,
    claims: GpuClaims,
    monitor: GpuMonitor,
    say: Callable[[str], None],
) -> tuple[str, ...] | None:
    """The GPUs claimed for this job (claims holds them), or None when it was cancelled."""
    last_reason: str | None = None
    while True:
        try:
            me = registry.get(job_id)
        except KeyError:
            return None
        if cancelled(me):
            return None
        chosen, reason = _attempt(registry, me, claims, monitor)
        if chosen is not None:
            return chosen
        if reason != last_reason:
            say(f"waiting for a free GPU: {reason}")
            registry.update(job_id, waiting_reason=reason)
            last_reason = reason
        time.sleep(POLL_S)


def _attempt(
    registry: Registry, me: Job, claims: GpuClaims, monitor: GpuMonitor
) -> tuple[tuple[str, ...] | None, str]:
    snapshot = monitor.snapshot()
    queue = queue_order(registry.list())
    # Every GPU the jobs ahead might take too: their turn this round depends on the claims.
    gpus = sorted({g for job in [me, *queue] for g in job.gpu_pool if g.isdigit()}, key=int)
    holders = live_holders(gpus, claims.folder, mine=claims)
    alive = lambda job: job_alive(job, proc_info)  # noqa: E731
    choice = turn_choice(me, queue, snapshot, holders, alive)
    if choice.gpus is None:
        return None, choice.reason or "no GPU free"
    if not claims.try_claim(choice.gpus, me.job_id):
        return None, "another nnui job claimed the GPU at the same moment"
    # Re-check right before start: the readings of a moment ago may be stale.
    fresh = choose(monitor.snapshot(), list(choice.gpus), len(choice.gpus), rule_of(me))
    if fresh.gpus is None:
        claims.release()
        return None, fresh.reason or "GPU got busy"
    return choice.gpus, ""


def machine_monitor(job: Job, load: Callable[[], dict] | None) -> GpuMonitor:
    """The readings a waiting job goes by: the simulated machine for a simulated job (its
    GPUs as many as the highest index of the set), otherwise NVML with every GPU visible
    (the job's indices are NVML's)."""
    if job.simulated:
        size = 1 + max((int(g) for g in job.gpu_pool if g.isdigit()), default=0)
        return GpuMonitor(simulate=size, simulated_load=load)
    return GpuMonitor(visible_devices=None)
