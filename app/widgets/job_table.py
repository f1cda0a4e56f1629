"""Jobs table: one row per job, keyed columns, cells updated only when their text changes.

Renders `JobView`s it is given (job_cells.py builds the cells and picks the layout). Space
toggles a job in the multi-selection used by stop. nnU-Net runs nnui did not start are rows
marked "watch-only" with their owner; rows of another results tree than the default one
name it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Region
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from app.services.jobs.identity import results_tree, tree_label
from app.widgets.job_cells import (
    COLUMNS,
    COMPACT,
    FULL,
    LAYOUTS,
    NUM_FIXED_COLUMNS,
    PALETTES,
    SHORT,
    Cells,
    PlainCells,
    Widths,
    all_row_cells,
    choose_level,
    column_maxima,
    plain_cells,
    plain_text,
    row_widths,
    visible_columns,
)

if TYPE_CHECKING:
    from app.services.jobs.views import JobView


class JobTable(DataTable):
    """DataTable of jobs. `show(views)` adds, updates and removes rows in place; a change of
    width (or of the widest cells) may switch to a narrower or wider layout (LAYOUTS)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_select", "Select", id="select")
    ]
    _row_repaint_only = False  # while _update_row updates the cells of one row

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(
            cursor_type="row", zebra_stripes=True, fixed_columns=NUM_FIXED_COLUMNS, **kwargs
        )
        self.selected: set[str] = set()
        self._cells: dict[str, dict[str, str]] = {}
        self._views: dict[str, JobView] = {}
        self.level: int | None = None  # the layout shown (None: no columns yet)
        self.palette = "dark"
        self.num_cell_updates = 0  # for the benchmark and tests: proves "only on change"
        self.num_row_repaints = 0  # changes shown by repainting only their row
        self.num_relayouts = 0
        # The results tree rows are not labelled in (the app's default one; None: no label).
        self.default_results: str | None = None
        # job id -> (its view, the other inputs, cells, their texts, their widths): _memo_cells.
        self._memo: dict[str, tuple[JobView, tuple, tuple[Cells, Cells, Cells], PlainCells,
                                    tuple[Widths, Widths, Widths]]] = {}  # fmt: skip
        self._maxima: tuple[Widths, Widths, Widths] | None = None  # each kind's column widths

    def on_mount(self) -> None:
        roots = getattr(getattr(self.app, "config", None), "roots", None)
        if roots is not None and self.default_results is None:
            self.default_results = str(roots.results)
        self.palette = self._palette_name()
        self.watch(self.app, "theme", self._theme_changed, init=False)
        self._relayout(self._choose_level(list(self._views.values())))

    def _palette_name(self) -> str:
        if getattr(self.app, "no_color", False):
            return "mono"
        return "dark" if self.app.current_theme.dark else "light"

    def _theme_changed(self, _theme: str) -> None:
        """Another palette: redraw the coloured cells (their text is the same)."""
        palette = self._palette_name()
        if palette == self.palette or self.level is None:
            return
        self.palette = palette
        kind = LAYOUTS[self.level][1]
        for job_id, view in self._views.items():
            if job_id in self._cells:
                cells = self._cells_of(view, kind)
                self.update_cell(job_id, "state", cells["state"], update_width=True)
                self.update_cell(job_id, "alerts", cells["alerts"], update_width=True)

    def on_resize(self) -> None:
        level = self._choose_level(list(self._views.values()))
        if level != self.level:
            self._relayout(level)

    @property
    def columns_shown(self) -> list[str]:
        """Keys of the columns on screen now (tests and the help text use them)."""
        return [key for key, _ in visible_columns(self.level or 0)]

    def _all_cells(self, view: JobView) -> tuple[Cells, Cells, Cells]:
        return self._memo_cells(view)[0]

    def _memo_cells(self, view: JobView) -> tuple[tuple[Cells, Cells, Cells], PlainCells]:
        """A row's cells and their texts, built again only when its view object, selection,
        predecessor or palette changed: the tracker hands an unchanged (ended) job the same
        view every second, and a lab's board holds hundreds of them."""
        job_id = view.job.job_id
        before = self._views.get(view.job.after or "")
        after = before.job.fold if before is not None else None
        inputs = (job_id in self.selected, after, self.palette, self.default_results)
        held = self._memo.get(job_id)
        if held is not None and held[0] is view and held[1] == inputs:
            return held[2], held[3]
        styles = PALETTES[self.palette]
        tree = tree_label(results_tree(str(view.job.run_dir or "")), self.default_results)
        cells = all_row_cells(view, inputs[0], after, styles, tree)
        texts = plain_cells(cells)
        full, short, compact = (row_widths(kind) for kind in texts)
        self._memo[job_id] = (view, inputs, cells, texts, (full, short, compact))
        return cells, texts

    def _cells_of(self, view: JobView, kind: int) -> Cells:
        return self._all_cells(view)[kind]

    def _choose_level(self, views: list[JobView]) -> int:
        for view in views:
            self._memo_cells(view)
        return self._level_of([view.job.job_id for view in views])

    def _level_of(self, job_ids: list[str]) -> int:
        rows = [self._memo[job_id][4] for job_id in job_ids]
        full, short, compact = (column_maxima(r[k] for r in rows) for k in (FULL, SHORT, COMPACT))
        self._maxima = (full, short, compact)
        return choose_level((full, short, compact), self.scrollable_content_region.width)

    def _relayout(self, level: int) -> None:
        """Rebuild columns and rows for another layout, keeping the cursor's job."""
        current = self.current_job_id
        self.level = level
        self.num_relayouts += 1
        self.clear(columns=True)
        for key, label in visible_columns(level):
            self.add_column(label, key=key)
        self._cells = {}
        for job_id, view in self._views.items():
            self._add(job_id, view)
        if current in self._cells:
            self.move_cursor(row=list(self._cells).index(current))

    def _add(self, job_id: str, view: JobView) -> None:
        cells = self._cells_of(view, LAYOUTS[self.level or 0][1])
        self.add_row(*(cells[key] for key, _ in visible_columns(self.level or 0)), key=job_id)
        self._cells[job_id] = {key: plain_text(value) for key, value in cells.items()}

    def show(self, views: list[JobView]) -> None:
        """Rows in the order given (app.services.jobs.listing arranges them)."""
        wanted = {view.job.job_id: view for view in views}
        self._views = wanted
        if self.level is None:
            return  # not mounted yet: on_mount draws these
        memo = {j: self._memo_cells(v) for j, v in wanted.items()}
        self._memo = {j: held for j, held in self._memo.items() if j in wanted}
        both = {j: cells for j, (cells, _) in memo.items()}
        plain = {j: texts for j, (_, texts) in memo.items()}
        before = self._maxima
        level = self._level_of(list(wanted))
        if level != self.level:
            self._relayout(level)
            return
        for job_id in [j for j in self._cells if j not in wanted]:
            self.remove_row(job_id)
            del self._cells[job_id]
            self.selected.discard(job_id)
        cursor_job = self._keep_order(list(wanted))
        shown, kind = self.columns_shown, LAYOUTS[level][1]
        # Columns whose widest cell changed: only an update there can move a column.
        now = self._maxima[kind] if self._maxima is not None else ()
        was = before[kind] if before is not None else ()
        resized = {key for (key, _), a, b in zip(COLUMNS, was, now, strict=False) if a != b}
        for job_id, view in wanted.items():
            old = self._cells.get(job_id)
            if old is None:
                self._add(job_id, view)
                continue
            cells = both[job_id][kind]
            texts = plain[job_id][kind]
            if texts == old:
                continue  # most rows most seconds
            changed = [key for key in shown if old[key] != texts[key]]
            if changed:  # else only hidden columns changed
                self._update_row(job_id, changed, cells, resize=bool(resized & set(changed)))
            self._cells[job_id] = texts
        if cursor_job in self._cells:
            self.move_cursor(row=self.get_row_index(cursor_job))

    def _update_row(
        self, job_id: str, keys: list[str], cells: dict[str, Text | str], resize: bool
    ) -> None:
        """Put the changed cells of one row on screen. DataTable.update_cell repaints the
        whole table, every row rendered again, and with update_width it measures every cell
        of the column again and lays the screen out anew (a quarter second over a lab's
        history); a loss, a Dice or an ETA changes every few seconds. Unless the change
        moves a column's widest cell (`resize`, from the widths the table keeps), no column
        can move, so only that row is repainted."""
        self._row_repaint_only = not resize
        try:
            for key in keys:
                self.update_cell(job_id, key, cells[key], update_width=resize)
                self.num_cell_updates += 1
        finally:
            self._row_repaint_only = False
        if not resize:
            self.num_row_repaints += 1
            self.refresh_row(self.get_row_index(job_id))

    def refresh(self, *regions: Region, **kwargs: Any) -> JobTable:
        if self._row_repaint_only and not regions and not kwargs:
            return self  # update_cell's whole-table repaint; _update_row repaints the row
        return super().refresh(*regions, **kwargs)

    def _keep_order(self, order: list[str]) -> str | None:
        """A new sort or a new job in the middle: every row is added again in the new order
        (a DataTable only appends). Returns the job under the cursor to put it back on; rare:
        only when the order changes."""
        kept = [job_id for job_id in order if job_id in self._cells]
        appended = kept + [job_id for job_id in order if job_id not in self._cells]
        if kept == list(self._cells) and appended == order:
            return None
        current = self.current_job_id
        self.clear()
        self._cells = {}
        return current

    @property
    def current_job_id(self) -> str | None:
        if self.row_count == 0:
            return None
        try:
            row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        except CellDoesNotExist:  # cursor outside the table while rows change
            return None
        return row_key.value

    def target_job_ids(self) -> list[str]:
        """The multi-selection if any, else the job under the cursor."""
        if self.selected:
            return [j for j in self._cells if j in self.selected]
        current = self.current_job_id
        return [current] if current else []

    def action_toggle_select(self) -> None:
        job_id = self.current_job_id
        if job_id is None:
            return
        self.selected.symmetric_difference_update({job_id})
        mark = Text("●", style="bold magenta") if job_id in self.selected else " "
        self.update_cell(job_id, "sel", mark)
        self._cells[job_id]["sel"] = plain_text(mark)
