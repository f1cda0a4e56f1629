"""Jobs on disk, per user: one JSON file per job, so a new `nnui` re-attaches after an SSH drop.

Layout: `$NNUI_STATE_DIR` (else `$XDG_STATE_HOME/nnui`, else `~/.local/state/nnui`) holds
`jobs/<job_id>.json` and a `lock` file. Whole files are replaced atomically (readers never
see half a job) and every read-modify-write holds `fcntl.flock` on the lock file, so two
nnui instances and the supervisors never lose each other's updates. A file that does not
parse, is not UTF-8 or holds a field of the wrong type (a pid "x", 0 or -1, gpus 3, ...) is
set aside: skipped and reported in `problems` (named, with the reason), left as it is on
disk (looking never changes anything: `nnui status` and the TUI only read); it never stops
the app and never reaches the code that signals processes. A state directory that cannot be
used (a file in its place, no permission) raises `StateDirError` with a one-line reason.
"""

from __future__ import annotations

import builtins
import copy
import fcntl
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from app.services.machine.procs import PID_MAX, valid_pid
from trainer.schema.atomic import atomic_write_text

log = logging.getLogger(__name__)

STATE_DIR_ENV = "NNUI_STATE_DIR"
MAX_JOB_FILE_BYTES = 16 * 1024 * 1024  # a real job file is a few KiB
TRAIN, PREDICT = "train", "predict"  # Job.kind
JOB_KINDS = (TRAIN, PREDICT)


class StateDirError(OSError):
    """The state directory cannot be used; the message is one line for the user."""


class RecordError(ValueError):
    """A job file whose content is not a valid job (names the field and the value)."""


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
    killed_at: float | None = None  # `nnui kill` began (the job ends "killed", not "lost")
    engine: str = "nnui"  # "nnui" | "nnunet" (the real nnU-Net through nnui's extension)
    # Added with predictions (older readers ignore them; older files read as trainings):
    kind: str = "train"  # "train" | "predict" (nnui-predict; `fold` then lists its folds)
    part_id: int | None = None  # a prediction's part of num_parts (-part_id/-num_parts)
    num_parts: int | None = None
    output_dir: str | None = None  # a prediction's -o folder
    # The scheduler (waiting.py, retries.py, hooks.py); additive: older files lack them.
    when_free: bool = False  # the supervisor waits for free GPUs of gpu_pool, then claims
    gpu_pool: list[str] = field(default_factory=list)  # GPUs it may take (when_free)
    min_free_gib: float | None = None
    max_util_percent: int | None = None
    share: bool = False
    priority: int = 0  # higher first; FIFO (created_at) within a priority, per user
    waiting_reason: str | None = None  # e.g. "GPU 2: 37 GiB used by user bob (pid 4411)"
    retries: int = 0  # restarts with --c allowed after an abnormal end
    restarts: list[str] = field(default_factory=list)  # the reason of each, e.g. "exit 137"
    on_event: list[str] = field(default_factory=list)  # hook argv (never a shell string)
    # The stall watchdog (stall.py, stall_watch.py): the supervisor flags and acts.
    stall_action: str = "none"  # none | stop | kill (`--stall-action`)
    stall_min_s: float | None = None  # the rule's floor (`--stall-min-s`; None: default)
    stalled_at: float | None = None  # flagged stalled (cleared when it progresses again)
    stall_reason: str | None = None  # e.g. "no event for 950 s (allowed 300 s), no CPU ..."
    stall_acted_at: float | None = None  # the watchdog's first stop or kill of this attempt
    forgotten_at: float | None = None  # `nnui forget`: hidden from lists; results untouched
    # A cascade fold (--after-lowres): the supervisor waits for the previous stage's
    # segmentations of its cases (stage_inputs.py) before it starts the trainer.
    after_previous_stage: bool = False

    def process(self, role: str) -> ProcessRecord | None:
        return next((p for p in self.processes if p.role == role), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Job:
        """A job from its JSON object, every field checked (RecordError names the bad one)."""
        if not isinstance(data, dict):
            raise RecordError(f"not a JSON object: {_short(data)}")
        values = {k: v for k, v in data.items() if k in _CHECKS[cls]}
        _check_fields(cls, values, "")
        values["processes"] = [
            _record(ProcessRecord, p, f"processes[{i}]")
            for i, p in enumerate(values.get("processes", []))
        ]
        values["signals"] = [
            _record(SignalRecord, s, f"signals[{i}]")
            for i, s in enumerate(values.get("signals", []))
        ]
        return cls(**values)


def _record(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise RecordError(f"{where}: not a JSON object: {_short(data)}")
    values = {k: v for k, v in data.items() if k in _CHECKS[cls]}
    _check_fields(cls, values, where)
    return cls(**values)


# ---- field checks: every value a job file can hold, with its type and range -------------

_INT_LIMIT = 2**63  # larger integers are garbage (and overflow float conversions)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any, low: int = -_INT_LIMIT, high: int = _INT_LIMIT) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_time(value: Any) -> bool:
    """A finite number of seconds (json reads 1e400 as inf, NaN as nan)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value, -(2**53), 2**53)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_str_dict(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_job_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and bool(value)
        and "/" not in value
        and "\0" not in value
        and (not value.startswith("."))
    )


_STR = (lambda v: isinstance(v, str), "a string")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_TIME = (_is_time, "a finite number")
_STR_LIST = (_is_str_list, "a list of strings")
_CHECKS: dict[type, dict[str, tuple[Callable[[Any], bool], str]]] = {
    ProcessRecord: {
        "pid": (valid_pid, f"a pid (1..{PID_MAX})"),
        "create_time": _TIME,
        "role": _STR,
        "rank": (_optional(lambda v: _is_int(v, 0, 2**20)), "a rank >= 0 or null"),
        "start_ticks": (_optional(lambda v: _is_int(v, 0)), "clock ticks >= 0 or null"),
    },
    SignalRecord: {
        "t": _TIME,
        # 0 marks a refusal that reached no process (see signals.send_stop); never signalled.
        "pid": (lambda v: v == 0 or valid_pid(v), f"0 or a pid (1..{PID_MAX})"),
        "signal": _STR,
        "rank": (_optional(lambda v: _is_int(v, 0, 2**20)), "a rank >= 0 or null"),
        "result": _STR,
    },
    Job: {
        "job_id": (_is_job_id, "a job id"),
        "created_at": _TIME,
        **{name: _STR for name in ("dataset", "configuration", "fold", "mode", "device")},
        "gpus": _STR_LIST,
        "simulated": _BOOL,
        "argv": _STR_LIST,
        "env": (_is_str_dict, "an object of strings"),
        "run_dir": _STR,
        "console_path": _STR,
        "processes": (lambda v: isinstance(v, list), "a list"),
        "exit_code": (_optional(lambda v: _is_int(v, -(2**31), 2**31)), "an exit code or null"),
        "ended_at": (_optional(_is_time), "a finite number or null"),
        "signals": (lambda v: isinstance(v, list), "a list"),
        "queued_stop": _BOOL,
        "after": (_optional(_is_job_id), "a job id or null"),
        "trainer_args": _STR_LIST,
        "continue_training": _BOOL,
        "note": (_optional(lambda v: isinstance(v, str)), "a string or null"),
        "killed_at": (_optional(_is_time), "a finite number or null"),
        "engine": (lambda v: v in ("nnui", "nnunet"), "nnui or nnunet"),
        "kind": (lambda v: v in JOB_KINDS, " or ".join(JOB_KINDS)),
        "part_id": (_optional(lambda v: _is_int(v, 0, 2**20)), "a part >= 0 or null"),
        "num_parts": (_optional(lambda v: _is_int(v, 1, 2**20)), "a count >= 1 or null"),
        "output_dir": (_optional(lambda v: isinstance(v, str)), "a string or null"),
        "when_free": _BOOL,
        "gpu_pool": _STR_LIST,
        "min_free_gib": (_optional(lambda v: _is_time(v) and v >= 0), "GiB >= 0 or null"),
        "max_util_percent": (_optional(lambda v: _is_int(v, 0, 100)), "0..100 or null"),
        "share": _BOOL,
        "priority": (lambda v: _is_int(v, -(2**20), 2**20), "an integer priority"),
        "waiting_reason": (_optional(lambda v: isinstance(v, str)), "a string or null"),
        "retries": (lambda v: _is_int(v, 0, 1000), "0..1000 restarts"),
        "restarts": _STR_LIST,
        "on_event": _STR_LIST,
        "stall_action": (lambda v: v in ("none", "stop", "kill"), "none, stop or kill"),
        "stall_min_s": (_optional(lambda v: _is_time(v) and v > 0), "seconds > 0 or null"),
        "stalled_at": (_optional(_is_time), "a finite number or null"),
        "stall_reason": (_optional(lambda v: isinstance(v, str)), "a string or null"),
        "stall_acted_at": (_optional(_is_time), "a finite number or null"),
        "forgotten_at": (_optional(_is_time), "a finite number or null"),
        "after_previous_stage": _BOOL,
    },
}


def _check_fields(cls: type, values: dict[str, Any], where: str) -> None:
    """RecordError naming the first field of the wrong type; missing required ones too."""
    checks = _CHECKS[cls]
    for name, (check, expected) in checks.items():
        if name in values and not check(values[name]):
            label = f"{where}.{name}" if where else name
            raise RecordError(f"{label}: expected {expected}, got {_short(values[name])}")
    missing = [f.name for f in fields(cls) if f.name not in values and _required(f)]
    if missing:
        raise RecordError(f"{where + ': ' if where else ''}missing {', '.join(missing)}")


def _required(item: Any) -> bool:
    return item.default is MISSING and item.default_factory is MISSING


def new_job_id(fold: str, when: float | None = None, tag: str = "f") -> str:
    """Short, sortable and readable: MMDD-HHMMSS-f<fold>-<3 hex> (a prediction's part:
    tag "p", e.g. MMDD-HHMMSS-p0-<3 hex>)."""
    stamp = time.strftime("%m%d-%H%M%S", time.localtime(time.time() if when is None else when))
    return f"{stamp}-{tag}{fold}-{secrets.token_hex(2)[:3]}"


def check_state_dir(state_dir: Path) -> None:
    """Create the state directory if needed; StateDirError (one line) if it cannot be used."""
    hint = f"set {STATE_DIR_ENV} to a writable directory"
    jobs_dir, lock_path = state_dir / "jobs", state_dir / "lock"
    try:
        jobs_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a"):
            pass
    except OSError as error:
        where = Path(error.filename) if error.filename else state_dir
        raise StateDirError(
            f"cannot use the nnui state directory {state_dir} ({where}: "
            f"{error.strerror or error}); {hint}"
        ) from None
    if not os.access(jobs_dir, os.W_OK | os.X_OK):
        raise StateDirError(f"the nnui state directory {jobs_dir} is not writable; {hint}")


class Registry:
    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.jobs_dir = self.state_dir / "jobs"
        self._lock_path = self.state_dir / "lock"
        check_state_dir(self.state_dir)
        self.problems: list[str] = []
        # The problems of the newest list() alone: a file fixed or moved away drops out
        # (a long-lived reader such as the TUI shows these, not every one ever seen).
        self.list_problems: list[str] = []
        self._listed: dict[Path, tuple[tuple[int, int, int], Job]] = {}  # list()'s cache
        self._paths: dict[str, Path] = {}  # _job_files()
        # list(copies=False)'s last answer: (jobs folder's inode and mtime, when, jobs).
        self._board_list: tuple[tuple[int, int], float, list[Job]] | None = None

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
        # Never write what a reader would set aside (RecordError names the bad field).
        Job.from_dict(job.to_dict())
        atomic_write_text(self._path(job.job_id), json.dumps(job.to_dict(), indent=1))
        self._board_list = None  # this very tick's write may not move the folder's mtime

    def _read(self, path: Path) -> Job | None:
        try:
            with open(path, "rb") as handle:
                data = handle.read(MAX_JOB_FILE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as error:  # a folder named *.json, no permission: report, keep
            self._report(f"cannot read job file {path.name} ({error.strerror or error})")
            return None
        try:
            if len(data) > MAX_JOB_FILE_BYTES:
                raise RecordError(f"larger than {MAX_JOB_FILE_BYTES} bytes")
            job = Job.from_dict(json.loads(data.decode("utf-8")))
            if job.job_id != path.stem:
                raise RecordError(f"it names job {_short(job.job_id)}, not {path.stem}")
            return job
        # UnicodeDecodeError and JSONDecodeError are ValueErrors; deep nesting: RecursionError.
        except (ValueError, TypeError, RecursionError) as error:
            self._set_aside(path, error)
            return None

    def _job_files(self) -> list[Path]:
        """The *.json files of the jobs folder, sorted (os.scandir: Path.glob cost as much
        as reading the files it found, every second on the board)."""
        try:
            with os.scandir(self.jobs_dir) as entries:
                names = [e.name for e in entries if e.name.endswith(".json")]
        except FileNotFoundError:
            return []
        # One Path per name for the registry's life: building 400 Paths each second cost
        # more than the stat() calls (a lab's history on the board).
        paths = self._paths
        return [paths.get(n) or paths.setdefault(n, self.jobs_dir / n)
                for n in sorted(names) if not n.startswith(".")]  # fmt: skip

    def _read_listed(
        self, path: Path, seen: dict[Path, tuple[tuple[int, int, int], Job]], copies: bool
    ) -> Job | None:
        """_read, skipping the read and parse of a file unchanged since the previous list():
        the board lists every second and job files change a few times a run. Every write is
        a rename onto the path (a new inode), so (inode, size, mtime) tells a change; each
        call hands out a deep copy of the cached Job (callers may change theirs), or with
        `copies=False` the cached Job itself."""
        try:
            info = path.stat()
        except OSError:
            return self._read(path)  # gone or unreadable: _read says which
        key = (info.st_ino, info.st_size, info.st_mtime_ns)
        cached = self._listed.get(path)
        if cached is not None and cached[0] == key:
            seen[path] = cached
            return copy.deepcopy(cached[1]) if copies else cached[1]
        job = self._read(path)
        if job is not None:
            seen[path] = (key, copy.deepcopy(job) if copies else job)
        return job

    def _set_aside(self, path: Path, error: Exception) -> None:
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        self._report(
            f"corrupt job file {path.name} ({reason}); skipped and left as it is: move it away "
            f"or delete it ({path.parent})"
        )

    def _report(self, message: str) -> None:
        if message not in self.list_problems:
            self.list_problems.append(message)
        if message not in self.problems:
            log.info(message)  # the user sees `problems` (nnui prints them once, as warnings)
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

    # How long list(copies=False) trusts an unchanged jobs folder. Every write of a job file
    # is a new file renamed onto its name, which changes the folder's mtime; the mtime is
    # coarse (a kernel tick), so two writes in one tick can look like one, and a file edited
    # in place (by hand) leaves the folder as it was: both are seen at the next full look.
    FOLDER_TRUST_S = 5.0

    def list(self, copies: bool = True) -> list[Job]:
        """Every readable job, oldest first. `copies=False` (the board's reader, which never
        changes a Job): a job whose file did not change is the very object the previous
        list() returned, so `is` tells "unchanged" and no deep copy is made each second; and
        while the jobs folder is unchanged (FOLDER_TRUST_S at most) the files are not
        looked at one by one (a stat per job per second was half the idle board's work)."""
        if not copies:
            try:
                info = os.stat(self.jobs_dir)
                folder = (info.st_ino, info.st_mtime_ns)
            except OSError:
                folder = (0, 0)
            now = time.monotonic()
            held = self._board_list
            if held is not None and held[0] == folder and now - held[1] < self.FOLDER_TRUST_S:
                return list(held[2])
            jobs = self._list(copies)
            self._board_list = (folder, now, jobs)
            return list(jobs)
        return self._list(copies)

    def _list(self, copies: bool) -> builtins.list[Job]:
        jobs = []
        self.list_problems = []
        seen: dict[Path, tuple[tuple[int, int, int], Job]] = {}
        for path in self._job_files():
            job = self._read_listed(path, seen, copies)
            if job is not None:
                jobs.append(job)
        self._listed = seen
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
