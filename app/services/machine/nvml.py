"""NVML calls whose protocol is more than one call: the PCI (= CUDA) order of the GPUs, the
MIG devices of a partitioned GPU, and the process list that may grow between NVML's two
calls. `nvml` is the pynvml module that gpus.py loaded (it alone imports pynvml); what comes
back is plain values, which gpus.py turns into its snapshots."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GPU_IS_LOST = 15  # NVML_ERROR_GPU_IS_LOST: fell off the bus / Xid 79, needs a reset
INSUFFICIENT_SIZE = 7  # NVML_ERROR_INSUFFICIENT_SIZE
LIST_ATTEMPTS = 3  # a process list that grows between NVML's two calls is asked for again
ORDER_NOTE = (
    "NVML lists the GPUs in another order than their PCI bus ids: nnui numbers them as CUDA "
    "does with CUDA_DEVICE_ORDER=PCI_BUS_ID (set for every job)"
)


def nvml_code(error: BaseException) -> int | None:
    value = getattr(error, "value", None)
    return value if isinstance(value, int) else None


def decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_init_error(error: BaseException, nvml: Any) -> str:
    not_found = getattr(nvml, "NVMLError_LibraryNotFound", None)
    not_loaded = getattr(nvml, "NVMLError_DriverNotLoaded", None)
    if isinstance(error, ImportError):
        return "NVML Python bindings missing (install nvidia-ml-py) — jobs can run on CPU"
    if not_found is not None and isinstance(error, not_found):
        return "No NVIDIA driver found (NVML library not found) — jobs can run on CPU"
    if not_loaded is not None and isinstance(error, not_loaded):
        return "NVIDIA driver not loaded — jobs can run on CPU"
    return f"NVML unavailable ({error}) — jobs can run on CPU"


@dataclass(frozen=True)
class StaticFields:
    """What NVML reports that never changes while the driver is loaded: read once per GPU
    (docs/tui.md), not every second."""

    name: str
    uuid: str
    power_limit_w: float | None
    has_fan: bool
    pci_bus_id: str | None = None


def read_static(
    nvml: Any, handle: Any, safe: Callable[..., Any], mig: bool = False
) -> StaticFields:
    """A MIG device has a name and a UUID only: power, fan and bus belong to its GPU."""
    name = safe(lambda: decode(nvml.nvmlDeviceGetName(handle)), "n/a")
    uuid = safe(lambda: decode(nvml.nvmlDeviceGetUUID(handle)), "n/a")
    if mig:
        return StaticFields(name, uuid, None, False)
    limit_mw = safe(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
    pci = getattr(nvml, "nvmlDeviceGetPciInfo", None)
    return StaticFields(
        name=name,
        uuid=uuid,
        power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
        # A passively cooled GPU answers "not supported": ask once, then never again.
        has_fan=safe(lambda: nvml.nvmlDeviceGetFanSpeed(handle)) is not None,
        pci_bus_id=None if pci is None else safe(lambda: decode(pci(handle).busId)),
    )


def pci_order(nvml: Any, count: int) -> tuple[list[int], dict[int, str]] | None:
    """NVML indices sorted by PCI bus id (CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID)
    and each one's bus id; None when a bus id cannot be read (NVML's order is used then)."""
    read = getattr(nvml, "nvmlDeviceGetPciInfo", None)
    if read is None:
        return None
    buses: dict[int, str] = {}
    for index in range(count):
        try:
            info = read(nvml.nvmlDeviceGetHandleByIndex(index))
            buses[index] = decode(info.busId).lower()
        except Exception as error:  # a lost GPU: try again at the next snapshot
            log.debug("PCI info of GPU %d: %s", index, error)
            return None
    return sorted(range(count), key=lambda i: buses[i]), buses


@dataclass(frozen=True)
class ProcessEntry:
    pid: int
    used_memory_bytes: int | None


def running_processes(
    nvml: Any, handle: Any, on_error: Callable[[BaseException], None]
) -> list[ProcessEntry]:
    """Compute and graphics processes of a GPU (or of a MIG device), one entry per pid."""
    seen: dict[int, ProcessEntry] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        function = getattr(nvml, getter, None)
        if function is None:
            continue
        for entry in _listed(function, handle, on_error):
            used = getattr(entry, "usedGpuMemory", None)
            pid = int(entry.pid)
            seen.setdefault(pid, ProcessEntry(pid, None if used is None else int(used)))
    return [seen[pid] for pid in sorted(seen)]


def _listed(function: Callable, handle: Any, on_error: Callable[[BaseException], None]) -> list:
    for _ in range(LIST_ATTEMPTS):
        try:
            return list(function(handle) or [])
        except Exception as error:
            if nvml_code(error) == INSUFFICIENT_SIZE:
                continue  # processes started between the size query and the fill: again
            on_error(error)
            return []
    return []


@dataclass(frozen=True)
class MigDevice:
    position: int  # the parent's MIG device index (nvmlDeviceGetMigDeviceHandleByIndex)
    handle: Any


def mig_devices(nvml: Any, handle: Any, safe: Callable[[Callable[[], Any]], Any]) -> list | None:
    """The MIG devices of a GPU in MIG mode, None when MIG is off or not supported."""
    mode = safe(lambda: nvml.nvmlDeviceGetMigMode(handle))
    if not mode or int(mode[0]) != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    most = safe(lambda: int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))) or 0
    found = []
    for position in range(most):
        try:
            found.append(
                MigDevice(position, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, position))
            )
        except Exception as error:  # NOT_FOUND: no instance at this position
            if nvml_code(error) == GPU_IS_LOST:
                safe(functools.partial(_raise, error))  # let the caller note the loss
            log.debug("MIG device %d: %s", position, error)
    return found


def _raise(error: BaseException) -> None:
    raise error
