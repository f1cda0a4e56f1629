"""The jobs table's cells and layouts: the text of every cell of a job's row (full, short,
compact) and the narrower layouts chosen by width (decorations go before identity).

Pure functions over `JobView`s; job_table.py draws them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.cells import cell_len
from rich.text import Text

from app.services.jobs.words import human_duration, state_label
from app.widgets.formatting import bar, fmt_or_na
from trainer.schema.status import RUNNING_STATES, WAITING_STATES, State

if TYPE_CHECKING:
    from collections.abc import Iterable

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


def dataset_number(name: str) -> str:
    """`Dataset004_Hippocampus` -> `004`: the compact layout's dataset (its id)."""
    number = name.removeprefix("Dataset").split("_")[0]
    return number if number.isdigit() else short_dataset(name)[:8]


def short_job_id(job_id: str) -> str:
    """The compact layout's job id: its last two parts (`1206-041529-f0-a3f` -> `f0-a3f`),
    a suffix `nnui stop` and the filter accept; other ids (`run:4242`) whole."""
    parts = job_id.split("-")
    return "-".join(parts[-2:]) if len(parts) >= 3 else job_id


def dataset_text(job: Job, tree: str, compact: bool = False) -> str:
    """`004_Demo 3d_fullres` (compact: `004 3d_fullres`), with the short name of its results
    tree when that is not the default one: `004_Demo 3d_fullres [projB]`."""
    name = dataset_number(job.dataset) if compact else short_dataset(job.dataset)
    return f"{name} {job.configuration}" + (f" [{tree}]" if tree else "")


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


FULL, SHORT, COMPACT = 0, 1, 2  # the cells a layout shows (LAYOUTS)
Cells = dict[str, Text | str]


def row_cells(
    view: JobView,
    selected: bool,
    after_fold: str | None = None,
    styles: dict[str, str] = DARK_STATE_STYLES,
    short: bool = False,
    compact: bool = False,
    tree: str = "",
) -> Cells:
    """The text of every cell of one job's row (`short`: the abbreviated cells of a narrow
    layout — the epoch without its bar; `compact`: also the short job id and dataset)."""
    cells = all_row_cells(view, selected, after_fold, styles, tree)
    return cells[COMPACT if compact else SHORT if short else FULL]


def all_row_cells(
    view: JobView,
    selected: bool,
    after_fold: str | None = None,
    styles: dict[str, str] = DARK_STATE_STYLES,
    tree: str = "",
) -> tuple[Cells, Cells, Cells]:
    """(full, short, compact) cells of one row, built once: the table weighs every layout
    for every job each second, and they differ only in the epoch, job and dataset cells.
    `tree`: the short name of the job's results tree when it is not the default one."""
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
        "dataset": dataset_text(job, tree),
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
    short = {**full, "epoch": short_epoch}
    compact = {**short, "job": short_job_id(job.job_id), "dataset": dataset_text(job, tree, True)}
    return full, short, compact


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def plain_text(value: Text | str) -> str:
    return value.plain if isinstance(value, Text) else value


PlainCells = tuple[dict[str, str], dict[str, str], dict[str, str]]


def plain_cells(cells: tuple[Cells, Cells, Cells]) -> PlainCells:
    full = {key: plain_text(value) for key, value in cells[FULL].items()}
    short = {**full, "epoch": plain_text(cells[SHORT]["epoch"])}
    compact = {**short, "job": plain_text(cells[COMPACT]["job"]),
               "dataset": plain_text(cells[COMPACT]["dataset"])}  # fmt: skip
    return full, short, compact


# Narrower layouts, widest first: each level hides a decoration (data wait, EMA, losses,
# GPUs, it/s) or shortens cells (the epoch bar, then the job id and dataset name); the run's
# identity (dataset, configuration, fold) and the watched columns (job, state, epoch, Dice,
# ETA, alerts) are never hidden. When even the last level is too wide the table scrolls
# sideways with the selection mark and the job id fixed on the left.
_DECORATIONS = ("wait", "ema", "val", "train", "where", "its")
LAYOUTS: tuple[tuple[frozenset[str], int], ...] = (
    (frozenset(), FULL),
    (frozenset(_DECORATIONS[:1]), FULL),
    (frozenset(_DECORATIONS[:2]), FULL),
    (frozenset(_DECORATIONS[:2]), SHORT),
    (frozenset(_DECORATIONS[:3]), SHORT),
    (frozenset(_DECORATIONS[:4]), SHORT),
    (frozenset(_DECORATIONS[:5]), SHORT),
    (frozenset(_DECORATIONS[:6]), SHORT),
    (frozenset(_DECORATIONS[:6]), COMPACT),
)
NUM_FIXED_COLUMNS = 2  # "sel" and "job" stay in place when scrolling sideways
ALERTS_FIT_WIDTH = 12  # the last column may run past the edge; this much must show


Widths = tuple[int, ...]  # a row's text lengths in COLUMNS order
_LABEL_WIDTHS: Widths = tuple(len(label) for _, label in COLUMNS)


def row_widths(row: dict[str, str]) -> Widths:
    return tuple(cell_len(row[key]) for key, _ in COLUMNS)


def column_maxima(rows: Iterable[Widths]) -> Widths:
    """Each column's widest text (its label included) over these rows."""
    return tuple(map(max, zip(_LABEL_WIDTHS, *rows, strict=True)))


def fitted_width(maxima: Widths, hidden: frozenset[str], cell_padding: int = 1) -> int:
    """Cells needed by the visible columns, padding included."""
    total = 0
    for (key, _), width in zip(COLUMNS, maxima, strict=True):
        if key in hidden:
            continue
        total += (min(width, ALERTS_FIT_WIDTH) if key == "alerts" else width) + 2 * cell_padding
    return total


def layout_width(rows: list[dict[str, str]], hidden: frozenset[str], cell_padding: int = 1) -> int:
    """Cells needed by the visible columns of these rows (plain texts), padding included."""
    return fitted_width(column_maxima(row_widths(row) for row in rows), hidden, cell_padding)


def choose_level(maxima: tuple[Widths, Widths, Widths], available: int) -> int:
    """The widest layout (index into LAYOUTS) whose columns fit in `available` cells, from
    each kind's (FULL, SHORT, COMPACT) column maxima: the table keeps every row's widths, so
    a board of hundreds of rows measures them once, not once per layout and second."""
    for level, (hidden, kind) in enumerate(LAYOUTS):
        if fitted_width(maxima[kind], hidden) <= available:
            return level
    return len(LAYOUTS) - 1


def choose_layout(
    full: list[dict[str, str]],
    short: list[dict[str, str]],
    available: int,
    compact: list[dict[str, str]] | None = None,
) -> int:
    """choose_level for rows of plain texts."""
    rows = (full, short, short if compact is None else compact)
    f, s, c = (column_maxima(row_widths(row) for row in kind) for kind in rows)
    return choose_level((f, s, c), available)


def visible_columns(level: int) -> list[tuple[str, str]]:
    hidden = LAYOUTS[level][0]
    return [(key, label) for key, label in COLUMNS if key not in hidden]
