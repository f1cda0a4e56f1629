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
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.services.jobs.discovery import launched_args, parse_args, trainer_index
from app.services.machine.procs import user_name
from app.services.nnunet.runs import TrainArgs

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


def script_args(script: str) -> TrainArgs | None:
    """The trainer arguments of the first command line of a batch script that runs it."""
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
        out = self._run(["squeue", "-h", "-u", user_name(os.getuid()), "-o", "%i|%T|%j|%r|%N"])
        self._ok = out is not None
        if not out:
            return []
        found = []
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) != 5 or not parts[0].strip():
                continue
            job_id, state, name, reason, node = (p.strip() for p in parts)
            args = self._args(job_id)
            if args is not None:
                found.append(SlurmJob(job_id, state, name, reason, node, args))
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
