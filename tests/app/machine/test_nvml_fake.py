"""nnui against NVML's C boundary: a fake libnvidia-ml.so.1 (tests/fake_nvml/fake_nvml.c),
built here with the system C compiler and called through the real nvidia-ml-py, so the
versioned symbols, the structs, the error codes and the process-list resize protocol are
those of a real driver. The machine is an 8 x H200 box the tests change while nnui reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_nvml.fixtures import *  # noqa: F403 (pytest fixtures: fake_library, machine, other_user)
from fake_nvml.scenario import (
    DRIVER_NOT_LOADED,
    GIB,
    GPU_IS_LOST,
    NOT_SUPPORTED,
    FakeMachine,
    h200,
    h200_box,
)
from fake_trainer import cleanup_jobs, fake_env

from app.services.launch.busy_gpus import occupied_note
from app.services.machine.gpus import GpuMonitor
from app.services.machine.nvml import ORDER_NOTE
from app.services.supervisor.free_rule import WaitRule, blocker
from app.widgets.gpu_panel import CardOptions, GpuPanel, gpu_lines

REPO = Path(__file__).resolve().parents[3]
MIG_UUIDS = [f"MIG-{k}{k}{k}{k}c0de-0000-4000-8000-00000000000{k}" for k in range(3)]


def monitor(fake: FakeMachine) -> GpuMonitor:
    return GpuMonitor(backend=fake.nvml, visible_devices=None)


def mig_box() -> dict:
    """GPU 2 partitioned in three MIG devices (3g.71gb, 2x 1g.18gb); one runs a job."""
    box = h200_box()
    migs = [
        {"slot": 0, "uuid": MIG_UUIDS[0], "mem_total": 71 * GIB, "mem_used": 30 * GIB},
        {"slot": 1, "uuid": MIG_UUIDS[1], "mem_total": 18 * GIB, "mem_used": 0},
        {"slot": 2, "uuid": MIG_UUIDS[2], "mem_total": 18 * GIB, "mem_used": 0},
    ]
    box["gpus"][2] = h200(2, mig=1, migs=migs, procs=[{"pid": 4242, "used": 30 * GIB, "mig": 0}])
    return box


def test_eight_h200s_with_their_numbers(machine: FakeMachine) -> None:
    box = h200_box()
    box["gpus"][3].update(mem_used=40 * GIB, util=87, temp=71, power_mw=612_345, fan=45)
    machine.write(box)
    snapshot = monitor(machine).snapshot()
    assert snapshot.driver_problem is None and snapshot.order_note is None
    assert [g.index for g in snapshot.gpus] == list(range(8))
    assert [g.slot for g in snapshot.slots] == [str(i) for i in range(8)]
    gpu = snapshot.gpu(3)
    assert (gpu.name, gpu.uuid) == ("NVIDIA H200", box["gpus"][3]["uuid"])
    assert (gpu.memory_used_bytes, gpu.memory_total_bytes) == (40 * GIB, 143771 * 2**20)
    assert (gpu.utilization_percent, gpu.temperature_c, gpu.fan_percent) == (87, 71, 45)
    assert (gpu.power_w, gpu.power_limit_w) == (612.345, 700.0)
    assert gpu.pci_bus_id == "00000000:48:00.0" and gpu.busy and not gpu.lost
    assert snapshot.gpu(0).fan_percent is None  # passively cooled: "not supported"
    # NVML was asked by its versioned names, and each process list by its resize protocol.
    names = {name for name, _ in machine.calls()}
    assert {"nvmlInitWithFlags", "nvmlDeviceGetCount_v2", "nvmlDeviceGetHandleByIndex_v2",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetPciInfo_v3"} <= names  # fmt: skip


def test_cuda_indices_follow_the_pci_order(machine: FakeMachine) -> None:
    """Jobs run with CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA index n is the n-th bus id. A driver
    that enumerated otherwise would still put each job on the GPU shown under its index."""
    box = h200_box(4)
    box["gpus"].reverse()  # NVML index 0 is the highest bus id
    machine.write(box)
    snapshot = monitor(machine).snapshot()
    buses = [g.pci_bus_id for g in snapshot.gpus]
    assert buses == sorted(buses) and [g.index for g in snapshot.gpus] == [0, 1, 2, 3]
    assert snapshot.gpu(0).uuid == h200(0)["uuid"] and snapshot.order_note == ORDER_NOTE
    assert GpuPanel().banner_for(snapshot).plain == ORDER_NOTE  # said on the board
    shown = GpuMonitor(backend=machine.nvml, visible_devices="1").snapshot()
    assert [g.uuid for g in shown.gpus] == [h200(1)["uuid"]]  # CUDA's index 1


def test_other_users_process_by_name(machine: FakeMachine, other_user: tuple[int, str]) -> None:
    pid, user = other_user
    box = h200_box()
    box["gpus"][1]["procs"] = [{"pid": pid, "used": 80 * GIB}]
    box["gpus"][1]["mem_used"] = 81 * GIB
    machine.write(box)
    gpu = monitor(machine).snapshot().gpu(1)
    (process,) = gpu.processes
    assert (process.pid, process.user, process.is_mine) == (pid, user, False)
    assert process.used_memory_bytes == 80 * GIB and gpu.other_users == (user,)
    assert f"{user} pid {pid} 80 GiB" in occupied_note("1", gpu)
    assert f"used by user {user} (pid {pid})" in blocker(gpu, WaitRule())


def test_unsupported_fields_read_na(machine: FakeMachine) -> None:
    box = h200_box()
    box["gpus"][4].update(procs=[{"pid": os.getpid(), "used": -1}])  # memory not available
    box["errors"] = [
        {"gpu": 4, "fn": name, "code": NOT_SUPPORTED}
        for name in ("nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
                     "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetEnforcedPowerLimit")
    ]  # fmt: skip
    machine.write(box)
    gpu = monitor(machine).snapshot().gpu(4)
    assert (gpu.temperature_c, gpu.power_w, gpu.power_limit_w) == (None, None, None)
    assert (gpu.utilization_percent, gpu.fan_percent) == (None, None)
    assert gpu.memory_total_bytes == 143771 * 2**20 and not gpu.lost
    (process,) = gpu.processes
    assert process.is_mine and process.used_memory_bytes is None
    text = gpu_lines(gpu, options=CardOptions(width=200)).plain
    assert "UTL ············ n/a  temp n/a  power n/a" in text


def test_process_list_that_grows_between_the_two_calls(machine: FakeMachine) -> None:
    box = h200_box(2)
    box["gpus"][0].update(procs=[{"pid": os.getpid(), "used": GIB}], grow=20)
    machine.write(box)
    gpu = monitor(machine).snapshot().gpu(0)
    assert len(gpu.processes) == 21  # the 20 that started meanwhile are there too
    lists = [c for f, c in machine.calls() if f == "nvmlDeviceGetComputeRunningProcesses_v3"]
    # size query (7), fill too small (7: it grew), size query again (7), fill (0); GPU 1: 0
    assert lists == [7, 7, 7, 0, 0], lists


def test_mig_devices_are_the_slots_of_a_partitioned_gpu(machine: FakeMachine) -> None:
    machine.write(mig_box())
    snapshot = monitor(machine).snapshot()
    parent = snapshot.gpu(2)
    assert parent.mig_enabled and [d.uuid for d in parent.mig] == MIG_UUIDS
    assert [s.slot for s in snapshot.slots] == ["0", "1", *MIG_UUIDS, *map(str, range(3, 8))]
    big = snapshot.slot(MIG_UUIDS[0])
    assert (big.parent_index, big.mig_position) == (2, 0)
    assert (big.memory_used_bytes, big.memory_total_bytes) == (30 * GIB, 71 * GIB)
    assert [p.pid for p in big.processes] == [4242] and big.utilization_percent is None
    assert snapshot.slot(MIG_UUIDS[1]).processes == ()
    text = gpu_lines(parent, options=CardOptions(width=200)).plain
    assert "MIG: partitioned in 3" in text and all(u in text for u in MIG_UUIDS)
    lines = text.splitlines()
    assert [x.split()[:2] for x in lines[1:4]] == [["MIG", "0"], ["MIG", "1"], ["MIG", "2"]]
    assert "1 proc" in lines[1] and lines[2].endswith("idle")


def test_mig_devices_of_a_lost_gpu_are_lost_too(machine: FakeMachine) -> None:
    reader = monitor(machine)
    reader.snapshot()
    box = mig_box()
    machine.write(box)
    assert not reader.snapshot().slot(MIG_UUIDS[0]).lost
    box["errors"] = [{"gpu": 2, "fn": "*", "code": GPU_IS_LOST}]
    machine.write(box)
    snapshot = reader.snapshot()
    assert snapshot.gpu(2).lost and snapshot.gpu(2).mig_enabled
    assert [(d.uuid, d.lost) for d in snapshot.gpu(2).mig] == [(u, True) for u in MIG_UUIDS]
    assert "lost with its GPU" in gpu_lines(snapshot.gpu(2), options=CardOptions()).plain


@pytest.mark.parametrize("failing", ["*", "nvmlDeviceGetMemoryInfo"])
def test_gpu_lost_mid_run(machine: FakeMachine, failing: str) -> None:
    """Lost: every call answers GPU_IS_LOST (the handle too), or a reading does first."""
    reader = monitor(machine)
    before = reader.snapshot()
    box = h200_box()
    box["gpus"][5]["util"] = 55
    box["errors"] = [{"gpu": 5, "fn": failing, "code": GPU_IS_LOST}]  # Xid 79: off the bus
    machine.write(box)
    after = reader.snapshot()
    lost = after.gpu(5)
    assert lost.lost and lost.uuid == before.gpu(5).uuid  # still named: which one it was
    assert lost.memory_used_bytes is None
    assert [g.index for g in after.gpus if g.lost] == [5]
    assert all(g.memory_total_bytes for g in after.gpus if g.index != 5)  # the rest reads
    text = gpu_lines(lost, options=CardOptions(width=200)).plain
    assert "LOST" in text and "GPU is lost" in text
    assert "lost" in blocker(lost, WaitRule())
    box["errors"] = []  # reset by the admin: back
    machine.write(box)
    assert not reader.snapshot().gpu(5).lost


def _nnui(machine: FakeMachine, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **fake_env(tmp_path), **machine.env(), "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    argv = [sys.executable, "-m", "app.main", *args]
    try:
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    finally:
        cleanup_jobs(tmp_path / "state")


def test_cli_without_a_driver_says_why(machine: FakeMachine, tmp_path: Path) -> None:
    machine.write({"gpus": [], "errors": [{"gpu": -1, "fn": "nvmlInitWithFlags",
                                           "code": DRIVER_NOT_LOADED}]})  # fmt: skip
    done = _nnui(machine, tmp_path, "launch", "4", "3d_fullres", "--folds", "0", "--gpus", "0")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert errors == ["error: NVIDIA driver not loaded — jobs can run on CPU (use --cpu)"]
    machine.library.rename(machine.library.with_suffix(".off"))  # no library at all
    try:
        done = _nnui(machine, tmp_path, "launch", "4", "3d_fullres", "--folds", "0", "--gpus", "0")
    finally:
        machine.library.with_suffix(".off").rename(machine.library)
    assert done.returncode != 0 and "No NVIDIA driver found" in done.stderr


def test_cli_refuses_lost_busy_and_partitioned_gpus(
    machine: FakeMachine, tmp_path: Path, other_user: tuple[int, str]
) -> None:
    pid, user = other_user
    box = mig_box()
    box["gpus"][1].update(procs=[{"pid": pid, "used": 80 * GIB}], mem_used=81 * GIB, util=99)
    box["errors"] = [{"gpu": 5, "fn": "*", "code": GPU_IS_LOST}]
    machine.write(box)
    launch = ("launch", "4", "3d_fullres", "--folds", "0", "--gpus")
    busy = _nnui(machine, tmp_path, *launch, "1")
    assert busy.returncode != 0 and f"{user} pid {pid} 80 GiB" in busy.stderr
    lost = _nnui(machine, tmp_path, *launch, "5")
    assert lost.returncode != 0 and "GPU 5 is lost" in lost.stderr
    parent = _nnui(machine, tmp_path, *launch, "2")
    assert parent.returncode != 0 and "GPU 2 is partitioned (MIG)" in parent.stderr
    assert MIG_UUIDS[1] in parent.stderr
    dry = _nnui(machine, tmp_path, *launch, MIG_UUIDS[1], "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"CUDA_VISIBLE_DEVICES={MIG_UUIDS[1]}" in dry.stdout
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in dry.stdout
