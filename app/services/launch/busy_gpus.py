"""Shared-box manners: a launch onto a GPU that already runs any process (another user's,
or one of yours: an earlier fold, a notebook) needs a confirmation — `y` on the board,
`--yes` (or a terminal's answer) headless. Memory in use with no process visible (another
container) counts as busy too. Waiting jobs (`--when-free`) are not asked: busy is why they
wait."""

from __future__ import annotations

from app.services.machine.gpus import GIB, GpuProcess, GpuSnapshot

ASK = "confirm to share it"


def occupied_note(gpu: str, reading: GpuSnapshot) -> str | None:
    """One line naming who is on `gpu` already, or None when it is free."""
    if reading.processes:
        who = ", ".join(_process_text(p) for p in reading.processes[:4])
        more = f" and {len(reading.processes) - 4} more" if len(reading.processes) > 4 else ""
        count = len(reading.processes)
        noun = "processes" if count > 1 else "process"
        return f"GPU {gpu} already runs {count} {noun} ({who}{more}): {ASK}"
    if reading.busy:
        util = reading.utilization_percent
        return (
            f"GPU {gpu} is in use by processes nnui cannot see (memory "
            f"{reading.memory_used_fraction or 0:.0%}, utilisation "
            f"{'n/a' if util is None else util}%): {ASK}"
        )
    return None


def _process_text(process: GpuProcess) -> str:
    owner = "yours" if process.is_mine else (process.user or "?")
    used = process.used_memory_bytes
    memory = "" if used is None else f" {used / GIB:.0f} GiB"
    return f"{owner} pid {process.pid}{memory}"


def refusal(confirmations: list[str]) -> str:
    """The headless one-line refusal when nobody confirmed."""
    first = confirmations[0].removesuffix(f": {ASK}")
    more = f" (and {len(confirmations) - 1} more GPU)" if len(confirmations) > 1 else ""
    return f"{first}{more}: add --yes to start beside it"
