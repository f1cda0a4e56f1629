"""What the screens and their actions need from the app, as types: the app's configuration
(TuiConfig), its services (Services) and the app itself (AppSeam). A leaf module: it imports
no screen and not app.tui, so the screens never import the app for a type.

app.tui.NnuiApp provides AppSeam; Textual types a widget's `app` as a plain App, so the screens
reach nnui's own attributes through `app_of(self)` and screens/actions.py takes an `AppSeam`
(tests may hand it any object with these members).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from trainer.schema.tree import Roots, resolve_roots

if TYPE_CHECKING:
    from textual.dom import DOMNode
    from textual.notifications import SeverityLevel
    from textual.screen import Screen

    from app.services.jobs.registry import Registry
    from app.services.jobs.views import JobTracker, JobView
    from app.services.machine.gpus import GpuMonitor, MachineSnapshot
    from app.services.machine.host import LoadSampler


@dataclass(frozen=True)
class TuiConfig:
    simulate_gpus: int | None = None
    readonly: bool = False
    no_mouse: bool = False
    bell: bool = True  # ring when a job finishes, fails or stalls (bell.py)
    roots: Roots = field(default_factory=resolve_roots)
    state_dir: Path | None = None  # None: the registry's default (NNUI_STATE_DIR, ~/.local/state)
    gpu_interval_s: float = 1.0  # the refresh budget (docs/tui.md)
    jobs_interval_s: float = 1.0  # logs 0.5-1 s
    procs_interval_s: float = 2.0
    # The host line (CPU %, RAM, load): the kernel's load average moves every 5 s, and each
    # change costs a frame, so the line follows the load average's pace.
    host_interval_s: float = 5.0
    cpu_slots: int = 1
    theme: str = "dark"  # dark | light (THEMES); the palette can switch it at any time
    cache_dir: Path | None = None  # GPU history cache; None: $XDG_CACHE_HOME/nnui


@dataclass
class Services:
    """What the app talks to; tests may pass their own."""

    monitor: GpuMonitor
    registry: Registry
    tracker: JobTracker
    sampler: LoadSampler | None = None  # host line and GPU processes' load; None: a new one


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
