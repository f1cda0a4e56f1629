"""Dashboard: GPU panel, jobs table, the highlighted job's summary, cross-validation ETA.

`readonly` screens bind only navigation keys (detail, help, quit): no launch/stop/resume/
kill binding exists at all, so no key and no footer entry can trigger one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingsMap
from textual.screen import Screen
from textual.widgets import DataTable, Header, Input, Static

from app.screens import actions
from app.screens.help import HelpScreen
from app.screens.job_detail import JobDetailScreen
from app.screens.job_summary import summary_text
from app.screens.keys import DASHBOARD_ACTIONS, DASHBOARD_NAV, DASHBOARD_VIEW
from app.screens.launch import LaunchScreen
from app.screens.seam import app_of
from app.services.jobs import listing as job_list
from app.services.jobs.bell import BellRule
from app.services.jobs.words import alert_condition, human_duration
from app.widgets.fitting_footer import FittingFooter
from app.widgets.gpu_panel import GpuPanel
from app.widgets.job_table import JobTable
from trainer.schema.status import RUNNING_STATES, State

if TYPE_CHECKING:
    from app.services.jobs.views import JobView
    from app.services.machine.gpus import MachineSnapshot

__all__ = ["DashboardScreen", "cv_text"]


def cv_text(views: list[JobView], cv_eta_s: float | None, problems: tuple[str, ...] = ()) -> Text:
    running = sum(1 for v in views if v.state in RUNNING_STATES)
    text = Text()
    text.append(f" {len(views)} job{'s' if len(views) != 1 else ''}, {running} running", "bold")
    text.append(f"   cross-validation ETA: {human_duration(cv_eta_s)}")
    for problem in problems:  # a job file that could not be read: named, never hidden
        text.append(f"\n ⚠ warning: {problem}", style="bold yellow")
    return text


class DashboardScreen(Screen):
    def __init__(self, readonly: bool = False) -> None:
        super().__init__(id="dashboard")
        self.readonly = readonly
        # Bindings per instance: a read-only dashboard has no action bindings at all.
        # Actions first: on a narrow footer the keys cut off at the right are the least used.
        acting = [] if readonly else DASHBOARD_ACTIONS
        self._bindings = BindingsMap(acting + DASHBOARD_NAV + DASHBOARD_VIEW)
        self._alerts_seen: set[tuple[str, str]] = set()
        self._states_seen: dict[str, str] = {}
        self._bell = BellRule()  # the terminal bell, once per job and event
        self._problems_seen: set[str] = set()
        self._summary: str | None = None
        self._cv: str | None = None
        self._ready = False  # data messages can arrive before the widgets are composed
        self.filter_text = ""  # `/`: rows whose text holds every word (job_list.matches)
        self.sort = job_list.SORTS[0]  # `o` cycles job_list.SORTS inside each group

    def compose(self) -> ComposeResult:
        yield Header()
        yield GpuPanel(cpu_slots=app_of(self).config.cpu_slots, id="gpu-panel")
        yield JobTable(id="jobs")
        yield Input(placeholder="filter: words of id, dataset, fold, state, trainer, GPUs "
                    "(enter keeps, escape clears)", id="job-filter")  # fmt: skip
        yield Static(id="job-summary")
        yield Static(id="cv-line")
        yield FittingFooter()

    def on_mount(self) -> None:
        self._ready = True
        self.query_one(GpuPanel).border_title = "GPUs"
        self._title_table()
        self.query_one("#job-filter", Input).display = False
        self.query_one(JobTable).focus()
        snapshot = app_of(self).snapshot
        if snapshot is not None:
            self.show_machine(snapshot)
        self.show_jobs(app_of(self).views, app_of(self).cv_eta_s)

    # ---- data from the app ------------------------------------------------------------

    def show_machine(self, snapshot: MachineSnapshot) -> None:
        if self._ready:
            self.query_one(GpuPanel).update_snapshot(snapshot, getattr(self.app, "readings", None))

    def show_jobs(self, views: list[JobView], cv_eta_s: float | None) -> None:
        if not self._ready:
            return
        self.query_one(JobTable).show(job_list.arrange(views, self.filter_text, self.sort))
        self._show_summary()
        problems = tuple(getattr(self.app, "problems", ()))
        cv = cv_text(views, cv_eta_s, problems)
        if cv.plain != self._cv:
            self._cv = cv.plain
            self.query_one("#cv-line", Static).update(cv)
        self._notify_changes(views)
        for problem in problems:
            if problem not in self._problems_seen:
                self._problems_seen.add(problem)
                self.notify(f"warning: {problem}", severity="warning", timeout=10)

    def _notify_changes(self, views: list[JobView]) -> None:
        if self._bell.rings(views) and app_of(self).config.bell:
            self.app.bell()
        # One toast per condition while it lasts ("stalled ... 208 s", "209 s" are one); it
        # toasts again only after it cleared and came back.
        active: set[tuple[str, str]] = set()
        for view in views:
            job_id = view.job.job_id
            for alert in view.alerts:
                condition = (job_id, alert_condition(alert))
                active.add(condition)
                if condition not in self._alerts_seen:
                    self.notify(f"{job_id}: {alert}", severity="warning", timeout=8)
            before = self._states_seen.get(job_id)
            if before is not None and before != view.state and view.state == State.FAILED:
                self.notify(
                    f"{job_id} failed (exit {view.exit_code})", severity="error", timeout=10
                )
            self._states_seen[job_id] = view.state
        self._alerts_seen = active

    def _show_summary(self) -> None:
        if not self._ready:
            return
        table = self.query_one(JobTable)
        job_id = table.current_job_id
        view = app_of(self).view_of(job_id) if job_id else None
        loading = app_of(self).num_jobs_messages == 0
        text = summary_text(
            view, app_of(self).first_step, len(app_of(self).problems), loading, self.app.no_color
        )
        if text.plain != self._summary:
            self._summary = text.plain
            self.query_one("#job-summary", Static).update(text)

    def on_resize(self) -> None:
        # Under 100 columns the footer drops its padding so Stop, Kill and Quit still show.
        for footer in self.query(FittingFooter):  # none yet while the screen composes
            footer.compact = self.size.width < 100

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_summary()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    # ---- filter and sort ----------------------------------------------------------------

    def _title_table(self) -> None:
        title = f"jobs by dataset x configuration x trainer · sort: {self.sort} (o)"
        if self.filter_text:
            title += f" · filter: {self.filter_text!r} (escape clears)"
        self.query_one(JobTable).border_title = title + " · space selects, enter opens"

    def _rearrange(self) -> None:
        self._title_table()
        self.show_jobs(app_of(self).views, app_of(self).cv_eta_s)

    def action_filter(self) -> None:
        box = self.query_one("#job-filter", Input)
        box.display = True
        self.set_focus(box)

    def action_clear_filter(self) -> None:
        box = self.query_one("#job-filter", Input)
        box.value, box.display = "", False
        self.filter_text = ""
        self.set_focus(self.query_one(JobTable))
        self._rearrange()

    def action_sort(self) -> None:
        self.sort = job_list.next_sort(self.sort)
        self._rearrange()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "job-filter":
            self.filter_text = event.value.strip()
            self._rearrange()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "job-filter":
            event.input.display = bool(self.filter_text)
            self.set_focus(self.query_one(JobTable))

    # ---- actions ----------------------------------------------------------------------

    def target_job_ids(self) -> list[str]:
        return self.query_one(JobTable).target_job_ids()

    def _loading(self, gpus: bool = False) -> bool:
        """True (and says so) while the first job reading, or for `gpus` the first GPU
        reading, has not come: an action now would act on a table that is not there yet."""
        missing = []
        if gpus and app_of(self).snapshot is None:
            missing.append("GPUs")
        if app_of(self).num_jobs_messages == 0:
            missing.append("jobs")
        if missing:
            what = " and ".join(missing)
            self.notify(f"loading: reading the {what} for the first time, try again in a moment",
                        severity="information", timeout=3)  # fmt: skip
        return bool(missing)

    def action_detail(self) -> None:
        if self._loading():
            return
        job_id = self.query_one(JobTable).current_job_id
        if job_id is None:
            self.notify("No job selected", severity="warning")
            return
        self.app.push_screen(JobDetailScreen(job_id))

    def action_cross_validation(self) -> None:
        from app.screens.cross_validation import CrossValidationScreen  # it imports actions

        self.app.push_screen(CrossValidationScreen(readonly=self.readonly))

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.readonly))

    def action_gpu_commands(self) -> None:
        self.query_one(GpuPanel).toggle_commands()

    def action_gpu_sort(self) -> None:
        self.notify(f"GPU processes sorted by {self.query_one(GpuPanel).cycle_sort()}")

    def action_toggle_theme(self) -> None:
        self.app.theme = "textual-light" if self.app.current_theme.dark else "textual-dark"

    def action_quit(self) -> None:
        self.app.exit()

    def _allowed(self, gpus: bool = False) -> bool:
        if self._loading(gpus):
            return False
        if self.readonly:
            self.notify("read-only: actions are disabled", severity="warning")
        return not self.readonly

    def action_launch(self) -> None:
        if self._allowed(gpus=True):  # the board's columns are the GPUs of the first reading
            self.app.push_screen(LaunchScreen())

    def action_stop(self) -> None:
        if self._allowed():
            actions.stop_jobs(app_of(self), self.target_job_ids())

    def action_resume(self) -> None:
        if self._allowed():
            actions.resume_jobs(app_of(self), self.target_job_ids())

    def action_kill(self) -> None:
        if self._allowed():
            actions.kill_jobs(app_of(self), self.target_job_ids())
