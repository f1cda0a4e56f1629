"""Fold board: folds 0-4 and `all` (rows) against GPUs (columns).

A fold on one GPU runs alone on it; several folds on the same GPU run one after another;
a fold on several GPUs is a DDP group (-num_gpus spawn or torchrun, the user's choice).
`BoardModel` is the pure logic (tested without a screen); `FoldBoard` draws it and takes
keys (arrows, space) and mouse clicks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.events import Click
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from app.widgets.formatting import readable_style
from app.widgets.key_order import KeysOnArrival
from trainer.schema.tree import FOLDS

CPU_COLUMN = "cpu"
LABEL_WIDTH = 10
CELL_WIDTH = 9  # per GPU column; narrower (down to MIN_CELL_WIDTH) when the screen is
MIN_CELL_WIDTH = 4  # "[ ]" and a space: many GPUs on 80 columns never wrap a row
BOARD_GUTTER = 4  # the board's border and padding (nnui.tcss #board)


@dataclass(frozen=True)
class RequestSpec:
    """What one LaunchRequest should hold (kept free of the services types)."""

    folds: tuple[str, ...]
    gpus: tuple[str, ...]
    mode: str  # per_gpu | spawn | torchrun
    sequential: bool


@dataclass
class BoardModel:
    columns: list[str]  # GPU indices as strings, or ["cpu"]
    assignments: dict[str, list[str]] = field(default_factory=dict)  # fold -> columns
    ddp_launcher: str = "spawn"  # spawn | torchrun

    @property
    def device(self) -> str:
        return "cpu" if self.columns == [CPU_COLUMN] else "cuda"

    def toggle(self, fold: str, column: str) -> None:
        chosen = self.assignments.setdefault(fold, [])
        if column in chosen:
            chosen.remove(column)
        else:
            chosen.append(column)
            chosen.sort(key=lambda c: (len(c), c))
        if not chosen:
            del self.assignments[fold]

    def is_on(self, fold: str, column: str) -> bool:
        return column in self.assignments.get(fold, [])

    def specs(self) -> list[RequestSpec]:
        """Folds grouped into launch requests, in fold order."""
        by_gpu: dict[str, list[str]] = {}
        specs: list[RequestSpec] = []
        for fold in FOLDS:
            cols = self.assignments.get(fold)
            if not cols:
                continue
            if len(cols) == 1:
                by_gpu.setdefault(cols[0], []).append(fold)
            else:
                specs.append(RequestSpec((fold,), tuple(cols), self.ddp_launcher, False))
        for gpu, folds in by_gpu.items():
            specs.append(RequestSpec(tuple(folds), (gpu,), "per_gpu", len(folds) > 1))
        return specs

    def checks(self) -> list[str]:
        """Blocking problems of the board itself (the launcher checks the rest: batch size,
        running or finished folds, busy GPUs and other users)."""
        problems: list[str] = []
        if not self.assignments:
            problems.append("no fold assigned: move with the arrows, space puts a fold on a GPU")
        owners: dict[str, list[str]] = {}
        for fold, cols in self.assignments.items():
            for col in cols:
                owners.setdefault(col, []).append(fold)
        for col, folds in owners.items():
            groups = [f for f in folds if len(self.assignments[f]) > 1]
            if groups and len(folds) > 1:
                rest = ", ".join(f for f in folds if f != groups[0])
                problems.append(
                    f"GPU {col} is in the DDP group of fold {groups[0]} and also given to "
                    f"fold {rest}: a GPU holds one DDP group or a queue of single folds"
                )
        return problems


class FoldBoard(KeysOnArrival, Widget, can_focus=True):
    """Keyboard-first grid; click a cell to toggle it too. Its keys act on arrival
    (`KeysOnArrival`): an arrow or space pressed just before `f` still moves or toggles."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1, 0)", "Up", show=False, id="board-up"),
        Binding("down", "move(1, 0)", "Down", show=False, id="board-down"),
        Binding("left", "move(0, -1)", "Left", show=False, id="board-left"),
        Binding("right", "move(0, 1)", "Right", show=False, id="board-right"),
        Binding("space", "toggle", "Toggle fold/GPU", id="board-toggle"),
    ]

    cursor: reactive[tuple[int, int]] = reactive((0, 0))

    class Changed(Message):
        def __init__(self, board: FoldBoard) -> None:
            super().__init__()
            self.board = board

    def __init__(self, columns: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = BoardModel(columns=list(columns) or [CPU_COLUMN])

    def cell_width(self, available: int) -> int:
        """Cells per GPU column that fit `available` cells (rows never wrap)."""
        fit = (available - LABEL_WIDTH) // max(1, len(self.model.columns))
        return max(MIN_CELL_WIDTH, min(CELL_WIDTH, fit))

    def get_content_width(self, container: Any, viewport: Any) -> int:
        cell = self.cell_width(container.width - BOARD_GUTTER)
        return LABEL_WIDTH + cell * len(self.model.columns)

    def render(self) -> Text:
        cell = self.cell_width(self.size.width)
        text = Text()
        text.append(" " * LABEL_WIDTH)
        for col in self.model.columns:
            label = "CPU" if col == CPU_COLUMN else f"GPU {col}"
            if len(label) >= cell:
                label = "CPU" if col == CPU_COLUMN else f"G{col}"
            if col.startswith("MIG-"):  # a MIG device: the first digits of its UUID
                label = f"MIG {col[4:8]}"[: cell - 1]
            text.append(label.center(cell), style="bold")
        for row, fold in enumerate(FOLDS):
            text.append("\n")
            text.append(f" fold {fold}".ljust(LABEL_WIDTH), style="bold")
            ddp = len(self.model.assignments.get(fold, [])) > 1
            for col_i, col in enumerate(self.model.columns):
                on = self.model.is_on(fold, col)
                mark = ("[D]" if ddp else "[■]") if on else "[ ]"
                style = ("bold magenta" if ddp else "bold green") if on else "dim"
                style = readable_style(style, self.app.no_color)
                if (row, col_i) == self.cursor and self.has_focus:
                    style += " reverse"
                text.append(mark.center(cell), style=style)
        return text

    def action_move(self, d_row: int, d_col: int) -> None:
        row, col = self.cursor
        self.cursor = (
            (row + d_row) % len(FOLDS),
            (col + d_col) % len(self.model.columns),
        )

    # The board's own toggle (the key binding passes no argument), not DOMNode's attribute one.
    def action_toggle(self) -> None:  # type: ignore[override]
        row, col = self.cursor
        self.toggle(FOLDS[row], self.model.columns[col])

    def toggle(self, fold: str, column: str) -> None:
        self.model.toggle(fold, column)
        self.refresh()
        self.post_message(self.Changed(self))

    def set_ddp_launcher(self, launcher: str) -> None:
        self.model.ddp_launcher = launcher
        self.post_message(self.Changed(self))

    def on_click(self, event: Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        row = offset.y - 1
        col = (offset.x - LABEL_WIDTH) // self.cell_width(self.size.width)
        if 0 <= row < len(FOLDS) and offset.x >= LABEL_WIDTH and col < len(self.model.columns):
            self.cursor = (row, col)
            self.toggle(FOLDS[row], self.model.columns[col])

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()
