"""The cross-validation view (v on the dashboard): one row per dataset x configuration x
trainer x plans with folds 0-4, the final Dice mean ± std, GPU-hours and ETA
(cross_validation.py aggregates, cli/cv.py formats the cells); `m` queues exactly the
missing or failed folds of the selected row, after the launch confirm dialog showed the
commands."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import BindingsMap
from textual.screen import Screen
from textual.widgets import DataTable, Header, Static

from app.cli.cv import HEADER, NARROW_HEADER, narrow_row_cells, row_cells, table_width
from app.screens import actions
from app.screens.confirm import LaunchConfirmScreen
from app.screens.keys import CV_ACTIONS, CV_NAV
from app.screens.seam import app_of
from app.services.cross_validation import CvRow, QueueLaunch, cv_rows, queue_launches
from app.services.launch import launcher
from app.services.launch import request as launch_request
from app.widgets.fitting_footer import FittingFooter

REFRESH_S = 1.0


class CrossValidationScreen(Screen):
    def __init__(self, readonly: bool = False) -> None:
        super().__init__(id="cross-validation")
        self.readonly = readonly
        self._bindings = BindingsMap(CV_NAV + ([] if readonly else CV_ACTIONS))
        self.rows: list[CvRow] = []
        self.queued: list[QueueLaunch] = []  # what the confirm dialog shows (tests read it)

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(" Cross-validation: folds 0-4 (final validation Dice of finished folds)",
                     id="cv-title")  # fmt: skip
        yield DataTable(id="cv-table", cursor_type="row", zebra_stripes=True)
        yield Static(id="cv-queue")
        yield FittingFooter()

    def on_mount(self) -> None:
        self.header: list[str] = []
        self.refresh_rows()
        self.set_interval(REFRESH_S, self.refresh_rows)

    def on_resize(self) -> None:
        self.refresh_rows()

    def _layout(self, rows: list[CvRow]) -> tuple[list[str], list[list[str]]]:
        """The full columns where they fit, else the narrow ones (ETA never cut)."""
        wide = [row_cells(r) for r in rows]
        available = self.query_one(DataTable).size.width or self.size.width
        if table_width(HEADER, wide) <= available:
            return HEADER, wide
        return NARROW_HEADER, [narrow_row_cells(r) for r in rows]

    def refresh_rows(self) -> None:
        app = app_of(self)
        rows = cv_rows(app.views, default_results=app.config.roots.results)
        table = self.query_one(DataTable)
        cursor = table.cursor_row
        header, cells = self._layout(rows)
        table.clear(columns=header != self.header)
        if header != self.header:
            table.add_columns(*header)
            self.header = header
        for line in cells:
            table.add_row(*line)
        if rows:
            table.move_cursor(row=min(cursor, len(rows) - 1))
        self.rows = rows
        self._show_queue()

    def selected(self) -> CvRow | None:
        if not self.rows:
            return None
        return self.rows[min(self.query_one(DataTable).cursor_row, len(self.rows) - 1)]

    def _launches(self, row: CvRow) -> list[QueueLaunch]:
        app = app_of(self)
        gpus = [str(g.index) for g in (app.snapshot.gpus if app.snapshot else ())]
        return queue_launches(row, gpus, app.config.simulate_gpus)

    def _show_queue(self) -> None:
        row = self.selected()
        launches = self._launches(row) if row is not None else []
        text = "\n".join(f" m queues: {q.text()}" for q in launches) or " nothing to queue"
        self.query_one("#cv-queue", Static).update(text)

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_queue_missing(self) -> None:
        row = self.selected()
        if row is None or not row.to_queue:
            self.notify("nothing to queue: every fold is finished, running or waiting")
            return
        self.queued = self._launches(row)
        app = app_of(self)
        snapshot, registry, roots = app.snapshot, app.services.registry, app.config.roots

        def plan() -> tuple[list[Any], list[str]]:
            plans: list[Any] = []
            problems: list[str] = []
            for launch in self.queued:  # the checks and plans of `nnui launch`
                request = launch.request(roots)  # the row's own tree
                checks = launch_request.check_request(request, roots, None, snapshot, registry)
                problems += checks.errors
                if not checks.errors:
                    got, why = launcher.plan_launch(request, roots, None, snapshot, registry)
                    plans += got
                    problems += why
            return plans, problems

        app.run_in_thread(plan, self._confirm)

    def _confirm(self, result: Any) -> None:
        if isinstance(result, Exception):
            self.notify(f"cannot plan: {result}", severity="error")
            return
        plans, problems = result
        previews = [q.text() for q in self.queued] + [launcher.preview(p) for p in plans]

        def answered(yes: bool | None) -> None:
            if yes and plans and not problems:
                actions.start_plans(app_of(self), plans)

        title = f"Queue {sum(len(q.folds) for q in self.queued)} fold(s)"
        self.app.push_screen(LaunchConfirmScreen(title, previews, problems), answered)
