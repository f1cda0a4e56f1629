"""The few lines about one job that the dashboard shows under its table and the job detail
shows as its header (one renderer, shared without the screens importing each other)."""

from __future__ import annotations

from typing import Any

from rich.text import Text

FAILED_TAIL_LINES = 4


def summary_text(view: Any | None) -> Text:
    """One or a few lines about the highlighted job (exit code and console of a failure)."""
    if view is None:
        return Text("No jobs yet. Press l to launch folds (? for help).", style="dim")
    job = view.job
    text = Text()
    # Separating spaces end the previous span (SVG renderers drop a span's leading spaces).
    text.append(f"{job.job_id}  ", style="bold")
    text.append(f"{job.dataset} {job.configuration} fold {job.fold}  {view.state}  ")
    if view.exit_code:
        text.append(f"exit code {view.exit_code}  ", style="bold red")
    if job.queued_stop:
        text.append("stop queued (sent when the ranks report their topology)  ", style="yellow")
    if view.alerts:
        text.append("⚠ " + "; ".join(view.alerts), style="bold red")
    if view.state in ("failed", "lost") and view.console_tail:
        for line in list(view.console_tail)[-FAILED_TAIL_LINES:]:
            text.append("\n  │ " + line.rstrip("\n"), style="red")
    return text
