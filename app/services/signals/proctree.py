"""A job's live process tree, verified and labelled by role (read-only, for the job detail).

Roles: the supervisor, the launcher (torchrun) or spawn parent (`-num_gpus`), rank k with
its device (from the topology event), loader workers (children of a rank), other (e.g.
multiprocessing's resource tracker). Only processes that are provably this job's are
listed: recorded ones still the same process (start_ticks), their descendants, and the
topology's ranks on this host; each must pass the stop's identity checks: ours (uid),
started after the job was launched, carrying the job's NNUI_JOB_ID (or a child of its
recorded trainer that carries it). A registry record alone proves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import psutil

from app.services.jobs import events as job_events
from app.services.jobs.liveness import record_alive
from app.services.jobs.registry import Job
from app.services.machine.procs import ProcInfo, proc_info
from app.services.signals.targets import job_members, local_ranks, topology_ranks

ROLES = ("supervisor", "launcher", "spawn parent", "trainer", "rank", "loader worker", "other")


@dataclass(frozen=True)
class TreeNode:
    pid: int
    ppid: int
    role: str  # one of ROLES
    label: str  # what the UI shows: "torchrun", "rank 1 (cuda:1)", "loader worker", ...
    name: str
    rank: int | None = None
    device: str | None = None


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def latest_topology(job: Job) -> dict[str, Any] | None:
    """The newest topology event of THIS job's run (a resumed folder holds older ones)."""
    return job_events.latest_topology(job)


def label_tree(
    job: Any, procs: Iterable[ProcInfo], topology: Mapping[str, Any] | None
) -> list[TreeNode]:
    """Give each (already verified) process of the job its role."""
    recorded = {p.pid: p.role for p in getattr(job, "processes", [])}
    ranks = {r["pid"]: r for r in topology_ranks(dict(topology) if topology else None)}
    mode = getattr(job, "mode", "")
    nodes = []
    for proc in procs:
        cmdline = " ".join(getattr(proc, "cmdline", []) or [])
        rank = device = None
        if proc.pid in ranks:
            entry = ranks[proc.pid]
            rank, device = entry.get("global_rank"), str(entry.get("device", "?"))
            role, label = "rank", f"rank {'?' if rank is None else rank} ({device})"
        elif recorded.get(proc.pid) == "supervisor":
            role = label = "supervisor"
        elif proc.ppid in ranks:
            role = label = "loader worker"
        elif (mode == "torchrun" and recorded.get(proc.pid) == "trainer") or _torchrun(cmdline):
            role, label = "launcher", "torchrun"
        elif (mode == "spawn" and recorded.get(proc.pid) == "trainer") or "-num_gpus" in cmdline:
            role, label = "spawn parent", "spawn parent (-num_gpus)"
        elif recorded.get(proc.pid) == "trainer":
            role = label = "trainer"  # single mode before the topology names it rank 0
        else:
            role = "other"
            label = "resource tracker" if "resource_tracker" in cmdline else "other"
        nodes.append(TreeNode(proc.pid, proc.ppid, role, label, proc.name, rank, device))
    return nodes


def _torchrun(cmdline: str) -> bool:
    return "torch.distributed.run" in cmdline or "torchrun" in cmdline


def process_tree(
    job: Job,
    topology: dict[str, Any] | None = None,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
    children: Callable[[int], Iterable[int]] = _descendants,
) -> list[TreeNode]:
    """The job's live processes, verified, labelled; topology read from the run if not given."""
    if topology is None:
        topology = latest_topology(job)
    alive = [r for r in job.processes if record_alive(r, proc_lookup)]
    candidates: list[int] = []
    for record in alive:
        candidates.append(record.pid)
        if record.role in ("supervisor", "trainer"):
            candidates.extend(children(record.pid))
    rank_pids = [int(r["pid"]) for r in local_ranks(topology)]
    candidates.extend(rank_pids)
    return label_tree(job, job_members(job, candidates, proc_lookup), topology)
