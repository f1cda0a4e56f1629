"""Whether a job is alive, waiting or between attempts: read from its record and /proc, the
same answer for the board, the CLI, the launcher and the supervisor (read-only)."""

from __future__ import annotations

from collections.abc import Callable

from app.services.jobs.registry import Job, ProcessRecord
from app.services.machine.procs import ProcInfo, alive_since, is_same_process, proc_info


def record_alive(
    record: ProcessRecord, proc_lookup: Callable[[int], ProcInfo | None] = proc_info
) -> bool:
    """The recorded process (supervisor, trainer, worker) is still the same one and alive."""
    if proc_lookup is proc_info and record.start_ticks is not None:
        # Liveness needs only /proc/PID/stat (state and start ticks, which pid reuse
        # changes); the full proc_info (cmdline, environ, status) is for the stop checks.
        # The board asks this for every process of every job each second.
        return alive_since(record.pid, record.start_ticks)
    return is_same_process(record.pid, record.create_time, proc_lookup, record.start_ticks)


def job_alive(job: Job, proc_lookup: Callable[[int], ProcInfo | None] = proc_info) -> bool:
    """Any recorded process of the job (supervisor, trainer, worker) still the same and alive."""
    return any(record_alive(p, proc_lookup) for p in job.processes)


def waiting(job: Job) -> bool:
    return job.when_free and job.exit_code is None and job.process("trainer") is None


def between_attempts(job: Job) -> bool:
    """No trainer runs yet or again: waiting for GPUs, or waiting to be restarted. A stop
    then only cancels (queued_stop: the supervisor starts nothing more)."""
    return (job.when_free or bool(job.restarts)) and job.process("trainer") is None
