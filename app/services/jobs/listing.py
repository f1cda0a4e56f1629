"""The job list after weeks: one row per run folder, grouped, filtered and sorted.

- A run folder is one row: `nnui resume` starts a new job in the same folder, and that job
  continues the row (its curves already hold the earlier runs' epochs) instead of adding an
  unrelated one. The row shows the newest job, or the one still active.
- Rows are grouped by results tree x dataset x configuration x trainer (the trainer is the
  first part of the folder `Trainer__Plans__configuration`), and sorted inside each group.
- A filter keeps the rows whose text holds every word typed (any order, any case); a job
  id typed keeps its row after a resume (the earlier jobs' ids count as the row's).
Works on JobView-like objects (`.job`, `.state`, `.ema_dice`, `.eta_s`); no textual.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.services.jobs.identity import results_tree
from trainer.schema.status import ACTIVE_STATES, State

if TYPE_CHECKING:  # types only: the listing reads the views it is handed
    from app.services.jobs.registry import Job
    from app.services.jobs.views import JobView

SORTS = ("fold", "newest", "state", "Dice", "ETA")  # `o` on the dashboard cycles these
_STATE_ORDER = {state: i for i, state in enumerate(
    (State.RUNNING, State.VALIDATING, State.STOPPING, State.STARTING, State.QUEUED, State.FAILED,
     State.LOST,
     State.KILLED, State.STOPPED, State.FINISHED))}  # fmt: skip


def trainer_of(job: Job) -> str:
    """`nnuiTrainer` from `.../nnuiTrainer__nnuiPlans__3d_fullres/fold_0`."""
    return _trainer_of_folder(str(job.run_dir))


@lru_cache(maxsize=4096)  # every row is grouped and filtered every second; folders stay
def _trainer_of_folder(run_dir: str) -> str:
    return Path(run_dir).parent.name.split("__")[0] or "?"


def group_key(job: Job) -> tuple[str, str, str, str]:
    """Rows group by their run's identity: results tree, dataset, configuration, trainer
    (rows of two trees never interleave)."""
    return (results_tree(str(job.run_dir or "")), job.dataset, job.configuration, trainer_of(job))


def _fold_order(fold: str) -> tuple[int, str]:
    return (int(fold), "") if fold.isdigit() else (1 << 30, fold)


def _row_rank(view: JobView) -> tuple[bool, bool, float]:
    """Which job of a folder its row shows: an active one, then one whose own run wrote
    events (a record that only points at a live process, e.g. edited by hand, never hides
    the run really training there), then the newest."""
    own_events = getattr(view, "last_event_t", None) is not None
    return (view.state in ACTIVE_STATES, own_events, view.job.created_at)


def one_row_per_run_folder(
    views: Sequence[JobView],
) -> tuple[list[JobView], dict[str, list[str]]]:
    """(rows, {row job id: ids of the earlier jobs of its folder, oldest first}).
    Watch-only runs are never folded into nnui's jobs."""
    folders: dict[tuple[bool, str], list[JobView]] = {}
    for view in views:
        # No folder known (a pending SLURM job, a run not yet writing): a row of its own.
        key = (bool(getattr(view, "watch_only", False)), str(view.job.run_dir or view.job.job_id))
        folders.setdefault(key, []).append(view)
    rows: list[JobView] = []
    earlier: dict[str, list[str]] = {}
    for members in folders.values():
        members.sort(key=lambda v: (v.job.created_at, v.job.job_id))
        row = max(members, key=_row_rank)
        rows.append(row)
        earlier[row.job.job_id] = [v.job.job_id for v in members if v is not row]
    return rows, earlier


def row_text(view: JobView) -> str:
    """What the filter searches: ids, names, fold, state, GPUs, engine."""
    job = view.job
    parts = [job.job_id, job.dataset, job.configuration, f"fold {job.fold}", f"f{job.fold}",
             trainer_of(job), str(view.state), ",".join(job.gpus) or "cpu",
             getattr(job, "engine", "nnui")]  # fmt: skip
    if getattr(view, "watch_only", False):
        parts.append("watch-only")
    return " ".join(parts).lower()


def matches(view: JobView, text: str, earlier_ids: Sequence[str] = ()) -> bool:
    """Every word typed is in the row's text (`earlier_ids`: the ids of the earlier jobs of
    its run folder, so a filter set on a job id keeps the fold after a resume)."""
    haystack = " ".join([row_text(view), *earlier_ids]).lower()
    return all(word in haystack for word in text.lower().split())


def _missing_last(value: float | None, descending: bool) -> tuple[int, float]:
    if value is None or not math.isfinite(value):
        return (1, 0.0)
    return (0, -value if descending else value)


_SORT_KEYS: dict[str, Callable[[Any], Any]] = {
    "fold": lambda v: (_fold_order(v.job.fold), v.job.created_at),
    "newest": lambda v: -v.job.created_at,
    "state": lambda v: (_STATE_ORDER.get(v.state, 99), _fold_order(v.job.fold)),
    "Dice": lambda v: (_missing_last(v.ema_dice, True), _fold_order(v.job.fold)),
    "ETA": lambda v: (_missing_last(v.eta_s, False), _fold_order(v.job.fold)),
}


def arrange(
    views: Sequence[JobView], text: str = "", sort: str = SORTS[0], collapse: bool = True
) -> list[JobView]:
    """The dashboard's rows: one per run folder (every job with collapse=False), filtered,
    grouped, sorted in each group."""
    if sort not in _SORT_KEYS:
        raise ValueError(f"unknown sort {sort!r}; one of {', '.join(SORTS)}")
    if collapse:
        rows, earlier = one_row_per_run_folder(views)
    else:
        rows, earlier = list(views), {}
    # A filter on a job id follows its fold: a resume's new job continues the row.
    if text.strip():
        rows = [v for v in rows if matches(v, text, earlier.get(v.job.job_id, ()))]
    by_sort = _SORT_KEYS[sort]
    return sorted(rows, key=lambda v: (group_key(v.job), by_sort(v)))


def next_sort(sort: str) -> str:
    return SORTS[(SORTS.index(sort) + 1) % len(SORTS)] if sort in SORTS else SORTS[0]
