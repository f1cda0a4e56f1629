"""Machine-wide GPU claims: no two nnui jobs of any user on this machine take one GPU at once.

A claim is an flock on `<claims dir>/gpu-<index>.lock`, held by the waiting job's own
supervisor on an open descriptor: the kernel drops it when that process dies, however it
dies, so a claim can never outlive its job (no stale claim to clean up, no pid check). The
directory is shared by every user (mode 1777, like /tmp); a lock file another user created is
opened read-only, which is enough for flock. Next to it the holder leaves a small note
(`gpu-<index>.<uid>.json`: job, user, pid) so that others can say who holds the GPU; the note
is only read while the lock is really held, so a leftover note means nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import socket
from dataclasses import asdict
from pathlib import Path

from app.services.machine.procs import proc_info
from app.services.supervisor.free_rule import Holder
from trainer.schema.atomic import atomic_write_text

CLAIMS_DIR_ENV = "NNUI_GPU_CLAIMS_DIR"  # tests: a private directory instead of /tmp's


def claims_dir() -> Path:
    explicit = os.environ.get(CLAIMS_DIR_ENV)
    if explicit:
        return Path(explicit)
    return Path("/tmp") / f"nnui-gpu-claims-{socket.gethostname()}"


def _ensure_dir(folder: Path) -> None:
    if folder.is_dir():
        return
    with contextlib.suppress(FileExistsError):
        folder.mkdir(parents=True)
        os.chmod(folder, 0o1777)  # every user claims here; the sticky bit keeps files theirs


def _open_lock(folder: Path, gpu: str) -> int:
    path = folder / f"gpu-{gpu}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o644)  # readable by the others whatever the umask
        return fd
    except PermissionError:  # another user's lock file
        return os.open(path, os.O_RDONLY)


class GpuClaims:
    """The claims one process holds (a supervisor holds those of its job)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder or claims_dir()
        self.held: dict[str, int] = {}  # gpu -> open descriptor with the lock

    def try_claim(self, gpus: tuple[str, ...], job_id: str) -> bool:
        """All of `gpus` or none (a DDP group claims its GPUs together)."""
        _ensure_dir(self.folder)
        got: dict[str, int] = {}
        for gpu in sorted(gpus, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g)):
            fd = _open_lock(self.folder, gpu)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                for other in got.values():
                    os.close(other)
                return False
            got[gpu] = fd
        self.held.update(got)
        for gpu in got:
            self._write_note(gpu, job_id)
        return True

    def release(self) -> None:
        for gpu, fd in list(self.held.items()):
            with contextlib.suppress(OSError):
                self._note_path(gpu).unlink()
            os.close(fd)
        self.held.clear()

    def _note_path(self, gpu: str) -> Path:
        return self.folder / f"gpu-{gpu}.{os.getuid()}.json"

    def _write_note(self, gpu: str, job_id: str) -> None:
        note = Holder(job_id=job_id, user=_user_name(), pid=os.getpid())
        # The note is for display only (the lock is the claim): a failed write is let go.
        with contextlib.suppress(OSError):
            atomic_write_text(self._note_path(gpu), json.dumps(asdict(note)), mode=0o644)


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name  # the uid's, whatever $USER says
    except KeyError:
        return str(os.getuid())


def live_holders(
    gpus: list[str], folder: Path | None = None, mine: GpuClaims | None = None
) -> dict[str, Holder]:
    """{gpu: holder} for the GPUs whose lock someone else holds now (a probe: a lock that is
    free is taken and dropped at once). Ours (`mine`) are left out."""
    folder = folder or claims_dir()
    holders: dict[str, Holder] = {}
    for gpu in gpus:
        if mine is not None and gpu in mine.held:
            continue
        path = folder / f"gpu-{gpu}.lock"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # no lock file: never claimed
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            holders[gpu] = _read_note(folder, gpu)
        finally:
            os.close(fd)
    return holders


def _read_note(folder: Path, gpu: str) -> Holder:
    for path in sorted(folder.glob(f"gpu-{gpu}.*.json")):
        try:
            data = json.loads(path.read_text())
            holder = Holder(str(data["job_id"]), str(data["user"]), int(data["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if proc_info(holder.pid) is None:
            continue  # a leftover note of a dead holder
        return holder
    return Holder("?", "?", 0)
