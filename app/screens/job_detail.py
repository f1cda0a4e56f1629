"""Job detail: curves (one fold, or all folds of the cross-validation with `o`), the
console tail and the process tree labelled by role. A watch-only nnU-Net run shows its
curves parsed from nnU-Net's training log, that log as the console, and its processes as
found in /proc (nnui never acts on them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingsMap
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from app.screens import actions
from app.screens.help import HelpScreen
from app.screens.job_summary import summary_text
from app.screens.keys import DETAIL_ACTIONS, DETAIL_NAV
from app.screens.seam import app_of
from app.services.jobs import listing as job_list
from app.services.jobs.curves import SMOOTHING_FACTORS
from app.widgets.curves import CurvesPanel
from app.widgets.fitting_footer import FittingFooter
from app.widgets.formatting import readable_style
from app.widgets.log_tail import LogTail
from app.widgets.process_tree import ProcessTree

if TYPE_CHECKING:
    from app.services.jobs.curves import EpochPoint
    from app.services.jobs.discovery import AdoptedRun
    from app.services.jobs.registry import Job
    from app.services.jobs.views import JobView
    from app.services.nnunet.runs import WatchOnlyRun


def fold_views(views: list[JobView], job: Job, overlay: bool) -> dict[str, JobView]:
    """{label: view}: this job's, or the newest job of every fold of its cross-validation
    (same dataset, configuration and trainer)."""
    if not overlay:
        own = next((v for v in views if v.job.job_id == job.job_id), None)
        return {f"fold {job.fold}": own} if own is not None else {}
    newest: dict[str, JobView] = {}
    for view in views:
        other = view.job
        if job_list.group_key(other) != job_list.group_key(job):  # same trainer too
            continue
        if other.fold not in newest or other.created_at > newest[other.fold].job.created_at:
            newest[other.fold] = view
    return {f"fold {fold}": newest[fold] for fold in sorted(newest)}


def fold_histories(
    views: list[JobView], job: Job, overlay: bool
) -> dict[str, tuple[EpochPoint, ...]]:
    """This job's history, or the newest job of every fold of the same dataset/config."""
    found = fold_views(views, job, overlay)
    return {label: view.history for label, view in found.items()} or {f"fold {job.fold}": ()}


def watch_only_processes(run: WatchOnlyRun | AdoptedRun, mono: bool = False) -> Text:
    text = Text()
    text.append(f"pid {run.pid:<8d} nnUNetv2_train  ({run.owner})", style="bold")
    for pid in run.pids:
        if pid != run.pid:
            text.append(f"\npid {pid:<8d} worker or rank", style=readable_style("dim", mono))
    text.append("\nwatch-only: nnui did not start these and never signals them",
                style=readable_style("cyan", mono))  # fmt: skip
    return text


class JobDetailScreen(Screen):
    def __init__(self, job_id: str) -> None:
        super().__init__(id="job-detail")
        self.job_id = job_id
        self.overlay = False
        self.smoothing = SMOOTHING_FACTORS[0]
        self._procs_busy = False
        self._header: str | None = None
        self._ready = False  # data messages can arrive before the widgets are composed

    def compose(self) -> ComposeResult:
        readonly = app_of(self).config.readonly
        self._bindings = BindingsMap(DETAIL_NAV + ([] if readonly else DETAIL_ACTIONS))
        yield Static(id="detail-header")
        yield CurvesPanel(id="curves")
        yield Static(id="curves-legend")
        with Horizontal(id="detail-bottom"):
            with VerticalScroll(id="console-box"):
                yield LogTail(id="console")
            with Vertical(id="tree-box"):
                yield ProcessTree(id="tree")
        yield FittingFooter()

    def on_mount(self) -> None:
        self._ready = True
        self._want_curves()
        self.query_one("#console-box").border_title = "console"
        self.query_one("#tree-box").border_title = "processes"
        self.show_jobs(app_of(self).views, app_of(self).cv_eta_s)
        view = app_of(self).view_of(self.job_id)
        if view is not None and view.watch is not None:
            self.query_one("#console-box").border_title = f"nnU-Net log {view.watch.log_path}"
            self.query_one(ProcessTree).update(watch_only_processes(view.watch, self.app.no_color))
            return  # not nnui's job: its processes are the run's, found by the watcher
        self.poll_processes()
        self.set_interval(app_of(self).config.procs_interval_s, self.poll_processes)

    def _want_curves(self) -> None:
        """An ended run's view holds its newest epochs only: ask the tracker for the whole
        curves of this job and of the folds the overlay shows (from the next refresh on)."""
        app = app_of(self)
        want = getattr(getattr(app, "services", None) and app.services.tracker, "want_curves", None)
        view = app.view_of(self.job_id)
        if want is None or view is None:
            return
        want([self.job_id, *(v.job.job_id for v in fold_views(app.views, view.job, True).values())])
        poll = getattr(app, "poll_jobs", None)
        if poll is not None:
            poll()  # now, not at the next tick

    def show_jobs(self, views: list[JobView], cv_eta_s: float | None) -> None:
        view = next((v for v in views if v.job.job_id == self.job_id), None)
        if view is None or not self._ready:
            return
        mono = self.app.no_color
        header = summary_text(view, mono=mono)
        hint = readable_style("dim", mono)
        header.append("· o: " + ("one fold" if self.overlay else "overlay all folds"), hint)
        smoothing = f"smoothing {self.smoothing:g}" if self.smoothing else "no smoothing"
        header.append(f" · m: {smoothing}", hint)
        if header.plain != self._header:
            self._header = header.plain
            self.query_one("#detail-header", Static).update(header)
        self._show_curves(views, view)
        if self.query_one(LogTail).show(view.console_tail):
            # Follow the newest lines, like tail -f.
            self.query_one("#console-box", VerticalScroll).scroll_end(animate=False)

    def _show_curves(self, views: list[JobView], view: JobView) -> None:
        found = fold_views(views, view.job, self.overlay) or {f"fold {view.job.fold}": view}
        if any(getattr(v, "partial_history", False) for v in found.values()):
            return  # the whole curves come with the next views (want_curves)
        histories = {label: v.history for label, v in found.items()}
        running = {label: getattr(v, "running_loss", ()) for label, v in found.items()}
        curves = self.query_one(CurvesPanel)
        names = getattr(view, "class_names", ())
        if curves.show(histories, running, self.smoothing, names):
            self.query_one("#curves-legend", Static).update(curves.legend)

    def poll_processes(self) -> None:
        view = app_of(self).view_of(self.job_id)
        if view is None or self._procs_busy:
            return
        self._procs_busy = True

        def read() -> list[Any]:
            from app.services.signals.proctree import process_tree

            return process_tree(view.job, view.topology)

        app_of(self).run_in_thread(read, self._got_processes)

    def _got_processes(self, nodes: Any) -> None:
        self._procs_busy = False
        if isinstance(nodes, Exception):
            self.query_one(ProcessTree).update(Text(f"cannot read processes: {nodes}", "red"))
            return
        if self._ready and self.is_mounted:
            self.query_one(ProcessTree).show(nodes)

    # ---- actions ----------------------------------------------------------------------

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_overlay(self) -> None:
        self.overlay = not self.overlay
        self._header = None
        self.show_jobs(app_of(self).views, app_of(self).cv_eta_s)

    def action_smooth(self) -> None:
        """Cycle the smoothing of losses and Dice: off, then TensorBoard's 0.6, then 0.9."""
        index = SMOOTHING_FACTORS.index(self.smoothing)
        self.smoothing = SMOOTHING_FACTORS[(index + 1) % len(SMOOTHING_FACTORS)]
        self._header = None
        self.show_jobs(app_of(self).views, app_of(self).cv_eta_s)

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(app_of(self).config.readonly))

    def action_stop(self) -> None:
        actions.stop_jobs(app_of(self), [self.job_id])

    def action_resume(self) -> None:
        actions.resume_jobs(app_of(self), [self.job_id])

    def action_kill(self) -> None:
        actions.kill_jobs(app_of(self), [self.job_id])
