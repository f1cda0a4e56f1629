"""The results trees nnui has seen runs in, remembered in its own state folder.

A run started by hand trains in the tree of its own environment or working folder, which
nnui finds from /proc while it lives. Once it has ended, only its folder tells how it went,
and nothing points there from the folder `nnui` was started in: so the trees of runs seen
live are kept in `<state dir>/trees.json`, and every command looks in them as well as in
the default tree and the registry's. Written only when a new tree appears (never into run
folders); a file that does not parse counts as empty and is replaced at the next new tree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from app.services.jobs.identity import results_tree
from trainer.schema.atomic import atomic_write_text

TREES_FILE = "trees.json"
MAX_TREES = 64  # the newest are kept; a lab has a handful


def known_trees(state_dir: Path) -> list[str]:
    """The remembered trees that still exist, oldest first."""
    try:
        data = json.loads((Path(state_dir) / TREES_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(data, list):
        return []
    return [t for t in data if isinstance(t, str) and os.path.isabs(t) and os.path.isdir(t)]


def remember_trees(state_dir: Path, trees: Iterable[str]) -> bool:
    """Add these trees (absolute paths); True when the file changed. Never raises for an
    unwritable state folder: remembering is a convenience, not a duty."""
    known = known_trees(state_dir)
    new = [t for t in dict.fromkeys(trees) if t and os.path.isabs(t) and t not in known]
    if not new:
        return False
    try:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(state_dir) / TREES_FILE, json.dumps((known + new)[-MAX_TREES:]))
    except OSError:
        return False
    return True


class TreeMemory:
    """The remembered trees of one state folder, read once and written only when a run in
    a new tree is seen (the board notes the live runs every few seconds)."""

    def __init__(self, state_dir: Path | None) -> None:
        self.state_dir = None if state_dir is None else Path(state_dir)  # None: remembers nothing
        self._trees: list[str] | None = None

    def trees(self) -> list[str]:
        if self._trees is None:
            self._trees = [] if self.state_dir is None else known_trees(self.state_dir)
        return list(self._trees)

    def note(self, run_dirs: Iterable[str]) -> None:
        """Remember the trees of these run folders (those not known yet)."""
        known = set(self.trees())
        new = [t for t in (results_tree(d) for d in run_dirs if d) if t and t not in known]
        if new and self.state_dir is not None:
            remember_trees(self.state_dir, new)
            self._trees = [*self.trees(), *dict.fromkeys(new)]
