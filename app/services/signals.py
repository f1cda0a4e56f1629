"""Graceful stop and kill — the only os.kill / pidfd user (DESIGN §4).

The headline promise: a graceful stop reaches exactly the job's worker processes, or
nothing. Targets come from the trainer's `topology` event (never torchrun, never the
-num_gpus parent, never a process group, never a name). Every target must be alive, ours,
the very process that wrote the topology (start ticks since boot), part of this job
(NNUI_JOB_ID in its environment), and have a SIGUSR1 handler (else the signal would kill
it). If one check fails nothing is sent and the reason is shown.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from app.services.procs import (
    WALL_CLOCK_TOLERANCE_S,
    ProcInfo,
    _sigcgt_has,
    is_same_process,
    job_alive,
    proc_info,
    process_identity,
    process_start_ticks,
    process_start_time,
    record_alive,
    same_identity,
)
from app.services.registry import Job, ProcessRecord, Registry, SignalRecord
from trainer.schema import JOB_ID_ENV

__all__ = [  # process identity lives in procs.py; re-exported so callers can use signals.*
    "ProcInfo",
    "StopPlan",
    "StopTarget",
    "_sigcgt_has",
    "check_worker",
    "is_launcher_cmdline",
    "is_same_process",
    "job_alive",
    "kill",
    "local_ranks",
    "plan_kill",
    "plan_stop",
    "proc_info",
    "process_identity",
    "process_start_ticks",
    "process_start_time",
    "record_alive",
    "remember_workers",
    "send_stop",
    "topology_ranks",
]  # fmt: skip

log = logging.getLogger(__name__)

# The job's create time comes from nnui's clock before Popen; processes start after it.
# Both are wall-clock readings, which clock adjustments move by up to about a second.
LAUNCH_SLACK_S = WALL_CLOCK_TOLERANCE_S
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "app.services.supervisor")
HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


# ---- graceful stop -----------------------------------------------------------------------


@dataclass(frozen=True)
class StopTarget:
    pid: int
    rank: int
    local_rank: int
    host: str
    device: str
    create_time: float = 0.0
    start_ticks: int | None = None  # the identity checked again right before the signal


@dataclass(frozen=True)
class StopPlan:
    ok: bool
    targets: tuple[StopTarget, ...]
    reason: str | None
    epoch: int | None
    queued: bool
    already_signalled: bool = False  # a stop was already sent to these very pids


def is_launcher_cmdline(cmdline: list[str]) -> bool:
    """torchrun, our supervisor, or a -num_gpus N>1 parent: never a SIGUSR1 target."""
    if any(arg in LAUNCHER_MODULES or os.path.basename(arg) == "torchrun" for arg in cmdline[:4]):
        return True
    if "-num_gpus" in cmdline:
        index = cmdline.index("-num_gpus")
        value = cmdline[index + 1] if index + 1 < len(cmdline) else ""
        return value.isdigit() and int(value) > 1
    return False


def topology_ranks(topology: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The per-rank entries of a topology event (key `ranks`; `workers`/`processes` tolerated)."""
    if not topology:
        return []
    for key in ("ranks", "workers", "processes"):
        value = topology.get(key)
        if isinstance(value, list):
            return [r for r in value if isinstance(r, dict) and isinstance(r.get("pid"), int)]
    return []


def local_ranks(topology: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Topology entries of ranks on this host (pids elsewhere mean nothing here)."""
    here = socket.gethostname()
    return [r for r in topology_ranks(topology) if r.get("host") in (None, here, "localhost")]


def _launcher_pids(job: Job) -> set[int]:
    pids = {p.pid for p in job.processes if p.role == "supervisor"}
    if job.mode != "single":
        pids |= {p.pid for p in job.processes if p.role == "trainer"}
    return pids


def _descends_from_job(
    info: ProcInfo, job: Job, proc_lookup: Callable[[int], ProcInfo | None]
) -> bool:
    """True if an ancestor is the job's recorded trainer or supervisor (same start ticks)."""
    recorded = {p.pid: p for p in job.processes if p.role in ("trainer", "supervisor")}
    pid, seen = info.ppid, 0
    while pid > 1 and seen < 16:
        if pid in recorded:
            return record_alive(recorded[pid], proc_lookup)
        parent = proc_lookup(pid)
        if parent is None:
            return False
        pid, seen = parent.ppid, seen + 1
    return False


def check_worker(
    job: Job,
    entry: dict[str, Any],
    topology_t: float | None,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> tuple[ProcInfo | None, str | None]:
    """(info, None) when this topology entry may receive SIGUSR1, else (info, why not)."""
    pid = int(entry["pid"])
    label = f"pid {pid} (rank {entry.get('global_rank', '?')})"
    info = proc_lookup(pid)
    if info is None:
        return None, f"{label} is not running"
    if info.zombie:
        return info, f"{label} has exited (zombie)"
    if info.uid != os.getuid():
        return info, f"{label} belongs to another user (uid {info.uid})"
    if pid in _launcher_pids(job) or is_launcher_cmdline(info.cmdline):
        return info, f"{label} is a launcher, not a worker"
    recorded = next((p for p in job.processes if p.pid == pid and p.role == "worker"), None)
    if recorded is not None and not same_identity(info, recorded.create_time, recorded.start_ticks):
        return info, f"{label} is another process now (pid reused)"
    if info.create_time < job.created_at - LAUNCH_SLACK_S:
        return info, f"{label} started before this job was launched (pid reused)"
    if topology_t is not None and info.create_time > topology_t + WALL_CLOCK_TOLERANCE_S:
        return info, f"{label} started after the topology was written (pid reused)"
    if info.env_job_id != job.job_id and not (
        info.env_job_id is None and _descends_from_job(info, job, proc_lookup)
    ):
        if info.env_job_id is None:
            return info, f"{label} does not carry {JOB_ID_ENV} of this job"
        return info, f"{label} belongs to job {info.env_job_id}, not {job.job_id}"
    if not info.sigcgt_usr1:
        return info, f"{label} has no SIGUSR1 handler yet (still starting?) — try again shortly"
    return info, None


def plan_stop(
    job: Job,
    topology: dict[str, Any] | None,
    last_epoch: int | None,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> StopPlan:
    """Which pids get SIGUSR1, all checked; `ok=False` with the reason when any check fails."""
    if job.exit_code is not None or job.ended_at is not None:
        return StopPlan(False, (), "the job has already ended", last_epoch, False)
    ranks = topology_ranks(topology)
    if not ranks:
        reason = "no topology yet: the stop is queued and sent once the workers are up"
        return StopPlan(False, (), reason, last_epoch, True)
    here = socket.gethostname()
    local = local_ranks(topology)
    if not local:
        return StopPlan(False, (), f"no worker runs on this host ({here})", last_epoch, False)
    topology_t = topology.get("t") if topology else None
    targets: list[StopTarget] = []
    for entry in sorted(local, key=lambda r: r.get("global_rank", 0)):
        info, problem = check_worker(job, entry, topology_t, proc_lookup)
        if problem is not None:
            return StopPlan(False, (), f"nothing sent: {problem}", last_epoch, False)
        assert info is not None
        targets.append(
            StopTarget(
                pid=info.pid,
                rank=int(entry.get("global_rank", 0)),
                local_rank=int(entry.get("local_rank", 0)),
                host=str(entry.get("host") or here),
                device=str(entry.get("device", "?")),
                create_time=info.create_time,
                start_ticks=info.start_ticks,
            )
        )
    sent = {s.pid for s in job.signals if s.signal == "SIGUSR1" and s.result == "sent"}
    already = all(t.pid in sent for t in targets)
    return StopPlan(True, tuple(targets), None, last_epoch, False, already_signalled=already)


def remember_workers(
    job: Job,
    topology: dict[str, Any] | None,
    registry: Registry,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> Job:
    """Record each worker's identity (start ticks) when the topology is first seen (pid reuse)."""
    known = {p.pid for p in job.processes if p.role == "worker"}
    topology_t = topology.get("t") if topology else None
    for entry in local_ranks(topology):
        if entry["pid"] in known:
            continue
        info, problem = check_worker(job, entry, topology_t, proc_lookup)
        # A handler not yet installed is fine to remember; anything else is not our worker.
        if info is None or (problem is not None and "SIGUSR1 handler" not in problem):
            continue
        record = ProcessRecord(
            info.pid, info.create_time, "worker", entry.get("global_rank"), info.start_ticks
        )
        job = registry.add_process(job.job_id, record)
    return job


def _send(pid: int, create_time: float, signum: int, start_ticks: int | None = None) -> str:
    """Send one signal to exactly that process; pidfd closes the pid-reuse window."""
    try:
        if HAS_PIDFD:
            fd = os.pidfd_open(pid)
            try:
                if not is_same_process(pid, create_time, start_ticks=start_ticks):
                    return "refused: pid changed before the signal"
                signal.pidfd_send_signal(fd, signum)
            finally:
                os.close(fd)
        else:
            if not is_same_process(pid, create_time, start_ticks=start_ticks):
                return "refused: pid changed before the signal"
            os.kill(pid, signum)
    except ProcessLookupError:
        return "failed: process already gone"
    except OSError as error:
        return f"failed: {error}"
    return "sent"


def send_stop(plan: StopPlan, job: Job, registry: Registry) -> list[SignalRecord]:
    """SIGUSR1 to every target of an ok plan; each attempt recorded in the registry."""
    if not plan.ok:
        if not plan.queued:
            record = SignalRecord(time.time(), 0, "SIGUSR1", None, f"refused: {plan.reason}")
            registry.record_signal(job.job_id, record)
            return [record]
        return []
    if plan.already_signalled:
        return []  # pressing stop again is harmless: the workers already have the signal
    records = []
    for target in plan.targets:
        result = _send(target.pid, target.create_time, signal.SIGUSR1, target.start_ticks)
        record = SignalRecord(time.time(), target.pid, "SIGUSR1", target.rank, result)
        registry.record_signal(job.job_id, record)
        records.append(record)
    registry.update(job.job_id, queued_stop=False)
    return records


# ---- kill --------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def plan_kill(
    job: Job,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
    children: Callable[[int], Iterable[int]] = _children,
) -> list[ProcInfo]:
    """The job's own live processes: trainer tree (launcher, ranks, loader workers) + workers.

    The supervisor is left alone while its trainer lives, so it can record the exit code;
    a supervisor still waiting for an earlier job is included (nothing else would end it).
    """
    # A list, not a dict by pid: in single mode the trainer is also the worker (same pid).
    alive = [p for p in job.processes if record_alive(p, proc_lookup)]
    recorded_pids = {p.pid for p in alive}
    trainers = [p for p in alive if p.role == "trainer"]
    candidates: list[int] = []
    for record in trainers:
        candidates.append(record.pid)
        candidates.extend(children(record.pid))
    candidates.extend(p.pid for p in alive if p.role == "worker")
    if not trainers:
        candidates.extend(p.pid for p in alive if p.role == "supervisor")
    return job_members(job, candidates, recorded_pids, proc_lookup)


def job_members(
    job: Job,
    candidates: Iterable[int],
    recorded_pids: set[int],
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> list[ProcInfo]:
    """The candidates that really are this job's: alive, ours, not older than the job (a
    reused pid), and recorded by nnui or started with this job's NNUI_JOB_ID."""
    verified: list[ProcInfo] = []
    for pid in dict.fromkeys(candidates):
        info = proc_lookup(pid)
        if info is None or info.zombie or info.uid != os.getuid():
            continue
        if info.create_time < job.created_at - LAUNCH_SLACK_S:
            continue
        if pid not in recorded_pids and info.env_job_id != job.job_id:
            continue
        verified.append(info)
    return verified


def kill(job: Job, registry: Registry, grace_s: float = 10.0) -> list[SignalRecord]:
    """SIGTERM to the job's verified processes, then SIGKILL to those still there after grace."""
    targets = plan_kill(job)
    records: list[SignalRecord] = []
    fds: dict[int, int] = {}
    for info in targets:
        try:
            fds[info.pid] = os.pidfd_open(info.pid) if HAS_PIDFD else -1
        except OSError:
            continue
    try:
        for info in targets:
            if info.pid in fds:
                records.append(_signal_fd(job, registry, info, fds[info.pid], signal.SIGTERM))
        deadline = time.monotonic() + grace_s
        remaining = [i for i in targets if i.pid in fds]
        while remaining and time.monotonic() < deadline:
            time.sleep(0.1)
            remaining = [i for i in remaining if _still(i)]
        for info in remaining:
            if _still(info):
                records.append(_signal_fd(job, registry, info, fds[info.pid], signal.SIGKILL))
    finally:
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)
    return records


def _still(info: ProcInfo) -> bool:
    return is_same_process(info.pid, info.create_time, start_ticks=info.start_ticks)


def _signal_fd(job: Job, registry: Registry, info: ProcInfo, fd: int, signum: int) -> SignalRecord:
    try:
        if fd >= 0:
            signal.pidfd_send_signal(fd, signum)
        elif _still(info):
            os.kill(info.pid, signum)
        else:
            raise ProcessLookupError
        result = "sent"
    except ProcessLookupError:
        result = "failed: process already gone"
    except OSError as error:
        result = f"failed: {error}"
    rank = next((p.rank for p in job.processes if p.pid == info.pid), None)
    record = SignalRecord(time.time(), info.pid, signal.Signals(signum).name, rank, result)
    registry.record_signal(job.job_id, record)
    return record
