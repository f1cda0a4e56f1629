"""Per-GPU history of utilisation and memory over the last minutes, kept across restarts.

The TUI samples NVML every second anyway; this keeps one point per `step_s` (the peak of
the step) per GPU UUID and, so that a restarted nnui still shows the last minutes, writes
them to a small per-user cache file (`$XDG_CACHE_HOME/nnui/gpu_history.json`). That file
is nnui's own: writing it changes no job, run folder or registry entry, so "looking never
changes anything" (docs/contract.md) still holds. Sampling in the jobs' supervisors instead would
cover the minutes no TUI was open, but costs an NVML reader per job and says nothing about
a GPU no nnui job runs on. A cache that cannot be read or written is ignored (logged).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from app.services.machine.gpus import MachineSnapshot
from app.services.machine.host import HostSnapshot, ProcLoad
from trainer.schema.atomic import atomic_write_text

log = logging.getLogger(__name__)

HISTORY_STEP_S = 5.0
HISTORY_SPAN_S = 15 * 60.0
SAVE_EVERY_S = 30.0
CACHE_FILE = "gpu_history.json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nnui"


@dataclass(frozen=True)
class HistorySeries:
    """One GPU's last `span` steps, oldest first; None where nothing was sampled."""

    step_s: float
    utilization_percent: tuple[float | None, ...]
    memory_percent: tuple[float | None, ...]


class GpuHistory:
    def __init__(
        self,
        cache_dir: Path | None = None,
        step_s: float = HISTORY_STEP_S,
        span_s: float = HISTORY_SPAN_S,
    ) -> None:
        self.path = None if cache_dir is None else Path(cache_dir) / CACHE_FILE
        self.step_s = step_s
        self.num_steps = max(1, int(span_s // step_s))
        # uuid -> {step number: (peak utilisation %, peak memory %)}
        self._points: dict[str, dict[int, tuple[float, float]]] = {}
        self._saved_at: float | None = None
        self._dirty = False
        # uuid -> (last step, series): the panel asks for every GPU's series every second,
        # and a series changes only when a peak rises or a step begins (every step_s).
        self._series: dict[str, tuple[int, HistorySeries]] = {}

    def add(self, snapshot: MachineSnapshot) -> None:
        step = int(snapshot.taken_at // self.step_s)
        for gpu in snapshot.gpus:
            if not gpu.uuid or gpu.uuid == "n/a":
                continue
            util = float(gpu.utilization_percent or 0)
            fraction = gpu.memory_used_fraction
            memory = 0.0 if fraction is None else 100.0 * fraction
            points = self._points.setdefault(gpu.uuid, {})
            old = points.get(step)
            new = (util, memory) if old is None else (max(old[0], util), max(old[1], memory))
            if new != old:
                points[step] = new
                self._series.pop(gpu.uuid, None)
            for gone in [s for s in points if s <= step - self.num_steps]:
                del points[gone]
        self._dirty = True

    def series(self, uuid: str, now: float) -> HistorySeries:
        last = int(now // self.step_s)
        cached = self._series.get(uuid)
        if cached is not None and cached[0] == last:
            return cached[1]
        points = self._points.get(uuid, {})
        steps = range(last - self.num_steps + 1, last + 1)
        util = tuple(points[s][0] if s in points else None for s in steps)
        memory = tuple(points[s][1] if s in points else None for s in steps)
        series = HistorySeries(self.step_s, util, memory)
        self._series[uuid] = (last, series)
        return series

    # ---- the cache file ---------------------------------------------------------------

    def load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text())
            points = {
                str(uuid): {int(s): (float(u), float(m)) for s, u, m in rows}
                for uuid, rows in data["gpus"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.info("GPU history cache %s ignored: %s", self.path, error)
            return
        if float(data.get("step_s", 0)) == self.step_s:
            self._points = points
            self._series = {}

    def save_if_due(self, now: float) -> None:
        if self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S:
            self.save(now)

    def save(self, now: float) -> None:
        """Write the cache atomically (tmp beside it, then replace)."""
        self._saved_at = now
        if self.path is None or not self._dirty:
            return
        data = {
            "v": 1,
            "step_s": self.step_s,
            "gpus": {u: [[s, *p] for s, p in sorted(v.items())] for u, v in self._points.items()},
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(data, separators=(",", ":")))
            self._dirty = False
        except OSError as error:
            log.info("GPU history cache %s not written: %s", self.path, error)


@dataclass(frozen=True)
class PanelReadings:
    """What the GPU panel shows beside the NVML snapshot: history per GPU UUID, the host
    line and the host side of each GPU process (from app.services.machine.procs)."""

    history: dict[str, HistorySeries]
    host: HostSnapshot | None
    loads: dict[int, ProcLoad]
