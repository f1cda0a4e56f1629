"""Help: every key of the dashboard, the job detail and the launch screen, and a few notes."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.screens import keys


def _section(text: Text, title: str, bindings: list[Binding]) -> None:
    text.append(f"\n{title}\n", style="bold underline")
    for b in bindings:
        key = b.key_display or b.key
        text.append(f"  {key:<12s}", style="bold cyan")
        text.append(f"{b.description}\n")


def help_text(readonly: bool) -> Text:
    text = Text()
    if readonly:
        text.append("READ-ONLY: launch, stop, resume and kill are not bound.\n", style="bold")
    dash = keys.DASHBOARD_NAV + ([] if readonly else keys.DASHBOARD_ACTIONS) + keys.DASHBOARD_VIEW
    dash_extra = [
        Binding("space", "", "select / unselect a job (stop several at once)"),
        Binding("up/down", "", "move in the jobs table"),
        Binding("ctrl+p", "", "command palette (every action by name)"),
    ]
    _section(text, "Dashboard", dash + dash_extra)
    detail = keys.DETAIL_NAV + ([] if readonly else keys.DETAIL_ACTIONS)
    _section(text, "Job detail", detail)
    _section(text, "Cross-validation (v)", keys.CV_NAV + ([] if readonly else keys.CV_ACTIONS))
    if not readonly:
        board = [
            Binding("arrows", "", "move on the fold board"),
            Binding("space", "", "put a fold on a GPU / take it off (click works too)"),
            *keys.LAUNCH,
        ]
        _section(text, "Launch", board)
        _section(text, "Prediction form (p on the board)", keys.PREDICT)
        _section(text, "Cluster form (x on the board)", keys.CLUSTER)
    text.append("\nNotes\n", style="bold underline")
    text.append(
        "  One fold on one GPU runs alone; several folds on one GPU run one after another;\n"
        "  one fold on several GPUs is a DDP group (global batch must be >= and divisible by\n"
        "  the group size). Stop (s) sends SIGUSR1 to the worker ranks only: the trainer\n"
        "  finishes the epoch, saves checkpoint_latest and exits 0; resume (r) restarts it\n"
        "  with --c on the same GPUs. Kill (k) is SIGTERM then SIGKILL (no checkpoint).\n"
        "  Quitting nnui (q) leaves jobs running; a new nnui re-attaches to them.\n"
        "  Engine (e on the board): nnui's trainer, or the real nnU-Net with nnui's extension\n"
        "  trainer (its plans files, -tr nnUNetTrainer_nnui). Rows marked watch-only are\n"
        "  nnU-Net runs nnui did not start: s, r and k only say why not and how to restart\n"
        "  them so they can be stopped gracefully.\n"
        "  Predict (p on the board): the folds marked on the board predict a folder, one part\n"
        "  of the cases per marked GPU (jobs of kind predict; s stops after the current case,\n"
        "  r continues with --continue_prediction).\n"
    )
    return text


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "close", "Close", id="help-close")
    ]

    def __init__(self, readonly: bool = False) -> None:
        super().__init__(id="help")
        self.readonly = readonly

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("nnui — keys", classes="dialog-title")
            with VerticalScroll(classes="dialog-body"):
                yield Static(help_text(self.readonly), id="help-text")
            yield Static("escape closes", classes="dim")

    def action_close(self) -> None:
        self.dismiss(None)
