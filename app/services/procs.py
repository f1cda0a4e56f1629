"""Process identity from /proc (read-only): who a pid is, whether it is still the same process.

Used by the stop and kill checks (signals.py), the supervisor and the job views. A pid alone
never identifies a process (pids are reused): always pid + create_time.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from app.services.registry import Job
from trainer.schema import JOB_ID_ENV

log = logging.getLogger(__name__)

CREATE_TIME_TOLERANCE_S = 0.05


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


def _sigcgt_has(status_text: str, signum: int) -> bool:
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


def process_start_time(pid: int) -> float | None:
    """Start time of a process in wall-clock seconds, good to one clock tick (10 ms).

    psutil's create_time() adds the start tick to /proc/stat's whole-second btime, so it
    can be up to 1 s off time.time(); stop checks compare against event times, so use the
    boot clock instead: now - CLOCK_BOOTTIME + starttime ticks.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    # Fields after the command name (which may contain spaces and parentheses).
    fields = data[data.rindex(b")") + 2 :].split()
    start_ticks = int(fields[19])
    boot_wall_s = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return round(boot_wall_s + start_ticks / _CLOCK_TICKS, 3)


def proc_info(pid: int) -> ProcInfo | None:
    """What the stop checks need about one pid, or None when there is no such process."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            info = ProcInfo(
                pid=pid,
                ppid=process.ppid(),
                uid=process.uids().real,
                create_time=process_start_time(pid) or process.create_time(),
                name=process.name(),
                cmdline=_safe_cmdline(process),
                sigcgt_usr1=_read_sigcgt(pid),
                env_job_id=_env_value(pid, JOB_ID_ENV),
                zombie=process.status() == psutil.STATUS_ZOMBIE,
            )
        return info
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.Error as error:
        log.debug("proc_info(%s): %s", pid, error)
        return None


def _safe_cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _read_sigcgt(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as handle:
            return _sigcgt_has(handle.read(), signal.SIGUSR1)
    except OSError:
        return False


def is_same_process(
    pid: int, create_time: float, proc_lookup: Callable[[int], ProcInfo | None] = proc_info
) -> bool:
    """Alive (not a zombie) and the same process as recorded (pid reuse shows in create_time)."""
    info = proc_lookup(pid)
    return (
        info is not None
        and not info.zombie
        and abs(info.create_time - create_time) <= CREATE_TIME_TOLERANCE_S
    )


def job_alive(job: Job, proc_lookup: Callable[[int], ProcInfo | None] = proc_info) -> bool:
    """Any recorded process of the job (supervisor, trainer, worker) still the same and alive."""
    return any(is_same_process(p.pid, p.create_time, proc_lookup) for p in job.processes)
