"""GPU readings through NVML — the only pynvml user (docs/multi-gpu.md).

`GpuMonitor.snapshot()` never raises: a missing driver becomes `driver_problem` (the UI
then offers CPU slots) and a reading that fails becomes None ("n/a"). Indices are CUDA's
under CUDA_DEVICE_ORDER=PCI_BUS_ID (set for every job): the GPUs in PCI bus id order (which
is NVML's own order on every driver seen), so a job launched with CUDA_VISIBLE_DEVICES=<index>
lands on the GPU shown under that index. An inherited CUDA_VISIBLE_DEVICES limits the panel
to those GPUs (indices or UUIDs).

Slots (what a job is assigned): a GPU by its index, or, on a GPU in MIG mode, each MIG
device by its UUID (`CUDA_VISIBLE_DEVICES=MIG-...`); the partitioned GPU itself is no slot.
A GPU whose NVML calls answer NVML_ERROR_GPU_IS_LOST is `lost` (its jobs are flagged).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import psutil

from app.services.machine import nvml as gpu_nvml
from app.services.machine.nvml import StaticFields, describe_init_error, read_static
from app.services.machine.nvml import decode as _decode

log = logging.getLogger(__name__)

GIB = 1024**3
SIMULATED_MEMORY_BYTES = 80 * GIB
SIMULATED_POWER_LIMIT_W = 700.0
FROM_ENV = object()  # default of GpuMonitor(visible_devices=...): read CUDA_VISIBLE_DEVICES


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    user: str | None
    used_memory_bytes: int | None
    name: str | None
    is_mine: bool


@dataclass(frozen=True)
class GpuSnapshot:
    index: int
    name: str
    uuid: str
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_percent: int | None
    temperature_c: int | None
    power_w: float | None
    processes: tuple[GpuProcess, ...]
    power_limit_w: float | None = None
    fan_percent: int | None = None  # None also for GPUs without a fan (passively cooled)
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST: off the bus until a reset
    pci_bus_id: str | None = None
    mig_enabled: bool = False  # partitioned: its MIG devices (`mig`) are the slots
    mig: tuple[GpuSnapshot, ...] = ()
    parent_index: int | None = None  # a MIG device: the GPU it is part of
    mig_position: int | None = None

    @property
    def slot(self) -> str:
        """What a job names in --gpus and gets in CUDA_VISIBLE_DEVICES."""
        return self.uuid if self.parent_index is not None else str(self.index)

    @property
    def short_uuid(self) -> str:
        body = self.uuid.split("-", 1)[1] if "-" in self.uuid else self.uuid
        return body[:8] if body else "n/a"

    @property
    def memory_used_fraction(self) -> float | None:
        if self.memory_used_bytes is None or not self.memory_total_bytes:
            return None
        return self.memory_used_bytes / self.memory_total_bytes

    @property
    def busy(self) -> bool:
        """Busy as the launch checks mean it: memory used > 10 % or utilisation > 20 %."""
        fraction = self.memory_used_fraction
        return (fraction is not None and fraction > 0.10) or (
            self.utilization_percent is not None and self.utilization_percent > 20
        )

    @property
    def other_users(self) -> tuple[str, ...]:
        return tuple(sorted({p.user or "?" for p in self.processes if not p.is_mine}))


@dataclass(frozen=True)
class MachineSnapshot:
    gpus: tuple[GpuSnapshot, ...]
    simulated: bool
    driver_problem: str | None
    taken_at: float
    order_note: str | None = None  # NVML's order is not the PCI one (gpu_nvml.ORDER_NOTE)

    def gpu(self, index: int | str) -> GpuSnapshot | None:
        return next((g for g in self.gpus if g.index == int(index)), None)

    @property
    def slots(self) -> tuple[GpuSnapshot, ...]:
        """What jobs can be assigned: each GPU, or each MIG device of a partitioned one."""
        return tuple(s for g in self.gpus for s in (g.mig if g.mig_enabled else (g,)))

    def slot(self, name: str) -> GpuSnapshot | None:
        """The reading of a slot by its name (an index or a MIG UUID); a partitioned GPU's
        index names the GPU itself (launch checks refuse it: it is no slot)."""
        if name.isdigit():
            return self.gpu(name)
        return next((s for g in self.gpus for s in g.mig if s.uuid == name), None)


def fmt_na(value: Any, fmt: str = "{}") -> str:
    """A reading for display: "n/a" when it is missing."""
    return "n/a" if value is None else fmt.format(value)


def parse_visible_devices(text: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None = all; entries up to the first invalid one."""
    if text is None:
        return None
    entries = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            break
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break  # "-1" or anything else hides every device from there on
        entries.append(entry)
    return entries


class GpuMonitor:
    def __init__(
        self,
        simulate: int | None = None,
        backend: Any = None,
        visible_devices: str | object | None = FROM_ENV,
        simulated_load: Callable[[], Mapping[int, Iterable[tuple[int, str]]]] | None = None,
    ) -> None:
        """`backend` is the pynvml module or a test double with the same functions.

        `simulated_load` (simulate mode only) returns {gpu index: [(pid, name), ...]} for
        nnui's own running jobs, so utilisation and processes follow what was launched;
        without it the simulated GPUs are idle.
        """
        self.simulate = simulate
        if visible_devices is FROM_ENV:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.visible = parse_visible_devices(visible_devices)  # type: ignore[arg-type]
        self.simulated_load = simulated_load
        self._nvml = backend
        self._initialised = False
        self._init_problem: str | None = None
        self._static: dict[int, StaticFields] = {}
        self._order: list[int] | None = None  # NVML index of each CUDA index (PCI order)
        self._lost = False  # a reading of the GPU being read answered GPU_IS_LOST
        self._last_mig: dict[int, tuple[GpuSnapshot, ...]] = {}  # MIG devices last seen
        self.num_static_reads = 0  # tests: the static fields are read once per GPU
        self._me: tuple[str | None] | None = None  # (nnui's user,) once read (simulate mode)

    # ---- lifecycle -----------------------------------------------------------------------

    def _ensure_init(self) -> bool:
        if self._initialised:
            return True
        if self._init_problem is not None:
            return False
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
        except Exception as error:  # any failure here means "no usable driver"
            self._init_problem = describe_init_error(error, self._nvml)
            log.info("NVML init failed: %s", error)
            return False
        self._initialised = True
        return True

    def close(self) -> None:
        if self._initialised:
            try:
                self._nvml.nvmlShutdown()
            except Exception as error:
                log.debug("nvmlShutdown failed: %s", error)
            self._initialised = False

    # ---- snapshots -----------------------------------------------------------------------

    def snapshot(self) -> MachineSnapshot:
        now = time.time()
        if self.simulate:
            return MachineSnapshot(self._simulated(), True, None, now)
        if not self._ensure_init():
            return MachineSnapshot((), False, self._init_problem, now)
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
        except Exception as error:
            return MachineSnapshot((), False, f"NVML failed to count GPUs ({error})", now)
        order = self._pci_order(count)
        gpus = tuple(self._read_gpu(i, order[i]) for i in self._visible_indices(count))
        note = gpu_nvml.ORDER_NOTE if order != list(range(count)) else None
        return MachineSnapshot(gpus, False, None, now, note)

    def _pci_order(self, count: int) -> list[int]:
        """NVML index of each CUDA index: read once (bus ids do not change while the driver
        is loaded); NVML's own order until every bus id could be read."""
        if self._order is not None and len(self._order) == count:
            return self._order
        found = gpu_nvml.pci_order(self._nvml, count)
        if found is None:
            return list(range(count))
        self._order = found[0]
        return self._order

    def _visible_indices(self, count: int) -> list[int]:
        if self.visible is None:
            return list(range(count))
        uuids: dict[int, str] = {}
        chosen: list[int] = []
        for entry in self.visible:
            if entry.isdigit():
                index = int(entry)
                if index >= count:
                    break  # CUDA ignores this and every later entry
            else:
                if not uuids:
                    uuids = {i: self._safe(partial(self._uuid_text, i), "") for i in range(count)}
                matches = [i for i, u in uuids.items() if u and u.startswith(entry)]
                if len(matches) != 1:
                    break
                index = matches[0]
            if index in chosen:
                break  # a repeated device makes CUDA see none from here on
            chosen.append(index)
        return chosen

    def _uuid_text(self, index: int) -> str:
        return _decode(self._uuid(index))

    def _uuid(self, index: int) -> Any:
        nvml_index = self._order[index] if self._order else index
        return self._nvml.nvmlDeviceGetUUID(self._nvml.nvmlDeviceGetHandleByIndex(nvml_index))

    def _safe(self, read: Callable[[], Any], default: Any = None) -> Any:
        try:
            return read()
        except Exception as error:  # NVMLError subclasses, or a lost GPU
            self._note_error(error)
            return default

    def _note_error(self, error: BaseException) -> None:
        log.debug("NVML reading failed: %s", error)
        if gpu_nvml.nvml_code(error) == gpu_nvml.GPU_IS_LOST:
            self._lost = True

    def _static_fields(self, index: int, handle: Any) -> StaticFields:
        known = self._static.get(index)
        if known is not None:
            return known
        self.num_static_reads += 1
        fields = read_static(self._nvml, handle, self._safe)
        if "n/a" not in (fields.name, fields.uuid) and not self._lost:  # else: again later
            self._static[index] = fields
        return fields

    def _read_gpu(self, index: int, nvml_index: int) -> GpuSnapshot:
        nvml = self._nvml
        self._lost = False
        handle = self._safe(lambda: nvml.nvmlDeviceGetHandleByIndex(nvml_index))
        devices = None
        if handle is None:
            known = self._static.get(index)  # a GPU lost after it was seen keeps its name
            name, uuid = (known.name, known.uuid) if known else ("n/a", "n/a")
            reading = GpuSnapshot(index, name, uuid, None, None, None, None, None, ())
        else:
            reading = self._readings(index, handle, self._static_fields(index, handle))
            devices = gpu_nvml.mig_devices(nvml, handle, self._safe)
        instances = tuple(self._read_mig(index, device) for device in devices or ())
        if self._lost:  # its MIG devices as last seen, lost with it: their jobs are flagged
            instances = tuple(
                replace(d, lost=True, memory_used_bytes=None, processes=())
                for d in self._last_mig.get(index, ())
            )
        else:
            self._last_mig[index] = instances
        enabled = devices is not None or bool(instances)
        return replace(reading, lost=self._lost, mig_enabled=enabled, mig=instances)

    def _read_mig(self, index: int, device: gpu_nvml.MigDevice) -> GpuSnapshot:
        """A MIG device: its own UUID, memory and processes (no power, fan or temperature:
        those belong to the whole GPU, and NVML answers "not supported")."""
        reading = self._readings(
            index, device.handle, read_static(self._nvml, device.handle, self._safe, mig=True)
        )
        return replace(reading, parent_index=index, mig_position=device.position)

    def _readings(self, index: int, handle: Any, static: StaticFields) -> GpuSnapshot:
        nvml = self._nvml
        memory = self._safe(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        util = self._safe(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        power_mw = self._safe(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        fan = (
            self._safe(lambda: int(nvml.nvmlDeviceGetFanSpeed(handle))) if static.has_fan else None
        )
        temperature_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)
        return GpuSnapshot(
            index=index,
            name=static.name,
            uuid=static.uuid,
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_percent=None if util is None else int(util.gpu),
            temperature_c=self._safe(
                lambda: int(nvml.nvmlDeviceGetTemperature(handle, temperature_sensor))
            ),
            power_w=None if power_mw is None else power_mw / 1000.0,
            processes=self._read_processes(handle),
            power_limit_w=static.power_limit_w,
            fan_percent=fan,
            pci_bus_id=static.pci_bus_id,
        )

    def _read_processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        result = []
        for entry in gpu_nvml.running_processes(self._nvml, handle, self._note_error):
            user, name, uid = self._owner(entry.pid)
            mine = uid == os.getuid()
            result.append(GpuProcess(entry.pid, user, entry.used_memory_bytes, name, mine))
        return tuple(result)

    def _owner(self, pid: int) -> tuple[str | None, str | None, int | None]:
        """User, name and uid of a pid (None when it is in another pid namespace or gone)."""
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                uid = process.uids().real
                name = process.name()
                try:
                    user = process.username()
                except (KeyError, psutil.Error):
                    user = str(uid)
            return user, name, uid
        except (psutil.Error, OSError):
            return None, None, None

    def _simulated(self) -> tuple[GpuSnapshot, ...]:
        # The load comes from the caller (nnui's own jobs, see jobs.simulated_gpu_load):
        # this module reads GPUs and never the job registry, so nothing here imports jobs.
        try:
            load = self.simulated_load() if self.simulated_load is not None else {}
        except Exception as error:  # a reading, never a crash
            log.debug("simulated load failed: %s", error)
            load = {}
        if self._me is None:  # nnui's own user: read once, not every second
            self._me = (self._owner(os.getpid())[0],)
        me = self._me[0]
        others = simulated_busy(os.environ.get(SIMULATED_BUSY_ENV))
        return tuple(
            _simulated_gpu(index, list(load.get(index, ())), others.get(index, ()), me)
            for index in range(int(self.simulate or 0))
        )


# The simulated machine plays other users and busy GPUs from this JSON file, read at every
# snapshot (a test or a demo edits it while jobs wait): {"GPU index": [{"pid": 4411,
# "user": "bob", "used_gib": 37, "util": 90}, ...]}. A missing or bad file: nobody else.
SIMULATED_BUSY_ENV = "NNUI_SIMULATED_BUSY"


def simulated_busy(path: str | None) -> dict[int, tuple[tuple[GpuProcess, int], ...]]:
    """{index: ((process, utilisation %), ...)} of the simulated other processes."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
        me = os.getuid()
        busy: dict[int, tuple[tuple[GpuProcess, int], ...]] = {}
        for index, entries in data.items():
            busy[int(index)] = tuple(
                (
                    GpuProcess(int(e["pid"]), str(e["user"]), int(float(e["used_gib"]) * GIB),
                               "simulated", e.get("uid") == me),
                    int(e.get("util", 90)),
                )
                for e in entries
            )  # fmt: skip
        return busy
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        log.debug("simulated busy file %s unusable: %s", path, error)
        return {}


def _simulated_gpu(
    index: int,
    running: list[tuple[int, str]],
    others: tuple[tuple[GpuProcess, int], ...],
    me: str | None,
) -> GpuSnapshot:
    processes = tuple(GpuProcess(pid, me, 6 * GIB, name, True) for pid, name in running)
    processes += tuple(p for p, _ in others)
    busy = bool(processes)
    used = 6 * GIB * len(running) + sum(p.used_memory_bytes or 0 for p, _ in others)
    util = max([85 * len(running), *(u for _, u in others)])
    return GpuSnapshot(
        index=index,
        name=f"Simulated GPU {index}",
        uuid=f"GPU-5157{index:04d}-0000-0000-0000-000000000000",
        memory_used_bytes=min(used, SIMULATED_MEMORY_BYTES),
        memory_total_bytes=SIMULATED_MEMORY_BYTES,
        utilization_percent=min(100, util),
        temperature_c=68 if busy else 34,
        power_w=310.0 if busy else 62.0,
        processes=processes,
        power_limit_w=SIMULATED_POWER_LIMIT_W,
        fan_percent=(55 if busy else 30) if index % 2 == 0 else None,
    )
