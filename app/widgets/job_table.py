"""Jobs table: one row per job, keyed columns, cells updated only when their text changes.

Renders `JobView`s it is given. Space toggles a job in the multi-selection used by stop.
nnU-Net runs nnui did not start are rows marked "watch-only" with their owner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from rich.cells import cell_len
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Region
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from app.services.jobs.words import human_duration, state_label
from app.widgets.formatting import bar, fmt_or_na
from trainer.schema.status import RUNNING_STATES, WAITING_STATES, State

if TYPE_CHECKING:
    from app.services.jobs.registry import Job
    from app.services.jobs.views import JobView

# (key, label): keys stay stable so cells can be updated by name.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("sel", " "),
    ("job", "job"),
    ("dataset", "dataset"),
    ("fold", "fold"),
    ("where", "GPUs"),
    ("state", "state"),
    ("epoch", "epoch"),
    ("train", "train"),
    ("val", "val"),
    ("dice", "Dice"),
    ("ema", "EMA"),
    ("its", "it/s"),
    ("wait", "wait"),  # share of the step time spent waiting for data (data loading)
    ("eta", "ETA"),
    ("alerts", "alerts"),
)

# State colours per palette. Dark: the terminal's named colours (they downgrade cleanly to
# 16 colours under TERM=xterm). Light: darker tones that keep their contrast on white.
# NO_COLOR: Textual turns every colour into a grey of the same luminance, so a red "failed"
# would become dark grey on near-black; there the cue is the text style on the theme's own
# foreground (bold, reverse), which stays readable at full contrast.
DARK_STATE_STYLES: dict[str, str] = {
    State.STARTING: "cyan",
    State.QUEUED: "cyan",
    State.RUNNING: "bold green",
    State.STOPPING: "bold yellow",
    State.STOPPED: "yellow",
    State.FINISHED: "bold blue",
    State.FAILED: "bold red",
    State.LOST: "bold magenta",
    State.KILLED: "magenta",
    State.VALIDATING: "bold green",
    "alerts": "bold red",
}
LIGHT_STATE_STYLES: dict[str, str] = {
    State.STARTING: "#007b8a",
    State.QUEUED: "#007b8a",
    State.RUNNING: "bold #007a1f",
    State.STOPPING: "bold #7d4e00",
    State.STOPPED: "#7d4e00",
    State.FINISHED: "bold #0550ae",
    State.FAILED: "bold #a40e26",
    State.LOST: "bold #6639ba",
    State.KILLED: "#6639ba",
    State.VALIDATING: "bold #007a1f",
    "alerts": "bold #a40e26",
}
MONO_STATE_STYLES: dict[str, str] = {
    State.STARTING: "italic",
    State.QUEUED: "italic",
    State.RUNNING: "bold",
    State.STOPPING: "bold italic",
    State.STOPPED: "",
    State.FINISHED: "bold",
    State.FAILED: "bold reverse",
    State.LOST: "bold reverse",
    State.KILLED: "reverse",
    State.VALIDATING: "bold italic",
    "alerts": "bold reverse",
}
STATE_STYLES = DARK_STATE_STYLES  # the default palette (kept under its old name)
PALETTES: dict[str, dict[str, str]] = {
    "dark": DARK_STATE_STYLES,
    "light": LIGHT_STATE_STYLES,
    "mono": MONO_STATE_STYLES,
}


def _loss(value: float | None) -> str:
    if value is not None and math.isnan(value):
        return "NaN"
    return fmt_or_na(value, "{:.4f}")


WATCH_ONLY = "watch-only"


def where_text(job: Job) -> str:
    if not job.gpus:
        # A watch-only run on CUDA whose GPUs neither NVML nor its environment told.
        return "n/a" if getattr(job, "device", "cpu") == "cuda" else "cpu"
    label = ",".join(job.gpus)
    if job.mode in ("spawn", "torchrun"):
        label += f" ({job.mode})"
    return label


def short_dataset(name: str) -> str:
    """`Dataset004_Hippocampus` -> `004_Hippocampus` (the prefix says nothing)."""
    return name.removeprefix("Dataset")[:20]


def prediction_cells(view: JobView) -> tuple[str, str, str]:
    """(fold, epoch, it/s) cells of a prediction part: its folds and part, cases done, s/case."""
    job = view.job
    fold = f"predict {job.fold} [{(job.part_id or 0) + 1}/{job.num_parts or 1}]"
    done, total = view.cases_done, view.num_cases
    cases = "n/a"
    if done is not None and total:
        cases = f"{done}/{total} cases {bar(done / total, 6)}"
    elif total == 0:
        cases = "0/0 cases"
    return fold, cases, fmt_or_na(view.seconds_per_case, "{:.1f} s/case")


def dice_cell(view: JobView) -> str:
    """The final validation's Dice once there is one ("final 0.812"), else the pseudo Dice
    of the newest epoch."""
    final = getattr(view, "final_dice", None)
    if final is not None:
        return f"final {final:.3f}"
    return fmt_or_na(view.mean_dice, "{:.3f}")


def row_cells(
    view: JobView,
    selected: bool,
    after_fold: str | None = None,
    styles: dict[str, str] = DARK_STATE_STYLES,
    short: bool = False,
) -> dict[str, Text | str]:
    """The text of every cell of one job's row (`short`: the abbreviated cells of a narrow
    layout — the epoch without its bar)."""
    return both_row_cells(view, selected, after_fold, styles)[1 if short else 0]


def both_row_cells(
    view: JobView,
    selected: bool,
    after_fold: str | None = None,
    styles: dict[str, str] = DARK_STATE_STYLES,
) -> tuple[dict[str, Text | str], dict[str, Text | str]]:
    """(full, short) cells of one row, built once: the table weighs both layouts for every
    job each second, and they differ only in the epoch cell."""
    job = view.job
    state = state_label(view)
    if job.after and view.state in WAITING_STATES:
        state = f"{view.state} (after fold {after_fold or '?'})"
    if getattr(view, "watch_only", False):
        owner = getattr(view.watch, "owner", "?")
        state = f"{view.state} {WATCH_ONLY} ({owner})"
    if view.epoch is not None and view.num_epochs:
        done = min(view.epoch + 1, view.num_epochs) if view.state == State.FINISHED else view.epoch
        short_epoch = f"{view.epoch}/{view.num_epochs}"
        epoch = f"{short_epoch} {bar(done / view.num_epochs, 6)}"
    else:
        epoch = short_epoch = fmt_or_na(view.epoch)
    fold, its = job.fold, fmt_or_na(view.it_per_s, "{:.2f}")
    if getattr(job, "kind", "train") == "predict":
        fold, epoch, its = prediction_cells(view)
        short_epoch = epoch
    alerts = Text(" ".join(view.alerts), style=styles["alerts"]) if view.alerts else Text("")
    waiting = getattr(job, "waiting_reason", None)
    if waiting and view.state == State.QUEUED:  # a --when-free job: why it has not started
        alerts = Text(f"waiting: {waiting} ", style="yellow") + alerts
    restarts = getattr(job, "restarts", None)
    if restarts:
        alerts = Text(f"restarts {len(restarts)}/{job.retries}: {restarts[-1]} ") + alerts
    full: dict[str, Text | str] = {
        "sel": Text("●", style="bold magenta") if selected else " ",
        "job": job.job_id,
        "dataset": f"{short_dataset(job.dataset)} {job.configuration}",
        "fold": fold,
        "where": where_text(job),
        "state": Text(state, style=styles.get(view.state, "")),
        "epoch": epoch,
        "train": _loss(view.train_loss),
        "val": _loss(view.val_loss),
        "dice": dice_cell(view),
        "ema": fmt_or_na(view.ema_dice, "{:.3f}"),
        "its": its,
        "wait": _share(getattr(view, "data_wait_share", None)),
        "eta": human_duration(view.eta_s) if view.state in RUNNING_STATES else "",
        "alerts": alerts,
    }
    return full, {**full, "epoch": short_epoch}


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def _plain(value: Text | str) -> str:
    return value.plain if isinstance(value, Text) else value


def _plain_pair(
    both: tuple[dict[str, Text | str], dict[str, Text | str]],
) -> tuple[dict[str, str], dict[str, str]]:
    full = {key: _plain(value) for key, value in both[0].items()}
    return full, {**full, "epoch": _plain(both[1]["epoch"])}


# Narrower layouts, widest first: each level hides the columns people watch least and may
# abbreviate cells. The watched columns (job, state, epoch, Dice, it/s, ETA, alerts) are
# never hidden; when even the last level is too wide the table scrolls sideways with the
# selection mark and the job id fixed on the left.
LAYOUTS: tuple[tuple[frozenset[str], bool], ...] = (
    (frozenset(), False),
    (frozenset({"wait"}), False),
    (frozenset({"wait", "ema"}), False),
    (frozenset({"wait", "ema"}), True),
    (frozenset({"wait", "ema", "val"}), True),
    (frozenset({"wait", "ema", "val", "train"}), True),
    (frozenset({"wait", "ema", "val", "train", "dataset"}), True),
    (frozenset({"wait", "ema", "val", "train", "dataset", "where"}), True),
    (frozenset({"wait", "ema", "val", "train", "dataset", "where", "fold"}), True),
)
NUM_FIXED_COLUMNS = 2  # "sel" and "job" stay in place when scrolling sideways
ALERTS_FIT_WIDTH = 12  # the last column may run past the edge; this much must show


def layout_width(rows: list[dict[str, str]], hidden: frozenset[str], cell_padding: int = 1) -> int:
    """Cells needed by the visible columns of these rows (plain texts), padding included."""
    total = 0
    for key, label in COLUMNS:
        if key in hidden:
            continue
        width = max([len(label), *(len(row[key]) for row in rows)])
        if key == "alerts":
            width = min(width, ALERTS_FIT_WIDTH)
        total += width + 2 * cell_padding
    return total


def choose_layout(full: list[dict[str, str]], short: list[dict[str, str]], available: int) -> int:
    """The widest layout (index into LAYOUTS) whose columns fit in `available` cells."""
    for level, (hidden, abbreviated) in enumerate(LAYOUTS):
        if layout_width(short if abbreviated else full, hidden) <= available:
            return level
    return len(LAYOUTS) - 1


def visible_columns(level: int) -> list[tuple[str, str]]:
    hidden = LAYOUTS[level][0]
    return [(key, label) for key, label in COLUMNS if key not in hidden]


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

    def on_mount(self) -> None:
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
        abbreviated = LAYOUTS[self.level][1]
        for job_id, view in self._views.items():
            if job_id in self._cells:
                cells = self._cells_of(view, abbreviated)
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

    def _both_cells(self, view: JobView) -> tuple[dict[str, Text | str], dict[str, Text | str]]:
        before = self._views.get(view.job.after or "")
        after = before.job.fold if before is not None else None
        styles = PALETTES[self.palette]
        return both_row_cells(view, view.job.job_id in self.selected, after, styles)

    def _cells_of(self, view: JobView, short: bool) -> dict[str, Text | str]:
        return self._both_cells(view)[1 if short else 0]

    def _choose_level(self, views: list[JobView]) -> int:
        return self._level_of([_plain_pair(self._both_cells(v)) for v in views])

    def _level_of(self, plain: list[tuple[dict[str, str], dict[str, str]]]) -> int:
        full = [cells for cells, _ in plain]
        short = [cells for _, cells in plain]
        return choose_layout(full, short, self.scrollable_content_region.width)

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
        self._cells[job_id] = {key: _plain(value) for key, value in cells.items()}

    def show(self, views: list[JobView]) -> None:
        """Rows in the order given (app.services.jobs.listing arranges them)."""
        wanted = {view.job.job_id: view for view in views}
        self._views = wanted
        if self.level is None:
            return  # not mounted yet: on_mount draws these
        both = {j: self._both_cells(v) for j, v in wanted.items()}
        plain = {j: _plain_pair(cells) for j, cells in both.items()}
        level = self._level_of(list(plain.values()))
        if level != self.level:
            self._relayout(level)
            return
        for job_id in [j for j in self._cells if j not in wanted]:
            self.remove_row(job_id)
            del self._cells[job_id]
            self.selected.discard(job_id)
        cursor_job = self._keep_order(list(wanted))
        shown, abbreviated = self.columns_shown, LAYOUTS[level][1]
        for job_id, view in wanted.items():
            old = self._cells.get(job_id)
            if old is None:
                self._add(job_id, view)
                continue
            cells = both[job_id][1 if abbreviated else 0]
            texts = plain[job_id][1 if abbreviated else 0]
            if texts == old:
                continue  # most rows most seconds
            changed = [key for key in shown if old[key] != texts[key]]
            if changed:  # else only hidden columns changed
                self._update_row(job_id, changed, cells, old, texts)
            self._cells[job_id] = texts
        if cursor_job in self._cells:
            self.move_cursor(row=self.get_row_index(cursor_job))

    def _update_row(
        self,
        job_id: str,
        keys: list[str],
        cells: dict[str, Text | str],
        old: dict[str, str],
        new: dict[str, str],
    ) -> None:
        """Put the changed cells of one row on screen. DataTable.update_cell repaints the
        whole table, every row rendered again (a frame's largest part, and a loss, a Dice or
        an ETA changes every few seconds); a change that leaves every changed cell as wide
        as it was cannot move a column, so only that row is repainted."""
        same_widths = all(cell_len(old[k]) == cell_len(new[k]) for k in keys)
        self._row_repaint_only = same_widths
        try:
            for key in keys:
                self.update_cell(job_id, key, cells[key], update_width=not same_widths)
                self.num_cell_updates += 1
        finally:
            self._row_repaint_only = False
        if same_widths:
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
        self._cells[job_id]["sel"] = _plain(mark)
