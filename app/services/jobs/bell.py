"""When an open nnui rings the terminal bell: one of the user's jobs finished, failed or
stalled. Once per job and event (a refresh that sees the same state again is silent), and
never for what was already so when nnui opened. Pure: the dashboard rings (`app.bell()`);
`nnui --no-bell` or NNUI_NO_BELL=1 turns it off."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainer.schema.status import State

BELL_STATES = (State.FINISHED, State.FAILED)
NO_BELL_ENV = "NNUI_NO_BELL"


def view_events(view: Any) -> set[str]:
    """The bell-worthy events a view shows now: its end state, `stalled`."""
    events = {str(view.state)} & set(BELL_STATES)
    if any(alert.startswith("stalled") for alert in view.alerts):
        events.add("stalled")
    return events


@dataclass
class BellRule:
    seen: set[tuple[str, str]] = field(default_factory=set)  # (job id, event) rung or known
    opened: bool = False  # the first look (what was so when nnui opened) rings nothing

    def rings(self, views: list[Any]) -> list[tuple[str, str]]:
        """The (job id, event) pairs new since the last call: ring for these."""
        new = []
        for view in views:
            if view.watch_only:
                continue  # an nnU-Net run nnui did not start: not the user's nnui job
            job_id = view.job.job_id
            for event in sorted(view_events(view)):
                if (job_id, event) not in self.seen:
                    self.seen.add((job_id, event))
                    new.append((job_id, event))
        first_look, self.opened = not self.opened, True
        return [] if first_look else new
