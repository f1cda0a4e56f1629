"""Who trains in a run folder: one claim per fold folder, taken atomically across processes
and users (docs/contract.md).

Checking that a fold is free and then registering its job are two steps; two `nnui launch`
of the same fold released at the same moment both passed the check. Here check-and-register
is one step: under an flock on `<results>/.nnui_claims.lock` (one file for every user of
the results root; flock works on a read-only descriptor, so others need no write access to
it) the launcher re-checks the folder, then creates `fold_F/.nnui_claim` exclusively: a
complete temporary file is link(2)ed to that name, so a reader never sees half a claim and
only one creator succeeds. The claim names the job and its holder process (first the
launching nnui, then the job's supervisor) with its start ticks since boot. It is stale only
when verifiably dead: the holder is no longer that process on this host. A claim written on
another host, or one that cannot be read, is never taken over: the user is told which file
to remove once sure that nothing trains there.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from app.services.machine.procs import is_same_process, process_identity, valid_pid
from trainer.schema.atomic import atomic_write_text

CLAIM_FILE = ".nnui_claim"
LOCK_FILE = ".nnui_claims.lock"


class ClaimRefused(Exception):
    """The fold belongs to another live job (or its claim cannot be verified); one line."""


@dataclass(frozen=True)
class Claim:
    job_id: str
    host: str
    uid: int
    pid: int  # the holder: the launching nnui, then the job's supervisor
    start_ticks: int | None
    created_at: float


@contextmanager
def locked(results_root: Path) -> Iterator[None]:
    """Exclusive across processes and users of this results root, for check-and-claim."""
    path = results_root / LOCK_FILE
    try:
        results_root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's lock file: reading is enough for flock
            fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        raise ClaimRefused(f"cannot lock {path}: {error.strerror or error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read(run_dir: Path) -> Claim | None:
    """The claim in this run folder; None when there is none; ClaimRefused if unreadable."""
    path = run_dir / CLAIM_FILE
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
        claim = Claim(**data)
        if not (isinstance(claim.job_id, str) and isinstance(claim.host, str)):
            raise TypeError("job_id and host must be strings")
        numbers_ok = all(
            isinstance(v, (int, float)) and not isinstance(v, bool)
            for v in (claim.uid, claim.created_at)
        )
        ticks_ok = claim.start_ticks is None or (
            isinstance(claim.start_ticks, int) and not isinstance(claim.start_ticks, bool)
        )
        if not (valid_pid(claim.pid) and numbers_ok and ticks_ok):
            raise TypeError(f"holder {claim.pid!r} is not a process identity")
        return claim
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, RecursionError) as error:
        raise ClaimRefused(
            f"cannot read the claim {path} ({error}); remove it once sure no job trains there"
        ) from None


def alive(claim: Claim) -> bool:
    """The holder is still the very process that claimed (pid and start ticks, this host)."""
    if claim.host != socket.gethostname():
        return True  # cannot be verified here: never stale
    return is_same_process(claim.pid, claim.created_at, start_ticks=claim.start_ticks)


def check(run_dir: Path, fold: str) -> str | None:
    """Why the fold is taken (a live claim), or None (no claim, or a stale one)."""
    claim = read(run_dir)
    if claim is None or not alive(claim):
        return None
    where = "" if claim.host == socket.gethostname() else f" on host {claim.host}"
    return (
        f"fold {fold} is claimed by job {claim.job_id}{where} (uid {claim.uid}, pid "
        f"{claim.pid}) in {run_dir}: it is already running (see nnui status)"
    )


def take(run_dir: Path, fold: str, job_id: str) -> None:
    """Claim the folder for job_id, held by this process (call under `locked`)."""
    problem = check(run_dir, fold)
    if problem is not None:
        raise ClaimRefused(problem)
    path = run_dir / CLAIM_FILE
    path.unlink(missing_ok=True)  # stale: its holder is verifiably gone
    _write(path, _claim(job_id, os.getpid()), exclusive=True)


def hand_over(run_dir: Path, job_id: str, pid: int) -> None:
    """The job's supervisor holds the claim from now on (call under `locked`)."""
    _write(run_dir / CLAIM_FILE, _claim(job_id, pid), exclusive=False)


def release(run_dir: Path, job_id: str) -> None:
    """Drop our claim (the start failed); someone else's is left alone."""
    try:
        claim = read(run_dir)
    except ClaimRefused:
        return
    if claim is not None and claim.job_id == job_id:
        (run_dir / CLAIM_FILE).unlink(missing_ok=True)


def _claim(job_id: str, pid: int) -> Claim:
    ticks, create_time = process_identity(pid)
    return Claim(job_id, socket.gethostname(), os.getuid(), pid, ticks, create_time or time.time())


def _write(path: Path, claim: Claim, exclusive: bool) -> None:
    try:
        atomic_write_text(path, json.dumps(asdict(claim)), exclusive=exclusive)
    except FileExistsError:
        raise ClaimRefused(f"{path} was claimed at the same moment") from None
