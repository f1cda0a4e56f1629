"""One owner per fold folder (docs/training.md): the trainer that writes a fold holds a lock on it.

The lock is `flock(LOCK_EX)` on `<fold>/owner.lock`, taken by the process that writes the
folder (the single process, the `-num_gpus` parent, global rank 0 under a launcher) before it
writes anything, and held for its whole life. The kernel drops it when that process dies,
however it dies, so a crash or `kill -9` never leaves a stale lock to clean up. The file also
says who holds it (pid, uid, host, how it was started, argv), for the refusal line of a second
trainer and for the app, which reads it (never locks it) to find runs it did not start.

Data-loading workers are forked and would inherit the open lock (a flock belongs to the open
file, shared across fork): they close their copy at fork, so only the owner keeps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.schema.tree import JOB_ID_ENV, OWNER_LOCK_FILE

_held: list[int] = []  # the fd(s) this process holds; closed again in forked children
_created: list[Path] = []  # lock files this process made (removed again by discard_created)


class FoldBusy(RuntimeError):
    """Another live process owns the fold folder (message is one line)."""


@dataclass(frozen=True)
class Owner:
    """What `owner.lock` says about the process holding it."""

    pid: int
    uid: int
    host: str
    launcher: str
    argv: list[str]
    started_at: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Owner | None:
        try:
            return cls(
                pid=int(data["pid"]),
                uid=int(data["uid"]),
                host=str(data["host"]),
                launcher=str(data["launcher"]),
                argv=[str(a) for a in data["argv"]],
                started_at=float(data["started_at"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


def how_started(env: dict[str, str] | os._Environ[str] = os.environ, num_gpus: int | None = None
                ) -> str:  # fmt: skip
    """A few words for `launcher`: who started this trainer."""
    if env.get(JOB_ID_ENV):
        return f"nnui job {env[JOB_ID_ENV]}"
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_JOB_ID"):
        return f"SLURM job {env['SLURM_JOB_ID']}"
    if num_gpus:
        return f"by hand, -num_gpus {num_gpus}"
    return "by hand"


def read_owner(fold_dir: Path) -> Owner | None:
    """The recorded owner (it may have ended since: only the lock itself says it is alive)."""
    try:
        data = json.loads((Path(fold_dir) / OWNER_LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Owner.from_dict(data) if isinstance(data, dict) else None


def is_locked(fold_dir: Path) -> bool:
    """True while some process holds the fold's lock (tests and tools; the app uses /proc)."""
    try:
        fd = os.open(Path(fold_dir) / OWNER_LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _busy_message(fold_dir: Path, owner: Owner | None) -> str:
    if owner is None:
        return f"{fold_dir} is in use by another trainer; wait for it to end or stop it"
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(owner.started_at))
    return (
        f"{fold_dir} is in use by pid {owner.pid} on {owner.host} (started {owner.launcher}, "
        f"since {since}); wait for it to end or stop it (nnui stop)"
    )


def acquire(fold_dir: Path, argv: list[str], num_gpus: int | None = None) -> None:
    """Own `fold_dir` for the rest of this process's life, or raise FoldBusy at once."""
    path = Path(fold_dir) / OWNER_LOCK_FILE
    existed = path.exists()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FoldBusy(_busy_message(Path(fold_dir), read_owner(fold_dir))) from None
    record = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "host": socket.gethostname(),
        "launcher": how_started(num_gpus=num_gpus),
        "argv": list(argv),
        "started_at": time.time(),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    _held.append(fd)
    if not existed:
        _created.append(path)


def discard_created() -> None:
    """A run refused before it wrote anything: remove the lock file it made (while still
    holding it), so that its new fold folder is left empty and can go too."""
    while _created:
        with contextlib.suppress(OSError):
            _created.pop().unlink()


def release() -> None:
    """Close this process's reference to the lock: the owner gives it up (in-process callers
    such as tests; exiting does it too), a forked child just drops its inherited copy. Never
    flock(LOCK_UN): in a child that would unlock the owner as well."""
    while _held:
        with contextlib.suppress(OSError):
            os.close(_held.pop())
    _created.clear()


os.register_at_fork(after_in_child=release)
