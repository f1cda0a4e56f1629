"""What the screens and their actions need from the app, as a type.

app.tui.NnuiApp provides it; Textual types a widget's `app` as a plain App, so the screens
reach nnui's own attributes through `app_of(self)` and screens/actions.py takes an `AppSeam`
(tests may hand it any object with these members).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from textual.dom import DOMNode
    from textual.notifications import SeverityLevel
    from textual.screen import Screen

    from app.services.jobs.views import JobView
    from app.services.machine.gpus import MachineSnapshot
    from app.tui import Services, TuiConfig


class AppSeam(Protocol):
    config: TuiConfig
    services: Services
    snapshot: MachineSnapshot | None  # the latest GPU read; None before the first
    views: list[JobView]  # the latest jobs read
    cv_eta_s: float | None
    first_step: str | None
    problems: tuple[str, ...]
    num_jobs_messages: int

    def view_of(self, job_id: str) -> JobView | None: ...

    def run_in_thread(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None: ...

    def poll_jobs(self) -> None: ...

    def push_screen(self, screen: Screen[Any], callback: Any = None) -> Any: ...

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
    ) -> None: ...


def app_of(node: DOMNode) -> AppSeam:
    """The running nnui app of a screen or widget."""
    return cast("AppSeam", node.app)
