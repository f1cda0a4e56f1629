"""Confirm dialogs. Stop lists the exact pids, ranks, devices and the epoch at whose end
the trainer stops (or why nothing is sent / that it is queued). Kill needs the word
`kill` typed. Launch/resume shows the exact environment and argv of every process. A
refusal (s/r/k on a watch-only nnU-Net run) says why and how, and offers only Close.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Static

from app.widgets.formatting import readable_style
from trainer.schema.status import State

if TYPE_CHECKING:
    from app.screens.choices import KillChoice, StopChoice
    from app.services.jobs.views import JobView
    from app.services.nnunet.runs import StopRefusal

KILL_WORD = "kill"


def _before_first_epoch(view: JobView) -> bool:
    """No epoch has ended and no training step of epoch 1 reported: a stop now ends the
    start-up (trainer.training.worker: stop before the first epoch, nothing to save)."""
    if view.epoch not in (0, None) or view.history:
        return False
    return not any(p.epoch == 0 for p in getattr(view, "running_loss", ()))


def stop_text(choices: Sequence[StopChoice], mono: bool = False) -> Text:
    text = Text()
    for i, choice in enumerate(choices):
        view, plan = choice.view, choice.plan
        job = view.job
        if i:
            text.append("\n\n")
        predicting = getattr(job, "kind", "train") == "predict"
        epoch = "n/a" if view.epoch is None else f"{view.epoch}/{view.num_epochs or '?'}"
        if predicting:
            epoch = f"{getattr(view, 'cases_done', None)}/{getattr(view, 'num_cases', None)}"
        text.append(f"{job.job_id}  ", style="bold")
        text.append(f"{job.dataset} {job.configuration} fold {job.fold}  ")
        text.append(f"{view.state}, {'cases' if predicting else 'epoch'} {epoch}")
        if choice.note:
            text.append(f"\n{choice.note}", style=readable_style("yellow", mono))
        if plan is None:
            continue
        if plan.ok:
            text.append("\n")
            text.append("SIGUSR1 to:", style="bold")
            for t in plan.targets:
                text.append(
                    f"\n  pid {t.pid:<8d} rank {t.rank} (local {t.local_rank})  "
                    f"host {t.host}  device {t.device}"
                )
            # plan.epoch counts completed epochs, like the table: the running one is the next.
            at = (
                "the running epoch"
                if plan.epoch is None
                else f"the running epoch (epoch {plan.epoch + 1}/{view.num_epochs or '?'})"
            )
            ending = f"It stops at the end of {at}, writes checkpoint_latest and exits 0."
            if view.state == State.VALIDATING:
                ending = "The final validation finishes first; the run then ends as finished."
            elif _before_first_epoch(view):
                first = f"epoch 1/{view.num_epochs or '?'}"
                ending = (
                    f"No step of {first} has reported yet. Still starting up: it stops before "
                    f"{first}, with no checkpoint (a resume starts from scratch). Already in "
                    f"{first}: it stops at its end, writes checkpoint_latest and exits 0."
                )
            if predicting:
                ending = (
                    "It writes the case it is predicting, then exits 0 (resume with r: "
                    "--continue_prediction does the rest)."
                )
            text.append(f"\n{ending}", style=readable_style("green", mono))
        elif plan.queued:
            text.append(
                f"\nQueued: {plan.reason or 'the ranks have not reported yet'}. "
                "The stop is sent as soon as they do.",
                style=readable_style("yellow", mono),
            )
        else:
            text.append(
                f"\nNothing will be sent: {plan.reason}", style=readable_style("bold red", mono)
            )
    return text


class StopConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Stop", id="confirm-stop"),
        Binding("n,escape", "cancel", "Cancel", id="cancel-stop"),
    ]

    def __init__(self, choices: Sequence[StopChoice]) -> None:
        super().__init__(id="stop-confirm")
        self.choices = list(choices)
        self.actionable = any(c.sends or c.queues for c in self.choices)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Graceful stop (SIGUSR1)", classes="dialog-title")
            with VerticalScroll(classes="dialog-body"):
                yield Static(stop_text(self.choices, self.app.no_color), id="stop-plan")
            with Horizontal(classes="dialog-buttons"):
                if self.actionable:
                    yield Button("Stop (y)", variant="warning", id="yes")
                    yield Button("Cancel (n)", id="no")
                else:
                    yield Button("Close (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no" if not self.actionable else "#yes", Button).focus()

    def action_confirm(self) -> None:
        self.dismiss(self.actionable)

    def action_cancel(self) -> None:
        self.dismiss(False)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes" and self.actionable)


def kill_text(choices: Sequence[KillChoice], mono: bool = False) -> Text:
    text = Text()
    for i, choice in enumerate(choices):
        job = choice.view.job
        if i:
            text.append("\n\n")
        text.append(f"{job.job_id}  ", style="bold")
        text.append(f"{job.dataset} {job.configuration} fold {job.fold}  {choice.view.state}")
        if not choice.processes:
            text.append("\nno live process of this job found", style=readable_style("yellow", mono))
        for proc in choice.processes:
            cmd = " ".join(proc.cmdline)[:70]
            text.append(
                f"\npid {proc.pid:<8d} {proc.name:<16s} {cmd}", style=readable_style("red", mono)
            )
    text.append(
        "\n\nSIGTERM now, SIGKILL after 10 s. No checkpoint is written: the epoch is lost.",
        style="bold",
    )
    return text


class KillConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="cancel-kill")
    ]

    def __init__(self, choices: Sequence[KillChoice]) -> None:
        super().__init__(id="kill-confirm")
        self.choices = list(choices)
        self.num_refused = 0  # entries that were not the word (tests wait for it)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Kill (SIGTERM, then SIGKILL)", classes="dialog-title danger")
            with VerticalScroll(classes="dialog-body"):
                yield Static(kill_text(self.choices, self.app.no_color), id="kill-plan")
            yield Static(f'Type "{KILL_WORD}" and press enter to confirm, escape to cancel.')
            yield Input(placeholder=KILL_WORD, id="kill-word")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip() == KILL_WORD:
            self.dismiss(True)
        else:
            self.num_refused += 1
            self.notify(f'Type exactly "{KILL_WORD}" to kill, or escape', severity="warning")

    def action_cancel(self) -> None:
        self.dismiss(False)


class LaunchConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Start", id="confirm-launch"),
        Binding("n,escape", "cancel", "Cancel", id="cancel-launch"),
    ]

    def __init__(
        self, title: str, previews: Sequence[str], problems: Sequence[str],
        notes: Sequence[str] = (),
    ) -> None:  # fmt: skip
        super().__init__(id="launch-confirm")
        self.title_text = title
        self.previews = list(previews)
        self.problems = list(problems)
        self.notes = list(notes)  # what the user agrees to, e.g. a GPU already in use

    def compose(self) -> ComposeResult:
        ok = bool(self.previews) and not self.problems
        body, mono = Text(), self.app.no_color
        for problem in self.problems:
            body.append(f"✗ {problem}\n", style=readable_style("bold red", mono))
        for note in self.notes:
            body.append(f"? {note}\n", style=readable_style("bold yellow", mono))
        body.append("\n\n".join(self.previews))
        with Vertical(classes="dialog"):
            yield Static(self.title_text, classes="dialog-title")
            with VerticalScroll(classes="dialog-body"):
                yield Static(body, id="launch-preview-text")
            with Horizontal(classes="dialog-buttons"):
                if ok:
                    yield Button("Start (y)", variant="success", id="yes")
                yield Button("Cancel (n)", id="no")

    def action_confirm(self) -> None:
        self.dismiss(bool(self.previews) and not self.problems)

    def action_cancel(self) -> None:
        self.dismiss(False)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


def refusal_text(refusals: Sequence[tuple[JobView, StopRefusal]], mono: bool = False) -> Text:
    """(view, nnunet_runs.StopRefusal) pairs: the reason and the hints of each."""
    text = Text()
    for i, (view, refusal) in enumerate(refusals):
        job = view.job
        if i:
            text.append("\n\n")
        text.append(f"{job.job_id}  ", style="bold")
        text.append(f"{job.dataset} {job.configuration} fold {job.fold}  {view.state}\n")
        text.append(refusal.reason, style=readable_style("bold red", mono))
        for hint in refusal.hints:
            text.append(f"\n{hint}")
    return text


class RefusalScreen(ModalScreen[None]):
    """Nothing to confirm: nnui will not act on these jobs, and says why."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("n,escape,enter", "close", "Close", id="close-refusal")
    ]

    def __init__(self, title: str, refusals: Sequence[tuple[JobView, StopRefusal]]) -> None:
        super().__init__(id="refusal")
        self.title_text = title
        self.refusals = list(refusals)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.title_text, classes="dialog-title danger")
            with VerticalScroll(classes="dialog-body"):
                yield Static(refusal_text(self.refusals, self.app.no_color), id="refusal-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Close (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def action_close(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)
