"""The words the screens and `nnui status` use for a job's state, its alerts and what a
resume continues from: one place, so the table, the header, the dialogs and the CLI agree."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.schema.status import ENDED_STATES, State
from trainer.schema.tree import checkpoint_file

if TYPE_CHECKING:
    from app.services.jobs.views import JobView


def state_label(view: JobView) -> str:
    """The state as users read it, the same in the jobs table and `nnui status`: a kill
    is "killed by you" (not a failure with exit 143), a final validation shows its cases,
    a run whose results folder vanished says so."""
    state = str(view.state)
    cases = getattr(view, "validation_cases", None)  # getattr: also plain stand-in views
    if state == State.FAILED and view.exit_code is not None:
        state = f"failed (exit {view.exit_code})"
    elif state == State.KILLED:
        state = "killed by you"  # nnui kill / k: whatever exit code the kill caused
    elif state == State.VALIDATING and cases:
        state = f"validating {getattr(view, 'validation_done', 0) or 0}/{cases} cases"
    if getattr(view, "run_dir_gone", False) and view.state in ENDED_STATES:
        state += " (run folder gone)"
    return state


RESUME_ORDER = ("final", "latest", "best")  # the trainer's order on equal epochs (--c)


def resume_from(view: JobView) -> str:
    """What a `--c` resume of this job continues from, in words: the checkpoint the trainer
    will pick (the newest saved one whose file is still there) and its epoch, or that it
    starts from scratch. Reads only whether the files exist."""
    folder = Path(view.job.run_dir)
    if getattr(view.job, "engine", "nnui") == "nnunet":
        found = [n for n in ("checkpoint_final.pth", "checkpoint_latest.pth")
                 if (folder / n).is_file()]  # fmt: skip
        if found:
            return f"continues from nnU-Net's {found[0]} in {folder}"
        return f"no checkpoint in {folder}: nnU-Net starts from scratch (epoch 1)"
    saved = [(kind, done) for kind, done in view.checkpoints
             if (folder / checkpoint_file(kind)).is_file()]  # fmt: skip
    if not saved:
        return f"no checkpoint in {folder}: starts from scratch (epoch 1)"
    kind, done = min(saved, key=lambda s: (-s[1], RESUME_ORDER.index(s[0])))
    total = view.num_epochs or "?"
    return (
        f"continues from {checkpoint_file(kind)}: {done}/{total} epochs done, next epoch {done + 1}"
    )


def alert_condition(alert: str) -> str:
    """What an alert is about, without its changing numbers ("stalled: no event for 208 s"
    and "... 209 s" are one condition): notifications are de-duplicated by it."""
    return re.sub(r"(?<!GPU )\d+(\.\d+)?", "#", alert)  # a GPU's index names the condition


def human_duration(seconds: float | None) -> str:
    """Every duration users read: `31 s`, `4 min`, `2 h 10 min`; `n/a` when unknown.

    Whole units only: an ETA is an estimate, and `0m` for half a minute read as "done".
    """
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes = round(whole / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def stopping_since(view: JobView) -> float | None:
    """When the stop of a stopping run was asked: the first SIGUSR1 nnui sent, else the
    run's own first stop_requested event, whichever is earlier; None: not known."""
    sent = [s.t for s in view.job.signals if s.signal == "SIGUSR1" and s.result == "sent"]
    heard = getattr(view, "stop_requested_at", None)
    times = [t for t in (*sent, heard) if isinstance(t, (int, float)) and math.isfinite(t)]
    return min(times) if times else None


def already_stopping(view: JobView, now: float) -> str:
    """`nnui stop` of a run that is already stopping: what it says (exit 3)."""
    since = stopping_since(view)
    when = ""
    if since is not None:
        clock = time.strftime("%H:%M:%S", time.localtime(since))
        when = f" since {clock} ({human_duration(now - since)} ago)"
    unit = "case" if view.job.kind == "predict" else "epoch"
    return (
        f"nothing to do: {view.job.job_id} is already stopping{when}; it ends after its "
        f"current {unit} (nnui kill {view.job.job_id} ends it now)"
    )
