"""What the stop and kill dialogs show per job: a leaf module of shared types, so that the
flows (screens/actions.py) and the dialogs (screens/confirm.py) both import it and neither
imports the other for a type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.services.jobs.views import JobView
    from app.services.machine.procs import ProcInfo
    from app.services.signals.targets import StopPlan


@dataclass(frozen=True)
class StopChoice:
    """One job in the stop dialog: its plan, or why nothing will be sent."""

    view: JobView
    plan: StopPlan | None
    note: str | None

    @property
    def sends(self) -> bool:
        return self.plan is not None and self.plan.ok

    @property
    def queues(self) -> bool:
        return self.plan is not None and not self.plan.ok and self.plan.queued


@dataclass(frozen=True)
class KillChoice:
    view: JobView
    processes: tuple[ProcInfo, ...]
