"""Who may receive a stop or a kill — the planning half of a signal (docs/contract.md; read-only).

A graceful stop reaches exactly the job's worker processes, or nothing. Targets come from
the trainer's `topology` event (never torchrun, never the -num_gpus parent, never a process
group, never a name). Every target must be alive, ours, the very process that wrote the
topology (start ticks since boot), part of this job (NNUI_JOB_ID in its environment, or a
child of its recorded trainer that carries it), and have a SIGUSR1 handler (else the signal
would kill it). A kill passes the same identity checks (no handler needed). A pid of 0 or
below, a string or a bool is a data error: never a target (os.kill(0 | -1) would reach a
process group). send.py sends; this module only decides.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from app.services.jobs.discovery import RUN_ID_PREFIX
from app.services.jobs.liveness import record_alive
from app.services.jobs.registry import Job
from app.services.machine.procs import (
    WALL_CLOCK_TOLERANCE_S,
    ProcInfo,
    pids_with_job_id,
    proc_info,
    same_identity,
    valid_pid,
)
from trainer.schema.tree import JOB_ID_ENV

# The job's create time comes from nnui's clock before Popen; processes start after it.
# Both are wall-clock readings, which clock adjustments move by up to about a second.
LAUNCH_SLACK_S = WALL_CLOCK_TOLERANCE_S
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "app.services.supervisor")


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


def _raw_ranks(topology: Any) -> list[Any]:
    if not isinstance(topology, dict):
        return []
    for key in ("ranks", "workers", "processes"):
        value = topology.get(key)
        if isinstance(value, list):
            return value
    return []


def _rank_ok(entry: Any) -> bool:
    """A topology entry that can be acted on: a real pid, ranks ints >= 0 or absent."""
    if not isinstance(entry, dict) or not valid_pid(entry.get("pid")):
        return False
    return all(
        entry.get(key) is None
        or (isinstance(entry[key], int) and not isinstance(entry[key], bool) and entry[key] >= 0)
        for key in ("global_rank", "local_rank")
    )


def topology_ranks(topology: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The well-formed per-rank entries of a topology event (key `ranks`; `workers`/`processes`
    tolerated). A pid of 0 or -1, a string or a bool is a data error, never a target."""
    return [r for r in _raw_ranks(topology) if _rank_ok(r)]


def topology_problem(topology: dict[str, Any] | None) -> str | None:
    """Why this topology cannot be trusted for a stop (all or none), or None."""
    raw = _raw_ranks(topology)
    bad = [r for r in raw if not _rank_ok(r)]
    if bad:
        return f"the topology has {len(bad)} malformed rank entr{'y' if len(bad) == 1 else 'ies'}"
    t = topology.get("t") if isinstance(topology, dict) else None
    if raw and not _finite_number(t):
        return "the topology has no valid time `t`"
    return None


def _finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value == value and abs(value) < 1e15  # not NaN, not inf, a plausible time


def _rank_of(entry: dict[str, Any], key: str = "global_rank") -> int:
    value = entry.get(key)
    return value if isinstance(value, int) else 0


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
    """True if an ancestor is the job's recorded trainer or supervisor (same start ticks) and
    that ancestor itself carries this job's NNUI_JOB_ID (a forged record proves nothing)."""
    recorded = {p.pid: p for p in job.processes if p.role in ("trainer", "supervisor")}
    pid, seen = info.ppid, 0
    while pid > 1 and seen < 16:
        if pid in recorded:
            ancestor = proc_lookup(pid)
            return (
                ancestor is not None
                and ancestor.env_job_id == job.job_id
                and record_alive(recorded[pid], proc_lookup)
            )
        parent = proc_lookup(pid)
        if parent is None:
            return False
        pid, seen = parent.ppid, seen + 1
    return False


def is_adopted(job: Job) -> bool:
    """A run nnui did not launch (discovery.py): its Job is built from /proc, never stored."""
    return job.job_id.startswith(RUN_ID_PREFIX)


def _adopted_problem(info: ProcInfo, job: Job, label: str) -> str | None:
    """An adopted run has no NNUI_JOB_ID: a process is its own only as discovered in its
    process group (pid + start ticks recorded from the same /proc reading)."""
    recorded = [p for p in job.processes if p.pid == info.pid]
    if not recorded:
        return f"{label} is not a process of this run (not in its process group)"
    if not any(same_identity(info, p.create_time, p.start_ticks) for p in recorded):
        return f"{label} is another process now (pid reused)"
    return None


def _identity_problem(
    info: ProcInfo, job: Job, label: str, proc_lookup: Callable[[int], ProcInfo | None]
) -> str | None:
    """The identity checks shared by stop and kill: ours, not older than the job, this job's."""
    if info.uid != os.getuid():
        return f"{label} belongs to another user (uid {info.uid})"
    if info.create_time < job.created_at - LAUNCH_SLACK_S:
        return f"{label} started before this job was launched (pid reused)"
    if is_adopted(job):
        return _adopted_problem(info, job, label)
    if info.env_job_id == job.job_id:
        return None
    if info.env_job_id is not None:
        return f"{label} belongs to job {info.env_job_id}, not {job.job_id}"
    if _descends_from_job(info, job, proc_lookup):
        return None
    return f"{label} does not carry {JOB_ID_ENV} of this job"


def check_worker(
    job: Job,
    entry: dict[str, Any],
    topology_t: float | None,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> tuple[ProcInfo | None, str | None]:
    """(info, None) when this topology entry may receive SIGUSR1, else (info, why not)."""
    pid = entry.get("pid")
    label = f"pid {pid!r} (rank {entry.get('global_rank', '?')!r})"
    if not _rank_ok(entry):
        return None, f"{label} is not a valid topology entry"
    info = proc_lookup(entry["pid"])  # _rank_ok: a valid pid
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
    if recorded is None and is_adopted(job):  # only the workers found in its process group
        return info, f"{label} is not a worker of this run's process group"
    if topology_t is not None and info.create_time > topology_t + WALL_CLOCK_TOLERANCE_S:
        return info, f"{label} started after the topology was written (pid reused)"
    problem = _identity_problem(info, job, label, proc_lookup)
    if problem is not None:
        return info, problem
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
    if not _raw_ranks(topology):
        if is_adopted(job):  # no supervisor of ours would deliver a queued stop
            reason = "nothing sent: the run has not reported its ranks yet; try again shortly"
            return StopPlan(False, (), reason, last_epoch, False)
        reason = "no topology yet: the stop is queued and sent once the workers are up"
        return StopPlan(False, (), reason, last_epoch, True)
    problem = topology_problem(topology)
    if problem is not None:  # all or none: a rank we cannot read could be left running
        return StopPlan(False, (), f"nothing sent: {problem}", last_epoch, False)
    here = socket.gethostname()
    local = local_ranks(topology)
    if not local:
        return StopPlan(False, (), f"no worker runs on this host ({here})", last_epoch, False)
    assert topology is not None
    topology_t = topology["t"]
    targets: list[StopTarget] = []
    for entry in sorted(local, key=_rank_of):
        info, problem = check_worker(job, entry, topology_t, proc_lookup)
        if problem is not None:
            return StopPlan(False, (), f"nothing sent: {problem}", last_epoch, False)
        assert info is not None
        targets.append(
            StopTarget(
                pid=info.pid,
                rank=_rank_of(entry),
                local_rank=_rank_of(entry, "local_rank"),
                host=str(entry.get("host") or here),
                device=str(entry.get("device", "?")),
                create_time=info.create_time,
                start_ticks=info.start_ticks,
            )
        )
    sent = {s.pid for s in job.signals if s.signal == "SIGUSR1" and s.result == "sent"}
    already = all(t.pid in sent for t in targets)
    return StopPlan(True, tuple(targets), None, last_epoch, False, already_signalled=already)


# ---- kill --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KillPlan:
    targets: tuple[ProcInfo, ...]  # verified: SIGTERM, then SIGKILL after the grace
    refused: tuple[tuple[int, str], ...]  # (pid, why not): candidates that failed a check


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _kill_candidates(
    job: Job,
    proc_lookup: Callable[[int], ProcInfo | None],
    children: Callable[[int], Iterable[int]],
    scan: Callable[[str], Iterable[int]],
) -> list[int]:
    # A list, not a dict by pid: in single mode the trainer is also the worker (same pid).
    alive = [p for p in job.processes if record_alive(p, proc_lookup)]
    if is_adopted(job):  # its topmost process (torchrun, the -num_gpus parent) ends the rest
        return [p.pid for p in alive if p.role == "trainer"]
    candidates: list[int] = []
    for record in alive:
        if record.role == "trainer":
            candidates.append(record.pid)
            candidates.extend(children(record.pid))
    candidates.extend(p.pid for p in alive if p.role == "worker")
    supervisors = {p.pid for p in job.processes if p.role == "supervisor"}
    if job.process("trainer") is None:
        # Waiting for an earlier job, or in its first second: nothing else would end it.
        candidates.extend(p.pid for p in alive if p.role == "supervisor")
    # Processes started with this job's id that were never recorded (a trainer its
    # supervisor had no time to record); they pass the same checks as everything else.
    candidates.extend(pid for pid in scan(job.job_id) if pid not in supervisors)
    return list(dict.fromkeys(candidates))


def kill_plan(
    job: Job,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
    children: Callable[[int], Iterable[int]] = _children,
    scan: Callable[[str], Iterable[int]] = pids_with_job_id,
) -> KillPlan:
    """The job's own live processes (trainer tree, workers), each through the stop's identity
    checks: ours, not older than the job, and carrying this job's NNUI_JOB_ID (or a child of
    its recorded trainer that carries it). A registry record alone proves nothing.

    The supervisor is left alone once a trainer was recorded, so it can record the exit
    code; before that (queued, or the first second) it is a target.
    """
    trainer_recorded = job.process("trainer") is not None
    targets: list[ProcInfo] = []
    refused: list[tuple[int, str]] = []
    for pid in _kill_candidates(job, proc_lookup, children, scan):
        info = proc_lookup(pid)
        if info is None or info.zombie:
            continue  # already gone
        if trainer_recorded and "app.services.supervisor" in info.cmdline[:4]:
            continue  # an unrecorded supervisor of this job: it records the exit code
        problem = _identity_problem(info, job, f"pid {pid}", proc_lookup)
        if problem is None:
            targets.append(info)
        else:
            refused.append((pid, problem))
    return KillPlan(tuple(targets), tuple(refused))


def plan_kill(
    job: Job,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
    children: Callable[[int], Iterable[int]] = _children,
    scan: Callable[[str], Iterable[int]] = pids_with_job_id,
) -> list[ProcInfo]:
    """The verified targets of kill_plan (what the kill confirmation lists)."""
    return list(kill_plan(job, proc_lookup, children, scan).targets)


def job_members(
    job: Job,
    candidates: Iterable[int],
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
) -> list[ProcInfo]:
    """The live candidates that pass the identity checks (the job's process tree)."""
    verified: list[ProcInfo] = []
    for pid in dict.fromkeys(candidates):
        info = proc_lookup(pid)
        if info is None or info.zombie:
            continue
        if _identity_problem(info, job, f"pid {pid}", proc_lookup) is None:
            verified.append(info)
    return verified
