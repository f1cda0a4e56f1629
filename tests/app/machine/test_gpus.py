"""GPU readings through a fake NVML backend: values, two users' processes, CUDA_VISIBLE_DEVICES,
no driver, errors mid-run ("n/a", never a crash), and the simulated machine."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pynvml
import pytest

from app.services.machine.gpus import GIB, GpuMonitor, fmt_na, parse_visible_devices

UUIDS = ["GPU-aaaa1111-0000-0000-0000-000000000000", "GPU-bbbb2222-0000-0000-0000-000000000000"]
OTHER_PID = 424242


class FakeNvml:
    """The subset of pynvml the monitor calls; `fail` maps a function name to an NVML code."""

    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, fail: dict[str, int] | None = None, init_error: int | None = None) -> None:
        self.fail = fail or {}
        self.init_error = init_error
        self.shutdowns = 0

    def _check(self, name: str) -> None:
        if name in self.fail:
            raise pynvml.NVMLError(self.fail[name])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check("handle")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return UUIDS[handle]

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check("memory")
        return SimpleNamespace(used=(handle * 40 + 1) * GIB, total=80 * GIB)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check("util")
        return SimpleNamespace(gpu=[3, 97][handle])

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._check("temperature")
        return 40 + handle

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._check("power")
        return 123_500

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        self._check("processes")
        if handle == 0:
            return []
        return [
            SimpleNamespace(pid=os.getpid(), usedGpuMemory=10 * GIB),
            SimpleNamespace(pid=OTHER_PID, usedGpuMemory=None),  # None: no permission to see
        ]


def owners(pid: int) -> tuple[str | None, str | None, int | None]:
    if pid == os.getpid():
        return "me", "python", os.getuid()
    return "alice", "python", os.getuid() + 1000


def monitor(backend: FakeNvml, visible: str | None = None) -> GpuMonitor:
    result = GpuMonitor(backend=backend, visible_devices=visible)
    result._owner = owners  # processes of two users without a second account
    return result


def test_readings_and_processes_of_two_users() -> None:
    snapshot = monitor(FakeNvml()).snapshot()
    assert snapshot.driver_problem is None and not snapshot.simulated
    first, second = snapshot.gpus
    assert (first.index, first.name, first.short_uuid) == (0, "NVIDIA H100 80GB HBM3", "aaaa1111")
    assert (first.memory_used_bytes, first.memory_total_bytes) == (GIB, 80 * GIB)
    assert (first.utilization_percent, first.temperature_c, first.power_w) == (3, 40, 123.5)
    assert not first.busy and first.processes == ()
    assert second.busy and second.other_users == ("alice",)
    mine, theirs = second.processes
    assert (mine.user, mine.is_mine, mine.used_memory_bytes) == ("me", True, 10 * GIB)
    assert (theirs.pid, theirs.user, theirs.is_mine, theirs.used_memory_bytes) == (
        OTHER_PID, "alice", False, None,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("visible", "indices"),
    [
        (None, [0, 1]),
        ("1", [1]),
        ("1,0", [1, 0]),
        ("0,7,1", [0]),  # CUDA stops at the first invalid entry
        ("", []),
        ("-1", []),
        ("GPU-bbbb", [1]),  # UUID prefixes, as CUDA accepts them
        ("GPU-bbbb2222-0000-0000-0000-000000000000,0", [1, 0]),
        ("GPU-ffff", []),
        ("0,0", [0]),
    ],
)
def test_inherited_cuda_visible_devices(visible: str | None, indices: list[int]) -> None:
    snapshot = monitor(FakeNvml(), visible).snapshot()
    assert [g.index for g in snapshot.gpus] == indices


def test_visible_devices_default_from_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    result = GpuMonitor(backend=FakeNvml())
    result._owner = owners
    assert [g.index for g in result.snapshot().gpus] == [1]


@pytest.mark.parametrize(
    ("code", "text"),
    [(12, "No NVIDIA driver found"), (9, "driver not loaded"), (999, "NVML unavailable")],
)
def test_no_driver_is_a_message_not_a_crash(code: int, text: str) -> None:
    snapshot = monitor(FakeNvml(init_error=code)).snapshot()
    assert snapshot.gpus == () and text in snapshot.driver_problem
    assert "CPU" in snapshot.driver_problem


def test_this_machine_without_driver() -> None:
    snapshot = GpuMonitor(visible_devices=None).snapshot()
    assert snapshot.driver_problem or snapshot.gpus  # either way: no exception


@pytest.mark.parametrize("failing", ["memory", "util", "temperature", "power", "processes"])
def test_errors_during_a_run_become_none(failing: str) -> None:
    code = pynvml.NVML_ERROR_GPU_IS_LOST if failing == "memory" else pynvml.NVML_ERROR_NOT_SUPPORTED
    snapshot = monitor(FakeNvml(fail={failing: code})).snapshot()
    gpu = snapshot.gpus[1]
    values = {
        "memory": gpu.memory_used_bytes,
        "util": gpu.utilization_percent,
        "temperature": gpu.temperature_c,
        "power": gpu.power_w,
        "processes": gpu.processes or None,
    }
    assert values.pop(failing) is None
    assert all(v is not None for v in values.values())


def test_lost_handle_gives_an_na_row() -> None:
    snapshot = monitor(FakeNvml(fail={"handle": pynvml.NVML_ERROR_GPU_IS_LOST})).snapshot()
    assert [(g.index, g.name, g.memory_used_bytes, g.lost) for g in snapshot.gpus] == [
        (0, "n/a", None, True), (1, "n/a", None, True),
    ]  # fmt: skip


def test_simulated_machine_follows_own_jobs() -> None:
    load = {1: [(4242, "python")]}
    snapshot = GpuMonitor(simulate=2, simulated_load=lambda: load).snapshot()
    assert snapshot.simulated and snapshot.driver_problem is None
    idle, busy = snapshot.gpus
    assert idle.name == "Simulated GPU 0" and idle.memory_total_bytes == 80 * GIB
    assert idle.utilization_percent == 0 and idle.processes == ()
    assert busy.utilization_percent > 20 and [p.pid for p in busy.processes] == [4242]
    assert all(p.is_mine for p in busy.processes)


def test_close_shuts_nvml_down_once() -> None:
    backend = FakeNvml()
    result = monitor(backend)
    result.snapshot()
    result.close()
    result.close()
    assert backend.shutdowns == 1


@pytest.mark.parametrize(
    ("value", "fmt", "text"), [(None, "{}", "n/a"), (41, "{} °C", "41 °C"), (1.5, "{:.1f}", "1.5")]
)
def test_fmt_na(value: object, fmt: str, text: str) -> None:
    assert fmt_na(value, fmt) == text


def test_parse_visible_devices() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices(" 0, 1 ") == ["0", "1"]
    assert parse_visible_devices("MIG-abc,0") == ["MIG-abc", "0"]
