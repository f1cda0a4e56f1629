"""Jobs table: one row per job, keyed columns, cells updated only when their text changes.

Renders `JobView`s it is given. Space toggles a job in the multi-selection used by stop.
nnU-Net runs nnui did not start are rows marked "watch-only" with their owner.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist

from app.services.job_text import state_label
from app.widgets.formatting import bar, fmt_duration_s, fmt_or_na
from trainer.schema import State

if TYPE_CHECKING:
    from app.services.jobs import JobView
    from app.services.registry import Job

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
    ("eta", "ETA"),
    ("alerts", "alerts"),
)

STATE_STYLES: dict[str, str] = {
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
    view: JobView, selected: bool, after_fold: str | None = None
) -> dict[str, Text | str]:
    """The text of every cell of one job's row."""
    job = view.job
    state = state_label(view)
    if job.after and view.state in ("starting", "queued"):
        state = f"{view.state} (after fold {after_fold or '?'})"
    if getattr(view, "watch_only", False):
        owner = getattr(view.watch, "owner", "?")
        state = f"{view.state} {WATCH_ONLY} ({owner})"
    if view.epoch is not None and view.num_epochs:
        done = min(view.epoch + 1, view.num_epochs) if view.state == "finished" else view.epoch
        epoch = f"{view.epoch}/{view.num_epochs} {bar(done / view.num_epochs, 6)}"
    else:
        epoch = fmt_or_na(view.epoch)
    fold, its = job.fold, fmt_or_na(view.it_per_s, "{:.2f}")
    if getattr(job, "kind", "train") == "predict":
        fold, epoch, its = prediction_cells(view)
    alerts = Text(" ".join(view.alerts), style="bold red") if view.alerts else Text("")
    waiting = getattr(job, "waiting_reason", None)
    if waiting and view.state == "queued":  # a --when-free job: why it has not started
        alerts = Text(f"waiting: {waiting} ", style="yellow") + alerts
    restarts = getattr(job, "restarts", None)
    if restarts:
        alerts = Text(f"restarts {len(restarts)}/{job.retries}: {restarts[-1]} ") + alerts
    return {
        "sel": Text("●", style="bold magenta") if selected else " ",
        "job": job.job_id,
        "dataset": f"{short_dataset(job.dataset)} {job.configuration}",
        "fold": fold,
        "where": where_text(job),
        "state": Text(state, style=STATE_STYLES.get(view.state, "")),
        "epoch": epoch,
        "train": _loss(view.train_loss),
        "val": _loss(view.val_loss),
        "dice": dice_cell(view),
        "ema": fmt_or_na(view.ema_dice, "{:.3f}"),
        "its": its,
        "eta": fmt_duration_s(view.eta_s) if view.state in ("running", "validating") else "",
        "alerts": alerts,
    }


def _plain(value: Text | str) -> str:
    return value.plain if isinstance(value, Text) else value


class JobTable(DataTable):
    """DataTable of jobs. `show(views)` adds, updates and removes rows in place."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("space", "toggle_select", "Select", id="select")
    ]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.selected: set[str] = set()
        self._cells: dict[str, dict[str, str]] = {}
        self._views: dict[str, JobView] = {}
        self.num_cell_updates = 0  # for the benchmark and tests: proves "only on change"

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, views: list[JobView]) -> None:
        """Rows in the order given (app.services.job_list arranges them)."""
        wanted = {view.job.job_id: view for view in views}
        folds = {job_id: view.job.fold for job_id, view in wanted.items()}
        for job_id in [j for j in self._cells if j not in wanted]:
            self.remove_row(job_id)
            del self._cells[job_id]
            self.selected.discard(job_id)
        cursor_job = self._keep_order(list(wanted))
        for job_id, view in wanted.items():
            after = folds.get(view.job.after or "")
            cells = row_cells(view, job_id in self.selected, after)
            plain = {key: _plain(value) for key, value in cells.items()}
            old = self._cells.get(job_id)
            if old is None:
                self.add_row(*(cells[key] for key, _ in COLUMNS), key=job_id)
            else:
                for key, text in plain.items():
                    if old[key] != text:
                        self.update_cell(job_id, key, cells[key], update_width=True)
                        self.num_cell_updates += 1
            self._cells[job_id] = plain
        self._views = wanted
        if cursor_job in self._cells:
            self.move_cursor(row=self.get_row_index(cursor_job))

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
