"""The user's own SLURM jobs that run nnui-train, with their SLURM state (PENDING too).

`squeue` lists the user's jobs; a job is a training when its batch script (`scontrol write
batch_script JOB -`, read once per job) runs the trainer: `nnui-train ...` or `-m trainer`
(an `nnui sbatch` script or the user's own). A running job whose processes are on this
machine is also an adopted run (discovery.py): the board shows that run with the SLURM
state; the others (pending, or running on another node) are rows of their own. Nothing
here signals: a stop of a pending job cancels it (`scancel JOB`: nothing was trained),
a running one is stopped through its step's workers (signals/send.py).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from app.services.jobs.discovery import launched_args, parse_args, trainer_index
from app.services.machine.procs import user_name
from app.services.nnunet.runs import TrainArgs
from trainer.schema.status import State

SLURM_ID_PREFIX = "slurm:"
_TIMEOUT_S = 5
POLL_INTERVAL_S = 5.0
SLOW_S = 2.0
BACKOFF_S = 60.0
Runner = Callable[[list[str]], str | None]


def _run(argv: list[str]) -> str | None:
    """stdout of a SLURM client, None when it is missing or fails (no cluster here)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S,
                              check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    state: str  # PENDING | RUNNING | COMPLETING | ...
    name: str
    reason: str  # squeue's %r: why it is pending (Priority, Resources, BeginTime ...)
    node: str
    args: TrainArgs  # the trainer's arguments in its script
    comment: str = ""  # squeue's %k: `nnui-restarts=N` on a --requeue continuation


def script_args(script: str) -> TrainArgs | None:
    """The trainer arguments of the first command line of a batch script that runs it (the
    results root an nnui script exports stands for a --results it does not pass)."""
    found = _command_args(script)
    exported = _EXPORTED_RESULTS.search(script)
    if found is not None and found.results is None and exported:
        return replace(found, results=shlex.split(exported.group(1))[0])
    return found


_EXPORTED_RESULTS = re.compile(r"^export nnUNet_results=(.+)$", re.MULTILINE)


def _command_args(script: str) -> TrainArgs | None:
    for raw in script.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for start in range(len(words)):
            index = trainer_index(words[start:])
            if index is not None:
                found = parse_args(words[start + index + 1 :])
                if found is not None:
                    return found
        found = launched_args(words)
        if found is not None:
            return found
    return None


class SlurmWatcher:
    """The user's SLURM trainings; each job's script is read once."""

    def __init__(self, run: Runner = _run, interval_s: float = POLL_INTERVAL_S) -> None:
        self._run = run
        self._scripts: dict[str, TrainArgs | None] = {}
        self.interval_s = interval_s
        self._last: tuple[float, list[SlurmJob]] | None = None  # (next poll, jobs)
        self._ok = True

    def jobs(self) -> list[SlurmJob]:
        """The user's SLURM trainings; squeue is asked at most every `interval_s` (each
        call is a request to slurmctld, which a login node shares with everyone)."""
        now = time.monotonic()
        if self._last is not None and now < self._last[0]:
            return self._last[1]
        found = self._read()
        took = time.monotonic() - now
        # A controller that does not answer (or answers slowly) is asked again much later:
        # each call would hold the board's jobs reading for up to the timeout.
        wait = self.interval_s if self._ok and took < SLOW_S else BACKOFF_S
        self._last = (time.monotonic() + wait, found)
        return found

    def _read(self) -> list[SlurmJob]:
        out = self._run(["squeue", "-h", "-u", user_name(os.getuid()), "-o", "%i|%T|%j|%r|%N|%k"])
        self._ok = out is not None
        if not out:
            return []
        found = []
        for line in out.splitlines():
            parts = line.split("|", 5)
            if len(parts) < 5 or not parts[0].strip():
                continue
            job_id, state, name, reason, node = (p.strip() for p in parts[:5])
            args = self._args(job_id)
            if args is not None:
                comment = parts[5].strip() if len(parts) > 5 else ""
                found.append(SlurmJob(job_id, state, name, reason, node, args, comment))
        return found

    def _args(self, job_id: str) -> TrainArgs | None:
        if job_id not in self._scripts:
            script = self._run(["scontrol", "write", "batch_script", job_id, "-"])
            self._scripts[job_id] = script_args(script) if script else None
        return self._scripts[job_id]


def cancel_pending(job_id: str) -> str:
    """`scancel JOB` for a job that has not started (nothing trained, nothing lost)."""
    try:
        done = subprocess.run(["scancel", job_id], capture_output=True, text=True,
                              timeout=_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        return f"failed: scancel: {error}"
    return "sent" if done.returncode == 0 else f"failed: scancel: {done.stderr.strip()}"


# ---- a SLURM job on the row of its run ------------------------------------------------------

RESTARTS_PREFIX = "nnui-restarts="  # the comment of a --requeue continuation (slurm/requeue.py)
_RESTARTS = re.compile(rf"{RESTARTS_PREFIX}(\d+)")


def restarts_of(comment: str) -> int:
    """N of the comment `nnui-restarts=N` (squeue %k), 0 for any other comment."""
    found = _RESTARTS.search(comment or "")
    return int(found.group(1)) if found else 0


def trains_in(args: TrainArgs, run_dir: str) -> bool:
    """Whether a job's trainer arguments name this run folder (results/D/T__P__C/fold_F)."""
    if not run_dir:
        return False
    folder = Path(run_dir)
    if folder.name != f"fold_{args.fold}" or len(folder.parents) < 3:
        return False
    trainer = folder.parent.name.split("__")[0]
    if folder.parent.name.partition("__")[2] != f"{args.plans}__{args.configuration}" or (
        trainer not in (args.trainer, args.trainer.removesuffix("_nnui"))
    ):
        return False
    dataset = folder.parents[1].name
    number = dataset.removeprefix("Dataset").split("_", 1)[0]
    if args.dataset != dataset and not (
        args.dataset.isdigit() and number.isdigit() and int(args.dataset) == int(number)
    ):
        return False
    return args.results is None or os.path.realpath(args.results) == os.path.realpath(
        folder.parents[2]
    )


def with_job(view: Any, entry: SlurmJob, remote: bool) -> Any:
    """The run's row with its SLURM job: state and restarts; a run on another node (found by
    its folder) also takes the job's id (`slurm:JOB`, what stop/kill/resume take)."""
    job, restarts = view.job, restarts_of(entry.comment)
    if restarts:
        job = replace(job, restarts=["requeued at the time limit"] * restarts, retries=restarts)
    if not remote:
        return replace(view, job=job, slurm_state=entry.state)
    where = f" on {entry.node}" if entry.node else ""
    job = replace(
        job, job_id=f"{SLURM_ID_PREFIX}{entry.job_id}", ended_at=None,
        env={**job.env, "SLURM_JOB_ID": entry.job_id},
        waiting_reason=f"SLURM {entry.state} ({entry.reason}){where}",
        note=f"SLURM job {entry.job_id} ({entry.name}){where}",
    )  # fmt: skip
    state, eta = view.state, None
    if entry.state == "PENDING":
        state = State.QUEUED
    elif view.state == State.LOST:  # no ending event and no process here: it runs there
        state = State.RUNNING if view.epoch else State.STARTING
        if view.num_epochs and view.epoch is not None and view.mean_epoch_time_s:
            eta = max(0.0, (view.num_epochs - view.epoch) * view.mean_epoch_time_s)
    return replace(view, job=job, state=state, eta_s=eta if eta is not None else view.eta_s,
                   slurm_state=entry.state)  # fmt: skip
