"""Process identity from /proc (read-only): who a pid is, whether it is still the same process.

Used by the stop and kill checks (signals/), the supervisor and the job views. A pid alone
never identifies a process (pids are reused): always pid + start_ticks, the start time in
clock ticks since boot (/proc/PID/stat field 22). It is exact and never changes for a
process, whereas any wall-clock start time moves when the VM's clock is adjusted (measured:
0.6 s after a few minutes here). create_time (wall clock) stays for display and for the
"started after the job was launched" checks, with a tolerance of seconds.
"""

from __future__ import annotations

import logging
import os
import pwd
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from app.legacy import same_start_time
from trainer.schema.tree import JOB_ID_ENV

log = logging.getLogger(__name__)

# Comparing a start time with another wall-clock instant (job launch, topology event).
WALL_CLOCK_TOLERANCE_S = 2.0


# A pid fits pid_t (the kernel's own limit is 2**22 on 64-bit; larger values are simply
# absent). Zero and negative values are never pids here: os.kill(0 | -1 | -N) would signal
# a whole process group.
PID_MAX = 2**31 - 1


def valid_pid(value: object) -> bool:
    """A positive int that can be a pid (never a bool, never 0 or negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= PID_MAX


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    uid: int
    create_time: float
    name: str
    cmdline: list[str]
    sigcgt_usr1: bool
    env_job_id: str | None
    zombie: bool
    start_ticks: int | None = None  # clock ticks since boot; the identity (None: unreadable)


def sigcgt_has(status_text: str, signum: int) -> bool:
    for line in status_text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False


def _env_value(pid: int, name: str) -> str | None:
    """A variable from /proc/PID/environ (the process's start environment); None if unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in data.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/PID/stat's fields after the command name (field 3 first), None: gone."""
    if not valid_pid(pid):
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # Fields after the command name (which may contain spaces and parentheses).
    try:
        return data[data.rindex(b")") + 2 :].split()
    except ValueError:  # an empty read (the process exited meanwhile)
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time in clock ticks since boot (/proc/PID/stat field 22): exact and immutable."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _stat_if_same(pid: int, start_ticks: int | None) -> list[bytes] | None:
    """/proc/PID/stat's fields (as _stat_fields) while the pid is still the process started
    at `start_ticks` (None: whichever it is now); None when it is gone, unreadable or the
    pid was reused (its start ticks differ)."""
    fields = _stat_fields(pid)
    if not fields:
        return None
    try:
        if start_ticks is not None and int(fields[19]) != start_ticks:
            return None
    except (ValueError, IndexError):
        return None
    return fields


def process_cpu_s(pid: int, start_ticks: int | None) -> float | None:
    """CPU seconds (user + system, fields 14-15) the process used so far; None when it is
    gone or the pid now belongs to another process (its start ticks differ)."""
    fields = _stat_if_same(pid, start_ticks)
    try:
        return None if fields is None else (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (ValueError, IndexError):
        return None


def ticks_to_wall_s(start_ticks: int) -> float:
    """A start tick as wall-clock seconds now (moves when the wall clock is adjusted)."""
    boot_wall_s = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return round(boot_wall_s + start_ticks / _CLOCK_TICKS, 3)


def process_start_time(pid: int) -> float | None:
    """Start time of a process in wall-clock seconds, for display and wall-time checks.

    psutil's create_time() adds the start tick to /proc/stat's whole-second btime, so it
    can be up to 1 s off time.time(); use the boot clock instead: now - CLOCK_BOOTTIME +
    start ticks. Not an identity: it follows wall-clock adjustments (use start_ticks).
    """
    ticks = process_start_ticks(pid)
    return None if ticks is None else ticks_to_wall_s(ticks)


def process_identity(pid: int) -> tuple[int | None, float | None]:
    """(start_ticks, create_time) of a pid, read once, for a registry record."""
    ticks = process_start_ticks(pid)
    return ticks, (None if ticks is None else ticks_to_wall_s(ticks))


def proc_info(pid: int) -> ProcInfo | None:
    """What the stop checks need about one pid, or None when there is no such process.

    Not a pid (0, negative, a bool, a string from a bad record): None, never an exception.
    """
    if not valid_pid(pid):
        return None
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            ticks = process_start_ticks(pid)
            info = ProcInfo(
                pid=pid,
                ppid=process.ppid(),
                uid=process.uids().real,
                create_time=process.create_time() if ticks is None else ticks_to_wall_s(ticks),
                name=process.name(),
                cmdline=safe_cmdline(process),
                sigcgt_usr1=_read_sigcgt(pid),
                env_job_id=_env_value(pid, JOB_ID_ENV),
                zombie=process.status() == psutil.STATUS_ZOMBIE,
                start_ticks=ticks,
            )
        return info
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except (psutil.Error, OSError, ValueError) as error:
        log.debug("proc_info(%s): %s", pid, error)
        return None


def safe_cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _read_sigcgt(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return sigcgt_has(handle.read(), signal.SIGUSR1)
    except OSError:
        return False


def pids_with_job_id(job_id: str) -> list[int]:
    """Live processes of this user whose start environment holds NNUI_JOB_ID=job_id.

    kill's sweep for a trainer its supervisor had no time to record (a kill in the
    supervisor's first second); each pid found still passes the kill's identity checks.
    """
    uid = os.getuid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
        except OSError:
            continue
        if _env_value(int(name), JOB_ID_ENV) == job_id:
            found.append(int(name))
    return found


def same_identity(info: ProcInfo, create_time: float, start_ticks: int | None) -> bool:
    """Is `info` the process recorded with (create_time, start_ticks)? Exact by ticks; by
    wall-clock start time (1 s tolerance) only for old records without ticks."""
    if start_ticks is not None and info.start_ticks is not None:
        return info.start_ticks == start_ticks
    return same_start_time(info.create_time, create_time)  # app/legacy.py


def is_same_process(
    pid: int,
    create_time: float,
    proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
    start_ticks: int | None = None,
) -> bool:
    """Alive (not a zombie) and the same process as recorded (pid reuse changes start_ticks)."""
    info = proc_lookup(pid)
    return info is not None and not info.zombie and same_identity(info, create_time, start_ticks)


def alive_since(pid: int, start_ticks: int) -> bool:
    """The process `pid` started at `start_ticks` still runs (not a zombie). Reads only
    /proc/PID/stat: the board asks this for every process of every job each second."""
    fields = _stat_if_same(pid, start_ticks)
    return fields is not None and fields[0] not in (b"Z", b"X")  # field 3: the state


# ---- the process table (watch-only discovery of runs nnui did not start) -----------------


@dataclass(frozen=True)
class ProcRow:
    """One live process as the watch-only discovery sees it.

    `environ` and `sigcgt_usr1` are read only for the rows `process_table(detail=...)` asks
    for (the kernel lets us read another user's environ: never, so None there).
    """

    pid: int
    ppid: int
    uid: int
    start_ticks: int | None
    cmdline: tuple[str, ...]
    environ: dict[str, str] | None = None  # None: not read, or not readable (another user)
    sigcgt_usr1: bool | None = None  # None: not read, or /proc/PID/status unreadable
    cwd: str | None = None  # None: not read, or not readable (another user's)

    @property
    def start_time(self) -> float | None:
        return None if self.start_ticks is None else ticks_to_wall_s(self.start_ticks)


def read_environ(pid: int) -> dict[str, str] | None:
    """The start environment of a pid, or None when it cannot be read (another user's)."""
    if not valid_pid(pid):
        return None
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    found = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            found[name.decode(errors="replace")] = value.decode(errors="replace")
    return found


def read_cwd(pid: int) -> str | None:
    """The working directory of a pid (own processes only), or None."""
    if not valid_pid(pid):
        return None
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def read_sigcgt_mask(pid: int) -> int | None:
    """The SigCgt mask of /proc/PID/status (bit N-1 set: signal N is caught), or None.

    /proc/PID/status is world-readable, so this works for another user's process too.
    """
    if not valid_pid(pid):
        return None
    try:
        with open(f"/proc/{pid}/status") as handle:
            text = handle.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("SigCgt:"):
            try:
                return int(line.split()[1], 16)
            except (IndexError, ValueError):
                return None
    return None


def read_sigcgt_usr1(pid: int) -> bool | None:
    """Does the pid catch SIGUSR1 (its SigCgt bit)? None when unreadable."""
    mask = read_sigcgt_mask(pid)
    return None if mask is None else bool(mask & (1 << (signal.SIGUSR1 - 1)))


def _read_cmdline(pid: int) -> tuple[str, ...] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except OSError:  # gone meanwhile
        return None
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def _read_row(pid: int, cmdline: tuple[str, ...] | None = None) -> ProcRow | None:
    """The row of a pid, or None when it is gone or has no argv (a kernel thread, a
    zombie): that check comes first, so those cost one read, not three."""
    args = _read_cmdline(pid) if cmdline is None else cmdline
    if not args:
        return None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
        fields = stat[stat.rindex(b")") + 2 :].split()
        ppid, ticks = int(fields[1]), int(fields[19])
    except (OSError, ValueError, IndexError):  # gone meanwhile
        return None
    return ProcRow(pid=pid, ppid=ppid, uid=uid, start_ticks=ticks, cmdline=args)


def _children(pid: int) -> list[int]:
    """Child pids from /proc/PID/task/*/children: every thread's children (a process
    forked from a thread other than the main one is listed under that thread only)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as handle:
                found += [int(c) for c in handle.read().split()]
        except (OSError, ValueError):
            continue
    return found


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def process_table(
    detail: Callable[[tuple[str, ...]], bool] | None = None,
    roots: Callable[[tuple[str, ...]], bool] | None = None,
) -> list[ProcRow]:
    """Live processes (pid, ppid, uid, start ticks, argv) from /proc, read-only.

    `roots`: only the processes whose argv it accepts and their descendants (everything
    else costs one cmdline read, not three reads). For the rows whose argv `detail`
    accepts, the environ and cwd (own uid only) and the SigCgt bit are read too.
    Processes that exit while the table is read are simply absent.
    """
    wanted: dict[int, tuple[str, ...] | None]
    if roots is None:
        wanted = {pid: None for pid in _pids()}
    else:
        wanted = {}
        for pid in _pids():
            args = _read_cmdline(pid)
            if args and roots(args):
                wanted[pid] = args
        todo = list(wanted)
        while todo:  # descendants: workers, torchrun's ranks
            for child in _children(todo.pop()):
                if child not in wanted:
                    wanted[child] = None
                    todo.append(child)
    rows = []
    for pid, args in wanted.items():
        row = _read_row(pid, args)
        if row is None:
            continue
        if detail is not None and detail(row.cmdline):
            row = replace(
                row, environ=read_environ(row.pid), sigcgt_usr1=read_sigcgt_usr1(row.pid),
                cwd=read_cwd(row.pid),
            )  # fmt: skip
        rows.append(row)
    return rows


def read_comm(pid: int) -> str | None:
    """The command name of a pid (/proc/PID/comm), None when it is gone."""
    if not valid_pid(pid):
        return None
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return None


def held_folder(pid: int, names: tuple[str, ...]) -> str | None:
    """The folder of a file named one of `names` that the pid holds open (its /proc/PID/fd
    links; readable for our own processes): e.g. a trainer's events.jsonl or owner.lock."""
    if not valid_pid(pid):
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and os.path.basename(target) in names:
            return os.path.dirname(target)
    return None


def descendants(rows: list[ProcRow], pid: int) -> list[int]:
    """Pids below `pid` in the table's parent links (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for row in rows:
        children.setdefault(row.ppid, []).append(row.pid)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if child in found or child == pid:
            continue
        found.append(child)
        todo.extend(children.get(child, []))
    return sorted(found)


def user_name(uid: int) -> str:
    """The login name of a uid (the uid as text when it has none here)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
