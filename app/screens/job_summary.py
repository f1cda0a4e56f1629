"""The few lines about one job that the dashboard shows under its table and the job detail
shows as its header (one renderer, shared without the screens importing each other)."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from app.services.jobs.words import human_duration, state_label
from app.widgets.formatting import readable_style
from trainer.schema.status import FAILED_STATES, State

FAILED_TAIL_LINES = 4
EXIT_NAMED_BY = frozenset({State.KILLED, State.FAILED})  # their name says why it exited


def watch_only_text(run: Any, mono: bool = False) -> Text:
    """What a watch-only row adds: whose run it is, its per-class Dice, pace and log."""
    text = Text()
    gpus = ",".join(run.gpus) or ("cpu" if run.args.device == "cpu" else "n/a")
    text.append(f"watch-only: {run.owner}'s nnU-Net run, not started by nnui ",
                style=readable_style("cyan", mono))  # fmt: skip
    text.append(f"(pid {run.pid}, -tr {run.trainer} -p {run.plans}, GPUs {gpus})  ")
    text.append("s/r/k are refused for it\n", style=readable_style("dim", mono))
    dice = " ".join(f"{d:.3f}" for d in run.dice_per_class) or "n/a"
    text.append(f"  Dice per class {dice}  EMA ")
    text.append("n/a" if run.ema_fg_dice is None else f"{run.ema_fg_dice:.3f}")
    text.append(f"  median epoch {human_duration(run.median_epoch_time_s)}")
    text.append(f"  ETA {human_duration(run.eta_s)}  log {run.log_path}")
    return text


def summary_text(
    view: Any | None,
    first_step: str | None = None,
    num_unreadable: int = 0,
    loading: bool = False,
    mono: bool = False,
) -> Text:
    """One or a few lines about the highlighted job (exit code and console of a failure);
    with no job, what to do first (`first_step`: no dataset to train yet). Never "No jobs
    yet" before the first reading (`loading`) or when job files could not be read. `mono`:
    NO_COLOR, where the exit code, alerts and a failure's console keep full contrast."""

    def style(name: str) -> str:
        return readable_style(name, mono)

    if view is None:
        if loading:
            return Text("Reading the jobs ...", style=style("dim"))
        if num_unreadable:
            files = "file" if num_unreadable == 1 else "files"
            return Text(f"No readable job: {num_unreadable} job {files} could not be read "
                        "(named in the warning below).", style=style("bold yellow"))  # fmt: skip
        if first_step:
            return Text(f"No jobs yet. First: {first_step}.", style=style("bold yellow"))
        return Text("No jobs yet. Press l to launch folds (? for help).", style=style("dim"))
    job = view.job
    text = Text()
    # Separating spaces end the previous span (SVG renderers drop a span's leading spaces).
    text.append(f"{job.job_id}  ", style="bold")
    text.append(f"{job.dataset} {job.configuration} fold {job.fold}  {state_label(view)}  ")
    if getattr(view, "watch", None) is not None:
        return text + watch_only_text(view.watch, mono)
    if getattr(job, "kind", "train") == "predict":
        text.append(f"predict -> {job.output_dir}  ", style=style("cyan"))
    if getattr(job, "engine", "nnui") == "nnunet":
        text.append("nnU-Net  ", style=style("cyan"))
    if getattr(view, "final_dice", None) is not None:
        text.append(f"final validation Dice {view.final_dice:.3f}  ", style="bold")
    if view.exit_code and view.state not in EXIT_NAMED_BY:
        text.append(f"exit code {view.exit_code}  ", style=style("bold red"))
    if job.queued_stop:
        text.append(
            "stop queued (sent when the ranks report their topology)  ", style=style("yellow")
        )
    if view.alerts:
        text.append("⚠ " + "; ".join(view.alerts), style=style("bold red"))
    if view.state in FAILED_STATES and view.console_tail:
        for line in list(view.console_tail)[-FAILED_TAIL_LINES:]:
            text.append("\n  │ " + line.rstrip("\n"), style=style("red"))
    return text
