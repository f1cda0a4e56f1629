"""Console tail: the last lines of a job's console.log, given as a sequence of strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.widgets import Static

ERROR_MARKERS = ("Traceback", "Error", "error:", "FAILED")


def tail_text(lines: Sequence[str], max_lines: int) -> Text:
    text = Text()
    shown = list(lines)[-max_lines:]
    if not shown:
        return Text("(console is empty)", style="dim")
    for i, line in enumerate(shown):
        style = "red" if any(marker in line for marker in ERROR_MARKERS) else ""
        text.append(line.rstrip("\n"), style=style)
        if i < len(shown) - 1:
            text.append("\n")
    return text


class LogTail(Static):
    """Shows the newest `max_lines` lines; repaints only when they change."""

    def __init__(self, max_lines: int = 200, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_lines = max_lines
        self._shown: tuple[str, ...] | None = None

    def show(self, lines: Sequence[str]) -> bool:
        """Show the lines; True when they changed."""
        shown = tuple(lines)[-self.max_lines :]
        if shown == self._shown:
            return False
        self._shown = shown
        self.update(tail_text(shown, self.max_lines))
        return True
