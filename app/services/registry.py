"""Jobs on disk, per user: one JSON file per job, so a new `nnui` re-attaches after an SSH drop.

Layout: `$NNUI_STATE_DIR` (else `$XDG_STATE_HOME/nnui`, else `~/.local/state/nnui`) holds
`jobs/<job_id>.json` and a `lock` file. Whole files are replaced atomically (readers never
see half a job) and every read-modify-write holds `fcntl.flock` on the lock file, so two
nnui instances and the supervisors never lose each other's updates. A file that does not
parse is renamed `*.corrupt` and reported in `problems`; it never stops the app.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_DIR_ENV = "NNUI_STATE_DIR"


def default_state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or os.path.join("~", ".local", "state")
    return Path(base).expanduser() / "nnui"


@dataclass
class ProcessRecord:
    pid: int
    create_time: float  # wall clock, for display and wall-time checks (drifts with the clock)
    role: str  # "supervisor" | "trainer" (the top process it started) | "worker" (a rank)
    rank: int | None = None
    start_ticks: int | None = None  # the identity: /proc/PID/stat start time (None: old record)


@dataclass
class SignalRecord:
    t: float
    pid: int
    signal: str
    rank: int | None
    result: str  # "sent" | "refused: reason" | "failed: reason"


@dataclass
class Job:
    job_id: str
    created_at: float
    dataset: str
    configuration: str
    fold: str
    mode: str  # "single" | "spawn" | "torchrun"
    device: str  # "cuda" | "cpu"
    gpus: list[str]  # GPU indices as strings; [] for a real CPU job
    simulated: bool
    argv: list[str]
    env: dict[str, str]  # environment ADDITIONS only
    run_dir: str
    console_path: str
    processes: list[ProcessRecord] = field(default_factory=list)
    exit_code: int | None = None
    ended_at: float | None = None
    signals: list[SignalRecord] = field(default_factory=list)
    queued_stop: bool = False
    after: str | None = None  # job this one waits for (several folds on one GPU, in turn)
    trainer_args: list[str] = field(default_factory=list)
    continue_training: bool = False
    note: str | None = None  # e.g. "stopped before it started"

    def process(self, role: str) -> ProcessRecord | None:
        return next((p for p in self.processes if p.role == role), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["processes"] = [_record(ProcessRecord, p) for p in data.get("processes", [])]
        values["signals"] = [_record(SignalRecord, s) for s in data.get("signals", [])]
        return cls(**values)


def _record(cls: type, data: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def new_job_id(fold: str, when: float | None = None) -> str:
    """Short, sortable and readable: MMDD-HHMMSS-f<fold>-<3 hex>."""
    stamp = time.strftime("%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    return f"{stamp}-f{fold}-{secrets.token_hex(2)[:3]}"


class Registry:
    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.jobs_dir = self.state_dir / "jobs"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.state_dir / "lock"
        self.problems: list[str] = []

    # ---- locking and files ---------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        with open(self._lock_path, "a+") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _path(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or job_id.startswith("."):
            raise KeyError(job_id)
        return self.jobs_dir / f"{job_id}.json"

    def _write(self, job: Job) -> None:
        path = self._path(job.job_id)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as handle:
            json.dump(job.to_dict(), handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    def _read(self, path: Path) -> Job | None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        try:
            return Job.from_dict(json.loads(text))
        except (ValueError, TypeError, AttributeError, KeyError) as error:
            self._set_aside(path, error)
            return None

    def _set_aside(self, path: Path, error: Exception) -> None:
        target = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, target)
            message = f"corrupt job file {path.name} ({error}); moved to {target.name}"
        except OSError as move_error:
            message = f"corrupt job file {path.name} ({error}); could not move: {move_error}"
        log.warning(message)
        self.problems.append(message)

    # ---- public API ----------------------------------------------------------------------

    def add(self, job: Job) -> None:
        with self.locked():
            if self._path(job.job_id).exists():
                raise ValueError(f"job {job.job_id} already exists")
            self._write(job)

    def get(self, job_id: str) -> Job:
        job = self._read(self._path(job_id))
        if job is None:
            raise KeyError(job_id)
        return job

    def list(self) -> list[Job]:
        jobs = []
        for path in sorted(self.jobs_dir.glob("*.json")):
            job = self._read(path)
            if job is not None:
                jobs.append(job)
        jobs.sort(key=lambda j: (j.created_at, j.job_id))
        return jobs

    def modify(self, job_id: str, change: Callable[[Job], None]) -> Job:
        """Read, change in place and write back, all under the lock."""
        with self.locked():
            job = self.get(job_id)
            change(job)
            self._write(job)
            return job

    def update(self, job_id: str, **changes: Any) -> Job:
        def apply(job: Job) -> None:
            for key, value in changes.items():
                if not hasattr(job, key):
                    raise AttributeError(f"Job has no field {key!r}")
                setattr(job, key, value)

        return self.modify(job_id, apply)

    def add_process(self, job_id: str, record: ProcessRecord) -> Job:
        def apply(job: Job) -> None:
            if not any(p.pid == record.pid and p.role == record.role for p in job.processes):
                job.processes.append(record)

        return self.modify(job_id, apply)

    def record_signal(self, job_id: str, record: SignalRecord) -> None:
        self.modify(job_id, lambda job: job.signals.append(record))

    def resolve(self, text: str) -> Job:
        """A job by its id or a unique prefix/suffix of it (for the command line). KeyError."""
        try:
            return self.get(text)
        except KeyError:
            pass
        matches = [j for j in self.list() if j.job_id.startswith(text) or j.job_id.endswith(text)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise KeyError(f"no job {text!r}")
        raise KeyError(f"{text!r} matches several jobs: {', '.join(j.job_id for j in matches)}")
