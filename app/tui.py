"""The nnui Textual app: wiring of services, refresh timers and screens.

All blocking reads (NVML, /proc, run folders) run in thread workers and come back as
messages; screens get the latest data and update widgets only where a value changed.
`make_app(config)` builds the app (tests and screenshots use it); `run_tui(options)` is
what `nnui` with no subcommand calls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from platformdirs import user_downloads_path
from textual.app import App
from textual.message import Message

from app.screens.palette import NnuiCommands
from app.screens.seam import Services, TuiConfig
from app.services.cross_validation import cross_validation_eta_s
from app.services.jobs.bell import NO_BELL_ENV
from app.services.jobs.identity import watched_roots
from app.services.launch import catalog, launcher
from trainer.schema.status import LIVE_STATES
from trainer.schema.tree import resolve_roots

if TYPE_CHECKING:  # imported where used (the app starts before it reads anything)
    from app.services.jobs.views import JobTracker, JobView
    from app.services.machine.gpu_history import PanelReadings
    from app.services.machine.gpus import MachineSnapshot

log = logging.getLogger(__name__)


def default_services(config: TuiConfig) -> Services:
    from app.services.jobs.registry import Registry
    from app.services.jobs.views import JobTracker
    from app.services.machine.gpus import GpuMonitor

    registry = Registry(config.state_dir)
    # No monitor in the tracker: the app hands it the latest snapshot (one NVML read per s).
    tracker = JobTracker(registry, include_forgotten=False)  # `nnui forget` hides them
    monitor = GpuMonitor(
        simulate=config.simulate_gpus,
        simulated_load=(lambda: simulated_load(tracker.views)) if config.simulate_gpus else None,
    )
    return Services(monitor=monitor, registry=registry, tracker=tracker)


def simulated_load(views: list[JobView]) -> dict[int, list[tuple[int, str]]]:
    """{simulated GPU: [(pid, name)]} of nnui's own live jobs, so the simulated GPUs show
    processes and utilisation that follow what was launched."""
    load: dict[int, list[tuple[int, str]]] = {}
    for view in views:
        job = view.job
        if not job.simulated or view.state not in LIVE_STATES:
            continue
        ranks = (view.topology or {}).get("ranks") or []
        trainer = job.process("trainer") if hasattr(job, "process") else None
        fallback = trainer.pid if trainer else 0
        for i, gpu in enumerate(job.gpus):
            if not gpu.isdigit():
                continue
            pid = ranks[i].get("pid", fallback) if i < len(ranks) else fallback
            load.setdefault(int(gpu), []).append((pid, f"nnui {job.job_id}"))
    return load


THEMES = {"dark": "textual-dark", "light": "textual-light"}


class _Reader:
    """The one long-lived thread of a kind of background read ("gpus", "jobs"): the reads
    come every second for as long as nnui is open, and a thread started for each cost CPU
    and blocked the UI thread until it ran (seconds in all under load)."""

    def __init__(self, name: str) -> None:
        self._work: Callable[[], None] | None = None
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"nnui-{name}", daemon=True)
        self._thread.start()

    def hand_over(self, work: Callable[[], None]) -> None:
        """Run `work` in this thread; the caller made sure the previous one is done."""
        self._work = work
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            work, self._work = self._work, None
            if work is not None:
                work()  # even once stopped: it releases the lock on_unmount waits for
            if self._stopped:
                return


class MachineRead(Message):
    def __init__(self, snapshot: MachineSnapshot, readings: PanelReadings | None = None) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.readings = readings  # PanelReadings: history, host line, per-process load


def same_objects(old: list[JobView], new: list[JobView]) -> bool:
    """The very same view objects in the same order: the tracker hands an unchanged job the
    same view, so nothing computed from them can differ."""
    return len(old) == len(new) and all(a is b for a, b in zip(old, new, strict=True))


class JobsRead(Message):
    def __init__(
        self,
        views: list[JobView],
        cv_eta_s: float | None,
        first_step: str | None = None,
        problems: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.problems = problems  # registry files that could not be read, each named
        self.views = views
        self.cv_eta_s = cv_eta_s
        self.first_step = first_step  # what to run first, while there is nothing to train


class NnuiApp(App):
    CSS_PATH = "nnui.tcss"
    TITLE = "nnui"
    COMMANDS = App.COMMANDS | {NnuiCommands}
    # Screens get "-short" below 32 rows (nnui.tcss gives the jobs table the room) and
    # "-narrow" below 120 columns (the launch options go under the fold board).
    # Textual declares both `ClassVar[...] | None`, which mypy takes for an instance variable.
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (120, "-wide")]  # type: ignore[misc]
    VERTICAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-short"), (32, "-tall")]  # type: ignore[misc]

    def __init__(self, config: TuiConfig, services: Services) -> None:
        super().__init__()
        self.config = config
        self.services = services
        self.snapshot: MachineSnapshot | None = None
        self.readings: PanelReadings | None = None
        self.theme = THEMES.get(config.theme, THEMES["dark"])
        self._panel_sampler: Any = None  # created in the gpus thread (it reads /proc)
        self._procs_read_at: float | None = None
        self._host_read_at: float | None = None
        self.views: list[JobView] = []
        self._cv_eta_memo: tuple[list[JobView], float | None] | None = None
        self.cv_eta_s: float | None = None
        self.first_step: str | None = None
        self.problems: tuple[str, ...] = ()  # unreadable registry files (shown as warnings)
        self._busy: dict[str, threading.Lock] = {
            "gpus": threading.Lock(),
            "jobs": threading.Lock(),
        }
        self._readers: dict[str, _Reader] = {}  # started at the first read of each kind
        self._watch_read_at: float | None = None  # monotonic s of the last /proc look
        self.num_machine_messages = 0
        self.num_jobs_messages = 0
        self.sub_title = "read-only" if config.readonly else ""
        if config.simulate_gpus:
            self.sub_title = f"SIMULATED {config.simulate_gpus} GPUs " + self.sub_title

    # ---- lifecycle --------------------------------------------------------------------

    def on_mount(self) -> None:
        from app.screens.dashboard import DashboardScreen

        self.push_screen(DashboardScreen(readonly=self.config.readonly))
        self.poll_machine()
        self.poll_jobs()
        self.set_interval(self.config.gpu_interval_s, self.poll_machine, name="nvml")
        self.set_interval(self.config.jobs_interval_s, self.poll_jobs, name="jobs")

    def on_unmount(self) -> None:
        for reader in self._readers.values():
            reader.stop()  # after the read in progress, if any
        close = getattr(self.services.monitor, "close", None)
        if close is not None:
            close()
        lock = self._busy["gpus"]
        if self._panel_sampler is not None and lock.acquire(timeout=1.0):
            try:  # not while the gpus thread adds a reading
                self._panel_sampler[0].save(time.time())  # the last minutes, for the next start
            finally:
                lock.release()

    # ---- background reads (thread workers -> messages) --------------------------------

    def _in_thread(self, name: str, work: Callable[[], Message | None]) -> None:
        """Run `work` in the reader thread of its name unless the previous run is still
        busy (a slow NVML call must not pile up reads); post what it returns."""
        lock = self._busy[name]
        if not lock.acquire(blocking=False):
            return

        def run() -> None:
            try:
                message = work()
                if message is not None:
                    self.post_message(message)
            except Exception:  # a failed read is skipped; the next tick reads again
                log.debug("background read %s failed", name, exc_info=True)
            finally:
                lock.release()

        # A plain thread, not a Textual worker: a worker's life posts state messages through
        # the app's queue, and these reads run twice a second for as long as nnui is open.
        reader = self._readers.get(name)
        if reader is None:
            reader = self._readers[name] = _Reader(name)
        reader.hand_over(run)

    def poll_machine(self) -> None:
        self._in_thread("gpus", self._read_machine)

    def _read_machine(self) -> MachineRead:
        """NVML every call; the host side of GPU processes at the processes' pace (2 s),
        the host line at its own (5 s)."""
        from app.services.machine.gpu_history import GpuHistory, PanelReadings, default_cache_dir
        from app.services.machine.host import LoadSampler

        snapshot = self.services.monitor.snapshot()
        if self._panel_sampler is None:
            history = GpuHistory(self.config.cache_dir or default_cache_dir())
            history.load()
            self._panel_sampler = (history, self.services.sampler or LoadSampler())
        history, sampler = self._panel_sampler
        history.add(snapshot)
        history.save_if_due(snapshot.taken_at)
        now = time.monotonic()
        previous = self.readings
        loads = previous.loads if previous is not None else {}
        host = previous.host if previous is not None else None
        if self._procs_read_at is None or now - self._procs_read_at >= self.config.procs_interval_s:
            self._procs_read_at = now
            pids = [p.pid for gpu in snapshot.gpus for p in gpu.processes]
            loads = sampler.processes(pids)
        if self._host_read_at is None or now - self._host_read_at >= self.config.host_interval_s:
            self._host_read_at = now
            host = sampler.host()
        series = {g.uuid: history.series(g.uuid, snapshot.taken_at) for g in snapshot.gpus}
        return MachineRead(snapshot, PanelReadings(series, host, loads))

    def poll_jobs(self) -> None:
        def read() -> JobsRead:
            launcher.reap_children()  # supervisors that ended: no <defunct> under the board
            tracker = self.services.tracker
            views = tracker.refresh(self.snapshot)
            eta_s = self._cv_eta_s(views)  # nnui's own cross-validation
            views = [*views, *self._watch_only(tracker, views)]
            problems = tuple(getattr(tracker, "problems", ()))
            return JobsRead(views, eta_s, None if views else self._first_step(), problems)

        self._in_thread("jobs", read)

    def _cv_eta_s(self, views: list[JobView]) -> float | None:
        held = self._cv_eta_memo
        if held is not None and same_objects(held[0], views):
            return held[1]
        eta_s = cross_validation_eta_s(views)
        self._cv_eta_memo = (views, eta_s)
        return eta_s

    def _first_step(self) -> str | None:
        """With no jobs and no preprocessed nnui dataset: the command to run first."""
        roots = self.config.roots
        return None if catalog.list_datasets(roots) else catalog.first_step(roots)

    def _watch_only(self, tracker: JobTracker, views: list[JobView]) -> list[JobView]:
        """nnU-Net runs nnui did not start (rows marked watch-only). Finding them reads
        /proc, so it runs at the processes' pace (docs/tui.md: 2 s), in the jobs thread."""
        refresh = getattr(tracker, "refresh_watch_only", None)
        if refresh is None:
            return []
        now = time.monotonic()
        due = self._watch_read_at is None or now - self._watch_read_at >= (
            self.config.procs_interval_s
        )
        if due:
            self._watch_read_at = now
            known = tracker.trees.trees() if hasattr(tracker, "trees") else []
            roots = watched_roots(self.config.roots.results, [v.job for v in views], known)
            return list(refresh(roots, self.snapshot))
        return list(getattr(tracker, "watch_only", []))

    @property
    def drawing(self) -> bool:
        """False once shutdown began: the screens' widgets are being taken apart, so data
        that arrives now (a thread finishing late on a busy machine) is dropped, never drawn
        into a half-removed screen."""
        return self.is_running

    def on_machine_read(self, message: MachineRead) -> None:
        if not self.drawing:
            return
        self.num_machine_messages += 1
        self.snapshot = message.snapshot
        self.readings = message.readings
        for screen in self.screen_stack:
            show = getattr(screen, "show_machine", None)
            if show is not None:
                show(message.snapshot)

    def on_jobs_read(self, message: JobsRead) -> None:
        if not self.drawing:
            return
        self.num_jobs_messages += 1
        if self._same_reading(message):
            return  # a lab's board re-reads hundreds of ended runs every second: nothing to draw
        self.views = message.views
        self.cv_eta_s = message.cv_eta_s
        self.first_step = message.first_step
        self.problems = message.problems
        for screen in self.screen_stack:
            show = getattr(screen, "show_jobs", None)
            if show is not None:
                show(message.views, message.cv_eta_s)

    def _same_reading(self, message: JobsRead) -> bool:
        """The tracker hands an unchanged job the same view object, so a reading whose views
        are the very objects shown (same order) and whose other fields are equal changes
        nothing on any screen."""
        return (
            self.num_jobs_messages > 1
            and same_objects(self.views, message.views)
            and (self.cv_eta_s, self.first_step, self.problems)
            == (message.cv_eta_s, message.first_step, message.problems)
        )

    def view_of(self, job_id: str) -> JobView | None:
        return next((v for v in self.views if v.job.job_id == job_id), None)

    def deliver_screenshot(
        self, filename: str | None = None, path: str | None = None, time_format: str | None = None
    ) -> str | None:
        """Textual saves into ~/Downloads; a headless box often has none, and the palette's
        screenshot then failed. There it goes into the current folder (the toast says where)."""
        if path is None:
            downloads = user_downloads_path()
            path = str(downloads) if downloads.is_dir() else os.getcwd()
        return super().deliver_screenshot(filename, path, time_format)

    def run_in_thread(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """One-off blocking work (planning a stop, starting a job): result back on the UI."""

        def run() -> None:
            try:
                result = work()
            except Exception as error:  # shown to the user, never a crash of the UI
                log.exception("background action failed")
                result = error
            self.call_from_thread(lambda: done(result) if self.drawing else None)

        self.run_worker(run, thread=True, group="actions", exit_on_error=False)


def make_app(config: TuiConfig, services: Services | None = None) -> NnuiApp:
    return NnuiApp(config, services or default_services(config))


def config_from_options(options: Any) -> TuiConfig:
    """argparse namespace (app/cli/parser.py) -> TuiConfig; absent attributes take defaults."""
    roots = getattr(options, "roots", None)
    if roots is None:
        roots = resolve_roots(
            getattr(options, "raw", None),
            getattr(options, "preprocessed", None),
            getattr(options, "results", None),
        )
    state_dir = getattr(options, "state_dir", None)
    return TuiConfig(
        simulate_gpus=getattr(options, "simulate_gpus", None),
        readonly=bool(getattr(options, "readonly", False)),
        no_mouse=bool(getattr(options, "no_mouse", False)),
        bell=not getattr(options, "no_bell", False) and os.environ.get(NO_BELL_ENV) != "1",
        roots=roots,
        state_dir=Path(state_dir) if state_dir else None,
        cpu_slots=max(1, (os.cpu_count() or 1) // 8),
        theme=getattr(options, "theme", None) or "dark",
    )


def _log_away_from_the_terminal() -> None:
    """A StreamHandler on the real stderr would draw over the screen: send records to
    Textual's log (visible with `textual console`) instead."""
    from textual.logging import TextualHandler

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            root.removeHandler(handler)
    root.addHandler(TextualHandler())


def run_tui(options: Any) -> int:
    config = config_from_options(options)
    _log_away_from_the_terminal()
    app = make_app(config)
    # Quitting leaves jobs running: they live in their own sessions (launcher).
    app.run(mouse=not config.no_mouse)
    return app.return_code or 0
