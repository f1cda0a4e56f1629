"""The simulated machine's load from nnui's own jobs: which simulated GPUs run which of them
(for GpuMonitor in simulate mode; the supervisor of a waiting job and `nnui` commands)."""

from __future__ import annotations

from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import Registry
from app.services.machine.procs import proc_info


def simulated_gpu_load(registry: Registry) -> dict[int, list[tuple[int, str]]]:
    """{simulated GPU index: [(pid, name)]} of nnui's own live simulated jobs (for GpuMonitor)."""
    load: dict[int, list[tuple[int, str]]] = {}
    for job in registry.list():
        if not job.simulated or job.exit_code is not None:
            continue
        trainer = job.process("trainer")
        if trainer is None or not job_alive(job, proc_info):
            continue
        for gpu in job.gpus:
            if gpu.isdigit():
                load.setdefault(int(gpu), []).append((trainer.pid, f"nnui {job.job_id}"))
    return load
