"""Graceful stop and kill — the only os.kill / pidfd user (docs/contract.md).

What may be signalled is decided in targets.py (the identity checks, all or none for a
stop); this module sends, re-checks the identity right before each signal (pidfd where
available), and records every attempt in the registry.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import Job, ProcessRecord, Registry, SignalRecord
from app.services.machine.procs import ProcInfo, is_same_process, proc_info, read_comm, valid_pid
from app.services.signals.targets import (
    StopPlan,
    check_worker,
    is_adopted,
    kill_plan,
    local_ranks,
    topology_problem,
)

log = logging.getLogger(__name__)

HAS_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


# ---- graceful stop -----------------------------------------------------------------------


def remember_workers(
    job: Job,
    topology: dict[str, Any] | None,
    registry: Registry,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> Job:
    """Record each worker's identity (start ticks) when the topology is first seen (pid reuse)."""
    known = {p.pid for p in job.processes if p.role == "worker"}
    if topology_problem(topology) is not None:
        return job
    topology_t = topology.get("t") if isinstance(topology, dict) else None
    for entry in local_ranks(topology):
        if entry["pid"] in known:
            continue
        info, problem = check_worker(job, entry, topology_t, proc_lookup)
        # A handler not yet installed is fine to remember; anything else is not our worker.
        if info is None or (problem is not None and "SIGUSR1 handler" not in problem):
            continue
        rank = entry.get("global_rank")  # an int >= 0 or None (checked with the topology)
        record = ProcessRecord(info.pid, info.create_time, "worker", rank, info.start_ticks)
        job = registry.add_process(job.job_id, record)
    return job


def _send(pid: int, create_time: float, signum: int, start_ticks: int | None = None) -> str:
    """Send one signal to exactly that process; pidfd closes the pid-reuse window."""
    if not valid_pid(pid):  # os.kill(0 | -1) would reach a whole process group
        return f"refused: {pid!r} is not a pid"
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
    if is_adopted(job):
        return send_adopted_stop(plan, job)
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


def slurm_step_of(plan: StopPlan, job: Job) -> str | None:
    """`JOB.STEP` when every target is a task of that srun step (a child of slurmstepd):
    then SLURM delivers the stop to exactly the step's tasks (scancel --signal=USR1)."""
    step_job, step = job.env.get("SLURM_JOB_ID"), job.env.get("SLURM_STEP_ID")
    if not step_job or not step or not step_job.isdigit() or not step.isdigit():
        return None
    for target in plan.targets:
        info = proc_info(target.pid)
        if info is None or read_comm(info.ppid) != "slurmstepd":
            return None
    return f"{step_job}.{step}"


def send_adopted_stop(plan: StopPlan, job: Job) -> list[SignalRecord]:
    """SIGUSR1 to the verified workers of a run nnui did not launch (never its torchrun
    agent, -num_gpus parent or srun); nothing is written to the registry (it has no job)."""
    now = time.time()
    if not plan.ok:
        return [SignalRecord(now, 0, "SIGUSR1", None, f"refused: {plan.reason}")]
    step = slurm_step_of(plan, job)
    if step is not None:
        result = slurm_signal_step(step)
        return [SignalRecord(now, t.pid, "SIGUSR1", t.rank, result) for t in plan.targets]
    return [
        SignalRecord(time.time(), t.pid, "SIGUSR1", t.rank,
                     _send(t.pid, t.create_time, signal.SIGUSR1, t.start_ticks))
        for t in plan.targets
    ]  # fmt: skip


def slurm_signal_step(step: str) -> str:
    """`scancel --signal=USR1 JOB.STEP`: SLURM signals the step's tasks (the workers)."""
    try:
        done = subprocess.run(["scancel", "--signal=USR1", step], capture_output=True,
                              text=True, timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        return f"failed: scancel: {error}"
    if done.returncode != 0:
        return f"failed: scancel: {(done.stderr or '').strip() or done.returncode}"
    return "sent"


def _kill_adopted(job: Job, grace_s: float) -> list[SignalRecord]:
    """SIGTERM to the run's verified topmost process (it ends its ranks), SIGKILL after the
    grace; nothing is written to the registry."""
    records = []
    targets = kill_plan(job).targets
    for info in targets:
        result = _send(info.pid, info.create_time, signal.SIGTERM, info.start_ticks)
        records.append(SignalRecord(time.time(), info.pid, "SIGTERM", None, result))
    deadline = time.monotonic() + grace_s
    while any(_still(i) for i in targets) and time.monotonic() < deadline:
        time.sleep(KILL_POLL_S)
    for info in targets:
        if _still(info):
            result = _send(info.pid, info.create_time, signal.SIGKILL, info.start_ticks)
            records.append(SignalRecord(time.time(), info.pid, "SIGKILL", None, result))
    return records


# ---- kill --------------------------------------------------------------------------------

KILL_POLL_S = 0.1
SETTLE_S = 5.0  # after the kill: time for the supervisor to record the trainer's exit code


class _KillSession:
    """One `kill`: pidfds of the processes signalled so far, and every record."""

    def __init__(self, job_id: str, registry: Registry) -> None:
        self.job_id, self.registry = job_id, registry
        self.fds: dict[tuple[int, int | None], tuple[ProcInfo, int]] = {}
        self.refused: set[tuple[int, str]] = set()
        self.records: list[SignalRecord] = []
        self.escalated = False

    def round(self) -> list[ProcInfo]:
        """Plan again (new processes may have been recorded), SIGTERM the new targets;
        the targets signalled and still alive."""
        try:
            job = self.registry.get(self.job_id)
        except KeyError:
            return []
        plan = kill_plan(job)
        for pid, reason in plan.refused:
            if (pid, reason) not in self.refused:
                self.refused.add((pid, reason))
                self._record(SignalRecord(time.time(), pid, "SIGTERM", None, f"refused: {reason}"))
        for info in plan.targets:
            key = (info.pid, info.start_ticks)
            if key in self.fds:
                continue
            try:
                fd = os.pidfd_open(info.pid) if HAS_PIDFD else -1
            except OSError:
                continue  # gone
            if not self.fds and job.killed_at is None:
                self.registry.update(self.job_id, killed_at=time.time())
            self.fds[key] = (info, fd)
            self._record(_signal_fd(job, info, fd, signal.SIGTERM))
        return [i for i in plan.targets if (i.pid, i.start_ticks) in self.fds and _still(i)]

    def escalate(self, pending: list[ProcInfo]) -> None:
        job = self.registry.get(self.job_id)
        for info in pending:
            if _still(info):
                self.escalated = True
                fd = self.fds[(info.pid, info.start_ticks)][1]
                self._record(_signal_fd(job, info, fd, signal.SIGKILL))

    def _record(self, record: SignalRecord) -> None:
        self.records.append(record)
        self.registry.record_signal(self.job_id, record)

    def close(self) -> None:
        for _, fd in self.fds.values():
            if fd >= 0:
                os.close(fd)


def kill(
    job: Job, registry: Registry, grace_s: float = 10.0, settle_s: float = SETTLE_S
) -> list[SignalRecord]:
    """SIGTERM to the job's verified processes, SIGKILL to those still there after grace_s.

    Planned again every round, so a trainer recorded meanwhile (a kill in the supervisor's
    first second) is reached too. Refusals are recorded and returned ("refused: ...").
    When everything is gone and nobody recorded an exit code (the supervisor died before
    its handler existed), the kill records one: the job ends killed, not lost.
    """
    if is_adopted(job):
        return _kill_adopted(job, grace_s)
    session = _KillSession(job.job_id, registry)
    try:
        deadline = time.monotonic() + grace_s
        while True:
            pending = session.round()
            if not pending:
                break
            if time.monotonic() >= deadline:
                session.escalate(pending)
                break
            time.sleep(KILL_POLL_S)
    finally:
        session.close()
    if session.fds:
        _settle(job.job_id, registry, -(signal.SIGKILL if session.escalated else signal.SIGTERM),
                settle_s)  # fmt: skip
    return session.records


def signal_job(job: Job, registry: Registry, signum: int) -> list[SignalRecord]:
    """One round of `signum` to the job's verified processes (kill_plan), never the caller
    (the stall watchdog in the job's supervisor); each attempt recorded. Unlike `kill` it
    neither waits nor marks the job killed by the user."""
    records = []
    for info in kill_plan(job).targets:
        if info.pid == os.getpid():
            continue
        result = _send(info.pid, info.create_time, signum, info.start_ticks)
        rank = next((p.rank for p in job.processes if p.pid == info.pid), None)
        record = SignalRecord(time.time(), info.pid, signal.Signals(signum).name, rank, result)
        registry.record_signal(job.job_id, record)
        records.append(record)
    return records


def _settle(job_id: str, registry: Registry, exit_code: int, settle_s: float) -> None:
    """Wait for the supervisor to record the exit; record it ourselves if nobody is left."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            job = registry.get(job_id)
        except KeyError:
            return
        if job.exit_code is not None:
            return
        if not job_alive(job):
            break
        if time.monotonic() >= deadline:
            return  # still alive (the supervisor records it when it ends)
        time.sleep(KILL_POLL_S)

    def record_end(job: Job) -> None:
        if job.exit_code is None:  # the supervisor may have written it meanwhile
            job.exit_code, job.ended_at = exit_code, time.time()
            job.note = job.note or "killed before its supervisor recorded an exit code"

    registry.modify(job_id, record_end)


def _still(info: ProcInfo) -> bool:
    return is_same_process(info.pid, info.create_time, start_ticks=info.start_ticks)


def _signal_fd(job: Job, info: ProcInfo, fd: int, signum: int) -> SignalRecord:
    try:
        if not valid_pid(info.pid):
            raise ValueError(f"{info.pid!r} is not a pid")
        if fd >= 0:
            signal.pidfd_send_signal(fd, signum)
        elif _still(info):
            os.kill(info.pid, signum)
        else:
            raise ProcessLookupError
        result = "sent"
    except ProcessLookupError:
        result = "failed: process already gone"
    except (OSError, ValueError) as error:
        result = f"failed: {error}"
    rank = next((p.rank for p in job.processes if p.pid == info.pid), None)
    return SignalRecord(time.time(), info.pid, signal.Signals(signum).name, rank, result)
