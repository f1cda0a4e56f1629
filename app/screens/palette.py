"""Command palette (ctrl+p): every dashboard action by name, and the fold board's while it
is open. Read-only apps list only navigation commands."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from textual.command import DiscoveryHit, Hit, Hits, Provider

# (name, help, dashboard action, is an action that changes jobs)
COMMANDS: tuple[tuple[str, str, str, bool], ...] = (
    ("Launch folds", "open the fold board (l)", "launch", True),
    ("Stop selected jobs", "graceful stop with SIGUSR1 after confirming (s)", "stop", True),
    ("Resume selected jobs", "restart with --c on the same GPUs (r)", "resume", True),
    ("Kill selected jobs", "SIGTERM then SIGKILL after typing kill (k)", "kill", True),
    ("Job detail", "curves, console and processes of the job (enter)", "detail", False),
    ("Filter jobs", "rows holding every word typed: id, dataset, fold (/)", "filter", False),
    ("Sort jobs", "cycle: fold, newest, state, Dice, ETA in each group (o)", "sort", False),
    (
        "Cross-validation view",
        "folds 0-4, Dice mean ± std, GPU-hours, ETA; queue the missing folds (v)",
        "cross_validation",
        False,
    ),
    ("Help", "all keys (?)", "help", False),
    ("Quit", "leave nnui; jobs keep running (q)", "quit", False),
)
# The fold board's (screen id "launch"), listed while it is open.
LAUNCH_COMMANDS: tuple[tuple[str, str, str, bool], ...] = (
    ("Switch engine (nnui / nnU-Net)", "train with nnui or the real nnU-Net (e)",
     "toggle_engine", True),
    ("Predict on the board's GPUs", "segment a folder with the folds on the board, one part "
     "per GPU (p)", "predict", True),
)  # fmt: skip


class NnuiCommands(Provider):
    def _commands(self) -> list[tuple[str, str, Callable[[], Any]]]:
        config = getattr(self.app, "config", None)  # None: an app other than nnui's
        readonly = config is not None and config.readonly
        found = [(c, "dashboard") for c in COMMANDS]
        if any(screen.id == "launch" for screen in self.app.screen_stack):
            found += [(c, "launch") for c in LAUNCH_COMMANDS]
        return [
            (name, help_, partial(self._run, screen_id, action))
            for (name, help_, action, changes), screen_id in found
            if not (readonly and changes)
        ]

    def _run(self, screen_id: str, action: str) -> None:
        for screen in reversed(self.app.screen_stack):
            if screen.id == screen_id:
                getattr(screen, f"action_{action}")()
                return

    async def discover(self) -> Hits:
        for name, help_, callback in self._commands():
            yield DiscoveryHit(name, callback, help=help_)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_, callback in self._commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_)
