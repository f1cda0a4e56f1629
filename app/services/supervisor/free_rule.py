"""When is a GPU free for a waiting job — a pure rule over one NVML snapshot (no I/O).

The supervisor of a `--when-free` job (waiting.py) reads the machine (machine/gpus.py) and the
machine-wide claims (gpu_claims.py) and asks `choose()` which GPUs it may take. Kept pure so
a table test can try every case: own processes, other users, thresholds, DDP groups, claims.

Default rule: no process of anyone on the GPU and not busy by its readings. With
`--min-free-gib` / `--max-util`: enough free memory and low utilisation, own processes
allowed; another user's process still refuses the GPU unless `--share`. A GPU claimed by a
live nnui job (any user) is never free. A GPU with a reading missing ("n/a") is not free
under a threshold that needs it: when in doubt, wait.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.services.machine.gpus import GIB, GpuProcess, GpuSnapshot, MachineSnapshot


@dataclass(frozen=True)
class WaitRule:
    """What `--when-free` asks of a GPU (None: the default rule, no process at all)."""

    min_free_gib: float | None = None
    max_util_percent: int | None = None
    share: bool = False  # other users' processes allowed (with a threshold only)

    @property
    def thresholds(self) -> bool:
        return self.min_free_gib is not None or self.max_util_percent is not None


@dataclass(frozen=True)
class Holder:
    """A live machine-wide claim on a GPU: which nnui job of which user holds it."""

    job_id: str
    user: str
    pid: int


@dataclass(frozen=True)
class Choice:
    gpus: tuple[str, ...] | None  # None: keep waiting
    reason: str | None  # why not (the first GPU that blocks), for the jobs table


def _gib(num_bytes: int | None) -> str:
    return "n/a" if num_bytes is None else f"{num_bytes / GIB:.0f} GiB"


def _describe(index: int | str, process: GpuProcess) -> str:
    who = "me" if process.is_mine else (process.user or "an unknown user")
    used = _gib(process.used_memory_bytes)
    return f"GPU {index}: {used} used by user {who} (pid {process.pid})"


def _largest(processes: Sequence[GpuProcess]) -> GpuProcess:
    return max(processes, key=lambda p: (p.used_memory_bytes or 0, -p.pid))


def blocker(gpu: GpuSnapshot, rule: WaitRule, holder: Holder | None = None) -> str | None:
    """Why this GPU is not free under the rule (one line), or None when it is."""
    index = gpu.index if gpu.parent_index is None else gpu.uuid
    if gpu.lost:
        return f"GPU {index}: lost (NVML: GPU is lost), needs a reset"
    if holder is not None:
        return (
            f"GPU {index}: claimed by nnui job {holder.job_id} of user {holder.user} "
            f"(pid {holder.pid})"
        )
    if not rule.thresholds:
        if gpu.processes:
            return _describe(index, _largest(gpu.processes))
        if gpu.busy:
            used, util = _gib(gpu.memory_used_bytes), gpu.utilization_percent
            return f"GPU {index}: busy ({used} used, utilisation {util}%)"
        return None
    others = [p for p in gpu.processes if not p.is_mine]
    if others and not rule.share:
        return _describe(index, _largest(others)) + " (add --share to share it)"
    if rule.min_free_gib is not None:
        if gpu.memory_used_bytes is None or gpu.memory_total_bytes is None:
            return f"GPU {index}: memory reading n/a"
        free_bytes = gpu.memory_total_bytes - gpu.memory_used_bytes
        if free_bytes < rule.min_free_gib * GIB:
            return f"GPU {index}: {_gib(free_bytes)} free < {rule.min_free_gib:g} GiB"
    if rule.max_util_percent is not None:
        util = gpu.utilization_percent
        if util is None:
            return f"GPU {index}: utilisation reading n/a"
        if util > rule.max_util_percent:
            return f"GPU {index}: utilisation {util}% > {rule.max_util_percent}%"
    return None


def choose(
    snapshot: MachineSnapshot,
    pool: Sequence[str],
    group_size: int,
    rule: WaitRule,
    holders: Mapping[str, Holder] | None = None,
    taken: frozenset[str] = frozenset(),
) -> Choice:
    """GPUs for one job: `group_size` free GPUs of `pool` (a DDP group: the whole pool, all
    free together), or None with the reason of each GPU that is not free. `taken`: GPUs
    given to jobs ahead in the queue this round (FIFO), never chosen here."""
    holders = holders or {}
    if snapshot.driver_problem:
        return Choice(None, snapshot.driver_problem)
    free: list[str] = []
    reasons: list[str] = []
    for gpu in pool:
        reading = snapshot.slot(gpu)
        if reading is None:
            reasons.append(f"GPU {gpu}: not visible")
        elif gpu in taken:
            reasons.append(f"GPU {gpu}: next for an earlier job of this user")
        else:
            why = blocker(reading, rule, holders.get(gpu))
            if why is None:
                free.append(gpu)
            else:
                reasons.append(why)
    why = "; ".join(reasons) or "no GPU in the set"  # every GPU of the set, in its order
    if group_size >= len(pool):  # a DDP group (or one GPU): every GPU of it at once
        return Choice(tuple(pool), None) if not reasons else Choice(None, why)
    if len(free) >= group_size:
        return Choice(tuple(free[:group_size]), None)
    return Choice(None, why)
