"""Talking to SLURM about one of the user's jobs: its state and script, a graceful stop, a
kill, a resubmission, and nnui's record of the jobs it submitted (docs/multi-gpu.md#cluster-slurm).

- stop = `scancel --signal=USR1 --batch JOB` for nnui's own scripts (their batch shell
  relays USR1 to the workers: checkpoint, exit 0). A user's own script has no relay: a USR1
  to its batch shell would not reach the trainer, so it is refused (the caller says why).
- kill = `scancel JOB`.
- resume = `sbatch SCRIPT` again: nnui's scripts always pass `--c`.

Records: `STATE_DIR/slurm/JOB.json` for each job `nnui launch --slurm` (or a resume)
submitted: the script, the fold's run folder. A job SLURM has forgotten (MinJobAge) is
still resumable from it, and a stopped run folder finds the script it ran under.
Standard library only; every SLURM call has a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from app.services.jobs.registry import default_state_dir
from app.services.machine.procs import user_name
from app.services.slurm.requeue import stop_mark
from trainer.schema.atomic import atomic_write_text

SCRIPT_MARK = "# Written by nnui sbatch."  # the line every nnui job script carries
_TIMEOUT_S = 15
_FIELDS = re.compile(r"(\w+)=(\S*)")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")  # fmt: skip


class SlurmError(RuntimeError):
    """A SLURM client failed or is missing: one line saying which and why."""


def run(argv: list[str]) -> str:
    """stdout of a SLURM client; SlurmError with its message when it fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S,
                              check=False)  # fmt: skip
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found: is this a SLURM login node?") from None
    except (OSError, subprocess.SubprocessError) as problem:
        raise SlurmError(f"{argv[0]}: {problem}") from None
    if done.returncode != 0:
        why = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise SlurmError(f"{' '.join(argv[:2])}: {why[-1] if why else f'exit {done.returncode}'}")
    return done.stdout


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # PENDING, RUNNING, COMPLETED ... ("" when SLURM no longer knows the job)
    script: Path | None  # the submitted script (scontrol's Command=, else nnui's record)
    reason: str = ""
    nodes: str = ""


def job_info(job_id: str) -> JobInfo:
    """What SLURM (else nnui's record) knows of a job."""
    record = read_record(job_id)
    script = Path(record["script"]) if record else None
    try:
        text = run(["scontrol", "-o", "show", "job", job_id])
    except SlurmError:
        if record is None:
            raise
        return JobInfo(job_id, "", script)
    fields = dict(_FIELDS.findall(text))
    command = fields.get("Command", "")
    if command.startswith("/") and script is None:
        script = Path(command)
    nodes = fields.get("NodeList", "")
    return JobInfo(job_id, fields.get("JobState", ""), script, fields.get("Reason", ""),
                   "" if nodes == "(null)" else nodes)  # fmt: skip


def batch_script(job: JobInfo) -> str | None:
    """The job's batch script as SLURM keeps it (else the file it was submitted from)."""
    try:
        return run(["scontrol", "write", "batch_script", job.job_id, "-"])
    except SlurmError:
        pass
    try:
        return job.script.read_text() if job.script else None
    except OSError:
        return None


def is_nnui_script(text: str | None) -> bool:
    return text is not None and SCRIPT_MARK in text


def graceful_stop(job: JobInfo) -> None:
    """USR1 to the batch shell of nnui's script (its relay stops the workers gracefully);
    the stop mark first, so that a --requeue script knows it is a stop, not a time limit."""
    if job.script is not None:
        # A script folder not writable from here: a --requeue job would requeue, not stop.
        with contextlib.suppress(OSError):
            stop_mark(job.script, job.job_id).write_text(f"{time.time():.0f}\n")
    run(["scancel", "--signal=USR1", "--batch", job.job_id])


def cancel(job_id: str) -> None:
    run(["scancel", job_id])


def submit(script: Path, dependency: str | None = None) -> str:
    """`sbatch --parsable [--dependency=D] SCRIPT`; the new job id."""
    argv = ["sbatch", "--parsable"]
    if dependency:
        argv.append(f"--dependency={dependency}")
    out = run([*argv, str(script)]).strip()
    job_id = out.split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {out!r}, not a job id")
    return job_id


def active_job_of(script: Path) -> str | None:
    """The user's pending or running job submitted from `script`, if any (squeue %o)."""
    try:
        out = run(["squeue", "-h", "-u", user_name(os.getuid()), "-o", "%i|%o"])
    except SlurmError:
        return None
    want = os.path.realpath(script)
    for line in out.splitlines():
        job_id, _, command = line.partition("|")
        if command.strip() and os.path.realpath(command.strip()) == want:
            return job_id.strip()
    return None


# ---- nnui's records of the jobs it submitted ------------------------------------------------


def _records_dir() -> Path:
    return default_state_dir() / "slurm"


def write_record(job_id: str, script: Path, run_folder: Path | None, fold: str) -> None:
    folder = _records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    body = {"job_id": job_id, "script": str(script), "fold": fold, "submitted_t": time.time(),
            "run_folder": str(run_folder) if run_folder else None}  # fmt: skip
    atomic_write_text(folder / f"{job_id}.json", json.dumps(body) + "\n")


def read_record(job_id: str) -> dict | None:
    if not job_id.isdigit():
        return None
    try:
        body = json.loads((_records_dir() / f"{job_id}.json").read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and isinstance(body.get("script"), str) else None


def record_for_folder(run_folder: str) -> dict | None:
    """The newest record of a job that trained in `run_folder`, None if nnui submitted none."""
    want = os.path.realpath(run_folder)
    newest: dict | None = None
    try:
        paths = list(_records_dir().glob("*.json"))
    except OSError:
        return None
    for path in paths:
        body = read_record(path.stem)
        folder = body.get("run_folder") if body else None
        if body is None or not isinstance(folder, str) or os.path.realpath(folder) != want:
            continue
        if newest is None or float(body.get("submitted_t") or 0) > float(
            newest.get("submitted_t") or 0
        ):
            newest = body
    return newest
