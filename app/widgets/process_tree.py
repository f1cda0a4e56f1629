"""Process tree of one job, each process labelled by its role: supervisor, launcher
(torchrun or the -num_gpus parent), rank k with its device, loader workers.

Only renders: services.proctree gathers, verifies and labels the processes (off the UI
thread).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.widgets import Static

from app.widgets.formatting import readable_style

if TYPE_CHECKING:
    from app.services.signals.proctree import TreeNode


def tree_text(nodes: list[TreeNode], mono: bool = False) -> Text:
    """Indented tree: children under their parents, roots first."""
    if not nodes:
        return Text("(no live processes)", style=readable_style("dim", mono))
    by_parent: dict[int, list[TreeNode]] = {}
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
            style = "bold green" if node.role == "rank" else "cyan"
            text.append(f"{node.label:<26s}", style=readable_style(style, mono))
            text.append(node.name, style=readable_style("dim", mono))
            walk(node.pid, depth + 1)

    walk(-1, 0)
    return text


class ProcessTree(Static):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._shown: str | None = None

    def show(self, nodes: list[TreeNode]) -> None:
        text = tree_text(nodes, self.app.no_color)
        if text.plain != self._shown:
            self._shown = text.plain
            self.update(text)
