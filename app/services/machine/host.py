"""Host and per-process load: the GPU panel's host line (CPU %, RAM, load average) and the
host side of each GPU process (%CPU, resident memory, elapsed time, command line)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

from app.services.machine.procs import safe_cmdline


@dataclass(frozen=True)
class HostSnapshot:
    """The host line: CPU %, RAM, load average (None: could not be read)."""

    cpu_percent: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    load_avg: tuple[float, float, float] | None
    num_cpus: int


@dataclass(frozen=True)
class ProcLoad:
    """One GPU process as seen on the host: %CPU (since the previous reading; 100 = one
    core), resident memory, elapsed time and the full command line."""

    pid: int
    cpu_percent: float | None
    rss_bytes: int | None
    elapsed_s: float | None
    cmdline: str | None


class LoadSampler:
    """%CPU needs two readings of a process's CPU time: this keeps the earlier one per pid
    (psutil.Process objects; a reused pid gets a new object, its start time differs)."""

    def __init__(self) -> None:
        self._processes: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)  # the first call only sets the baseline

    def host(self) -> HostSnapshot:
        try:
            memory = psutil.virtual_memory()
            used: int | None = int(memory.total - memory.available)
            total: int | None = int(memory.total)
        except (OSError, psutil.Error):
            used = total = None
        try:
            load = os.getloadavg()
        except OSError:
            load = None
        return HostSnapshot(
            cpu_percent=psutil.cpu_percent(None),
            memory_used_bytes=used,
            memory_total_bytes=total,
            load_avg=load,
            num_cpus=os.cpu_count() or 1,
        )

    def processes(self, pids: list[int], now: float | None = None) -> dict[int, ProcLoad]:
        """Readings for these pids; pids that vanished or are invisible are left out."""
        now = time.time() if now is None else now
        result: dict[int, ProcLoad] = {}
        kept: dict[int, psutil.Process] = {}
        for pid in pids:
            process = self._process(pid)
            if process is None:
                continue
            try:
                with process.oneshot():
                    cpu = process.cpu_percent(None)
                    rss = int(process.memory_info().rss)
                    elapsed = max(0.0, now - process.create_time())
                    command = " ".join(safe_cmdline(process)) or process.name()
            except (psutil.Error, OSError):
                continue
            kept[pid] = process
            result[pid] = ProcLoad(pid, cpu, rss, elapsed, command)
        self._processes = kept
        return result

    def _process(self, pid: int) -> psutil.Process | None:
        known = self._processes.get(pid)
        try:
            if known is not None and known.is_running():
                return known
            process = psutil.Process(pid)
            process.cpu_percent(None)  # baseline: the next reading gives a real %CPU
            return process
        except (psutil.Error, OSError):
            return None
