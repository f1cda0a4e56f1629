"""The `--when-free` GPU rule as a table over NVML snapshots, the FIFO queue over it, and the
machine-wide claims (an flock that dies with its holder)."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.services.jobs.registry import Job, ProcessRecord
from app.services.machine.gpus import GIB, GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.supervisor.free_rule import Holder, WaitRule, choose
from app.services.supervisor.gpu_claims import GpuClaims, live_holders
from app.services.supervisor.waiting import queue_order, turn_choice

TOTAL = 80 * GIB


def gpu(index: int, used_gib: float = 0, util: int | None = 0, procs=()) -> GpuSnapshot:
    used = None if used_gib is None else int(used_gib * GIB)
    return GpuSnapshot(index, f"GPU {index}", f"GPU-{index}", used, TOTAL, util, 40, 60.0,
                       tuple(procs))  # fmt: skip


def bob(pid: int = 4411, gib: float = 37) -> GpuProcess:
    return GpuProcess(pid, "bob", int(gib * GIB), "python", False)


def mine(pid: int = 100, gib: float = 6) -> GpuProcess:
    return GpuProcess(pid, "me", int(gib * GIB), "python", True)


def machine(*gpus: GpuSnapshot) -> MachineSnapshot:
    return MachineSnapshot(tuple(gpus), False, None, 0.0)


DEFAULT = WaitRule()
ROOMY = WaitRule(min_free_gib=40, max_util_percent=50)
SHARING = WaitRule(min_free_gib=40, max_util_percent=50, share=True)
CLAIM = {"0": Holder("0101-f1-abc", "carol", 777)}

# (name, gpus, pool, group size, rule, claims, chosen GPUs or None, reason contains)
CASES = [
    ("idle GPU is free", [gpu(0)], ["0"], 1, DEFAULT, {}, ("0",), None),
    ("other user's process blocks", [gpu(0, 37, 90, [bob()])], ["0"], 1, DEFAULT, {}, None,
     "GPU 0: 37 GiB used by user bob (pid 4411)"),
    ("own job blocks by default", [gpu(0, 6, 85, [mine()])], ["0"], 1, DEFAULT, {}, None,
     "used by user me (pid 100)"),
    ("busy without a process listed", [gpu(0, 60, 95)], ["0"], 1, DEFAULT, {}, None, "busy"),
    ("takes the free one of a set", [gpu(0, 37, 90, [bob()]), gpu(1)], ["0", "1"], 1, DEFAULT,
     {}, ("1",), None),
    ("own process allowed under thresholds", [gpu(0, 6, 20, [mine()])], ["0"], 1, ROOMY, {},
     ("0",), None),
    ("other user refused under thresholds", [gpu(0, 6, 20, [bob(gib=6)])], ["0"], 1, ROOMY, {},
     None, "add --share"),
    ("--share allows another user", [gpu(0, 6, 20, [bob(gib=6)])], ["0"], 1, SHARING, {}, ("0",),
     None),
    ("too little free memory", [gpu(0, 50, 10, [mine(gib=50)])], ["0"], 1, ROOMY, {}, None,
     "30 GiB free < 40 GiB"),
    ("too high utilisation", [gpu(0, 6, 80, [mine()])], ["0"], 1, ROOMY, {}, None,
     "utilisation 80% > 50%"),
    ("memory reading n/a waits", [gpu(0, None, 0)], ["0"], 1, ROOMY, {}, None, "n/a"),
    ("claimed by a live nnui job", [gpu(0), gpu(1, 37, 90, [bob()])], ["0", "1"], 1, DEFAULT,
     CLAIM, None, "GPU 0: claimed by nnui job 0101-f1-abc of user carol (pid 777)"),
    ("claim on one, other free", [gpu(0), gpu(1)], ["0", "1"], 1, DEFAULT, CLAIM, ("1",), None),
    ("DDP group needs all free together", [gpu(0), gpu(1, 37, 90, [bob()])], ["0", "1"], 2,
     DEFAULT, {}, None, "GPU 1: 37 GiB used by user bob"),
    ("DDP group all free", [gpu(0), gpu(1)], ["0", "1"], 2, DEFAULT, {}, ("0", "1"), None),
    ("DDP group with one claimed", [gpu(0), gpu(1)], ["0", "1"], 2, DEFAULT, CLAIM, None,
     "claimed by nnui job"),
    ("GPU not on this machine", [gpu(0)], ["3"], 1, DEFAULT, {}, None, "GPU 3: not visible"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "pool", "size", "rule", "holders", "chosen", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_gpu_rule_table(gpus, pool, size, rule, holders, chosen, reason) -> None:
    choice = choose(machine(*gpus), pool, size, rule, holders)
    assert choice.gpus == chosen
    if reason is None:
        assert choice.reason is None
    else:
        assert reason in (choice.reason or "")


def test_no_driver_waits_with_the_reason() -> None:
    snapshot = MachineSnapshot((), False, "No NVIDIA driver found", 0.0)
    assert choose(snapshot, ["0"], 1, DEFAULT).reason == "No NVIDIA driver found"


def waiting_job(job_id: str, created_at: float, pool: list[str], priority: int = 0,
                mode: str = "single") -> Job:  # fmt: skip
    return Job(job_id, created_at, "D", "3d_fullres", "0", mode, "cuda", list(pool), False, [], {},
               "/nowhere", "/nowhere/console.log", when_free=True, gpu_pool=list(pool),
               priority=priority)  # fmt: skip


def test_fifo_per_user_with_priority() -> None:
    first = waiting_job("a", 1.0, ["0", "1"])
    second = waiting_job("b", 2.0, ["0", "1"])
    urgent = waiting_job("c", 3.0, ["0", "1"], priority=5)
    started = waiting_job("d", 0.5, ["0"])
    started.processes.append(ProcessRecord(1, 0.0, "trainer"))
    queue = queue_order([second, started, urgent, first])
    assert [j.job_id for j in queue] == ["c", "a", "b"]  # a running job is no longer waiting
    one_free = machine(gpu(0), gpu(1, 37, 90, [bob()]))
    alive = lambda job: True  # noqa: E731
    assert turn_choice(urgent, queue, one_free, {}, alive).gpus == ("0",)
    behind = turn_choice(first, queue, one_free, {}, alive)
    assert behind.gpus is None and "earlier job" in (behind.reason or "")
    both_free = machine(gpu(0), gpu(1))
    assert turn_choice(first, queue, both_free, {}, alive).gpus == ("1",)
    assert turn_choice(second, queue, both_free, {}, alive).gpus is None
    # A job ahead whose supervisor is gone takes nothing.
    dead_ahead = lambda job: job.job_id != "c"  # noqa: E731
    assert turn_choice(first, queue, one_free, {}, dead_ahead).gpus == ("0",)


def test_a_ddp_group_ahead_does_not_block_a_fold_elsewhere() -> None:
    group = waiting_job("g", 1.0, ["0", "1"], mode="spawn")
    fold = waiting_job("f", 2.0, ["2"])
    snapshot = machine(gpu(0), gpu(1, 37, 90, [bob()]), gpu(2))
    queue = queue_order([group, fold])
    assert turn_choice(fold, queue, snapshot, {}, lambda job: True).gpus == ("2",)


# ---- machine-wide claims ------------------------------------------------------------------

HOLD = """
import sys, time
from pathlib import Path
from app.services.supervisor.gpu_claims import GpuClaims
claims = GpuClaims(Path(sys.argv[1]))
assert claims.try_claim(("1",), "job-x")
print("held", flush=True)
time.sleep(600)
"""


def test_claims_exclusive_and_released_when_the_holder_dies(tmp_path: Path) -> None:
    folder = tmp_path / "claims"
    root = str(Path(__file__).resolve().parents[3])
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": root}, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        held = live_holders(["0", "1"], folder)
        assert list(held) == ["1"] and held["1"].job_id == "job-x"
        assert held["1"].pid == holder.pid
        mine = GpuClaims(folder)
        assert not mine.try_claim(("0", "1"), "job-y")  # a group: all or none
        assert mine.held == {}
        assert mine.try_claim(("0",), "job-y")
        assert "0" not in live_holders(["0"], folder, mine=mine)
        holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the flock
        holder.wait()
        assert live_holders(["1"], folder) == {}
        assert mine.try_claim(("1",), "job-y")
        mine.release()
        assert live_holders(["0", "1"], folder) == {}
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert oct(folder.stat().st_mode & 0o7777) == "0o1777"


def _hold_as(uid: int, folder: Path, gpus: tuple[str, ...], ready: int) -> None:
    """In a forked child: become `uid`, claim `gpus`, report, and wait to be killed."""
    try:
        os.setgid(uid)
        os.setuid(uid)
        ok = GpuClaims(folder).try_claim(gpus, "job-of-nobody")
        os.write(ready, b"1" if ok else b"0")
        while True:
            time.sleep(60)
    finally:
        os._exit(1)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A folder every user can reach (pytest's own tmp_path is private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="nnui-claims-test-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_two_users_never_claim_the_same_gpu(shared_tmp: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    folder = shared_tmp / "claims"
    mine = GpuClaims(folder)
    assert mine.try_claim(("0",), "job-of-root")  # root's lock file: read-only for nobody
    mine.release()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        _hold_as(nobody, folder, ("0", "1"), write_end)
    os.close(write_end)  # a child that died before reporting: EOF, not a hang
    try:
        assert os.read(read_end, 1) == b"1"  # flock on a read-only descriptor is enough
        held = live_holders(["0", "1"], folder)
        assert {g: (h.user, h.pid) for g, h in held.items()} == {
            "0": ("nobody", child),
            "1": ("nobody", child),
        }
        assert not mine.try_claim(("0",), "job-of-root")
        assert not mine.try_claim(("1",), "job-of-root")
        assert (folder / "gpu-1.lock").stat().st_uid == nobody
    finally:
        os.kill(child, signal.SIGKILL)  # the forked child, by its pid
        os.waitpid(child, 0)
        os.close(read_end)
    assert mine.try_claim(("0", "1"), "job-of-root")  # its claims died with it
    mine.release()


def test_a_claim_outside_my_set_still_decides_who_is_ahead() -> None:
    ahead = waiting_job("a", 1.0, ["0", "1"])
    me = waiting_job("b", 2.0, ["1"])
    both_free = machine(gpu(0), gpu(1))
    queue = queue_order([ahead, me])
    assert turn_choice(me, queue, both_free, {}, lambda job: True).gpus == ("1",)
    # GPU 0 is claimed by another user's job: the job ahead gets GPU 1, so I wait.
    waits = turn_choice(me, queue, both_free, CLAIM, lambda job: True)
    assert waits.gpus is None and "next for an earlier job" in (waits.reason or "")
