"""Process tree of one job, each process labelled by its role: supervisor, launcher
(torchrun or the -num_gpus parent), rank k with its device, loader workers.

Only renders: the caller gathers the processes (services, off the UI thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.widgets import Static


@dataclass(frozen=True)
class ProcessNode:
    pid: int
    ppid: int
    role: str
    name: str


def label_processes(
    job: Any, procs: Iterable[Any], topology: Mapping[str, Any] | None
) -> list[ProcessNode]:
    """Give each process of the job a role from the registry record and the topology."""
    recorded = {p.pid: p.role for p in getattr(job, "processes", [])}
    ranks: dict[int, Mapping[str, Any]] = {}
    for entry in (topology or {}).get("ranks", []) or []:
        if isinstance(entry, Mapping) and isinstance(entry.get("pid"), int):
            ranks[entry["pid"]] = entry
    procs = list(procs)
    rank_pids = set(ranks)
    nodes = []
    for proc in procs:
        if proc.pid in ranks:
            entry = ranks[proc.pid]
            role = f"rank {entry.get('global_rank', '?')} ({entry.get('device', '?')})"
        elif recorded.get(proc.pid) == "supervisor":
            role = "supervisor"
        elif proc.ppid in rank_pids:
            role = "loader worker"
        elif recorded.get(proc.pid) == "trainer":
            modes = {"torchrun": "torchrun", "spawn": "launcher (-num_gpus)"}
            role = modes.get(getattr(job, "mode", ""), "trainer")
        elif _is_launcher(proc):
            role = "torchrun" if _is_torchrun(proc) else "launcher (-num_gpus)"
        elif "resource_tracker" in " ".join(getattr(proc, "cmdline", []) or []):
            role = "resource tracker"  # multiprocessing's, started by the spawn launcher
        else:
            role = "helper"
        nodes.append(ProcessNode(proc.pid, proc.ppid, role, proc.name))
    return nodes


def _is_torchrun(proc: Any) -> bool:
    cmd = " ".join(getattr(proc, "cmdline", []) or [])
    return "torchrun" in cmd or "torch.distributed.run" in cmd


def _is_launcher(proc: Any) -> bool:
    return _is_torchrun(proc) or "-num_gpus" in (getattr(proc, "cmdline", []) or [])


def tree_text(nodes: list[ProcessNode]) -> Text:
    """Indented tree: children under their parents, roots first."""
    if not nodes:
        return Text("(no live processes)", style="dim")
    by_parent: dict[int, list[ProcessNode]] = {}
    pids = {n.pid for n in nodes}
    for node in nodes:
        by_parent.setdefault(node.ppid if node.ppid in pids else -1, []).append(node)
    text = Text()

    def walk(parent: int, depth: int) -> None:
        for node in sorted(by_parent.get(parent, []), key=lambda n: n.pid):
            if text.plain:
                text.append("\n")
            text.append("  " * depth + ("└ " if depth else ""))
            text.append(f"{node.pid:<8d}", style="bold")
            style = "bold green" if node.role.startswith("rank") else "cyan"
            text.append(f"{node.role:<22s}", style=style)
            text.append(node.name, style="dim")
            walk(node.pid, depth + 1)

    walk(-1, 0)
    return text


class ProcessTree(Static):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown: str | None = None

    def show(self, nodes: list[ProcessNode]) -> None:
        text = tree_text(nodes)
        if text.plain != self._shown:
            self._shown = text.plain
            self.update(text)
