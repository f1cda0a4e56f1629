"""The board's alerts about a job: NaN loss, a stall, a run folder gone, invalid event lines,
a step starved of data, a lost or shared GPU. Read-only: the verdicts come from the events,
the record (the supervisor's stall rule, stall.py) and the latest GPU snapshot.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from app.services.jobs.job_state import RunFacts, run_dir_gone
from trainer.schema.status import WORKING_STATES, State

if TYPE_CHECKING:
    from app.services.jobs.curves import EpochPoint
    from app.services.jobs.registry import Job
    from app.services.machine.gpus import MachineSnapshot


class AlertFacts(RunFacts, Protocol):
    """What the alerts read of a run folder's events, beyond the state rule's facts."""

    nan_epoch: int | None
    events: Any

    def history_points(self) -> tuple[EpochPoint, ...]: ...


DATA_WAIT_ALERT_SHARE = 0.3  # of the step time, over each of the last DATA_WAIT_EPOCHS epochs
DATA_WAIT_EPOCHS = 3


def data_wait_alert(history: tuple[EpochPoint, ...]) -> str | None:
    """The step waited for batches for a large share of its time, epoch after epoch: the
    GPU (or CPU) is starved by data loading, and the fix is on the user's side."""
    recent = [p.data_wait_share for p in history[-DATA_WAIT_EPOCHS:]]
    if len(recent) < DATA_WAIT_EPOCHS or not all(
        math.isfinite(s) and s >= DATA_WAIT_ALERT_SHARE for s in recent
    ):
        return None
    return (
        f"waiting for data {recent[-1]:.0%} of the step: more --num-workers, fewer parallel "
        "jobs on this machine's cores, or augmentation on the GPU (--augment-on device)"
    )


def job_alerts(
    job: Job, run: AlertFacts, state: State, snapshot: MachineSnapshot | None
) -> tuple[str, ...]:
    """Every alert that holds for the job now, in a fixed order."""
    alerts = []
    if run.nan_epoch is not None:
        alerts.append(f"NaN loss at epoch {run.nan_epoch}")
    if state == State.RUNNING and job.stalled_at is not None:
        # One rule (stall.py), applied by the job's supervisor, which also sees CPU time
        # and final validation; a view only reads its verdict.
        alerts.append(f"stalled: {job.stall_reason or 'no progress'}")
    if run_dir_gone(job, run):
        alerts.append(f"run folder gone: {job.run_dir}")
    if run.events.num_invalid:
        alerts.append(f"{run.events.num_invalid} invalid event lines skipped")
    waiting = data_wait_alert(run.history_points()) if state == State.RUNNING else None
    if waiting is not None:
        alerts.append(waiting)
    if snapshot is not None and not snapshot.simulated and state in WORKING_STATES:
        for gpu in job.gpus:
            reading = snapshot.slot(gpu)
            if reading is not None and reading.lost:
                alerts.append(f"GPU {gpu} lost (NVML: GPU is lost): the job cannot go on")
            if reading is not None and reading.other_users:
                alerts.append(f"GPU {gpu} also used by {', '.join(reading.other_users)}")
    return tuple(alerts)
