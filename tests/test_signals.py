"""Stop safety (DESIGN §4): which pids get SIGUSR1, all or none — a table with a fake process
table, then the same promise against real processes (the fake trainer)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until

from app.services import launcher
from app.services.jobs import JobTracker
from app.services.registry import Job, ProcessRecord, Registry, SignalRecord
from app.services.signals import (
    ProcInfo,
    _sigcgt_has,
    is_launcher_cmdline,
    kill,
    plan_kill,
    plan_stop,
    proc_info,
    remember_workers,
    send_stop,
)
from trainer.schema import resolve_roots

ME = os.getuid()
HOST = socket.gethostname()
T_JOB = 1000.0
T_TOPOLOGY = 1005.0
PY = "/usr/bin/python3"


def worker(pid: int, ppid: int = 11, **changes: object) -> ProcInfo:
    base = ProcInfo(
        pid=pid, ppid=ppid, uid=ME, create_time=T_JOB + 1.0, name="python3",
        cmdline=[PY, "-m", "trainer", "D", "C", "0"], sigcgt_usr1=True, env_job_id="J",
        zombie=False,
    )  # fmt: skip
    return replace(base, **changes)


SUPERVISOR = worker(10, ppid=1, cmdline=[PY, "-m", "app.services.supervisor"], sigcgt_usr1=False)
SPAWN_PARENT = worker(11, ppid=10, cmdline=[PY, "-m", "trainer", "D", "C", "0", "-num_gpus", "2"])
TORCHRUN = worker(11, ppid=10, cmdline=[PY, "-m", "torch.distributed.run", "-m", "trainer"])
SINGLE = worker(11, ppid=10)


def job(mode: str, **changes: object) -> Job:
    base = Job(
        job_id="J", created_at=T_JOB, dataset="Dataset004_Demo", configuration="3d_fullres",
        fold="0", mode=mode, device="cuda", gpus=["0", "1"], simulated=False, argv=[], env={},
        run_dir="/nonexistent", console_path="/nonexistent/console.log",
        processes=[ProcessRecord(10, T_JOB + 1, "supervisor"),
                   ProcessRecord(11, T_JOB + 1, "trainer")],
    )  # fmt: skip
    return replace(base, **changes)


def topology(*pids: int, host: str = HOST) -> dict:
    ranks = [
        {"global_rank": r, "local_rank": r, "host": host, "pid": p, "device": f"cuda:{r}"}
        for r, p in enumerate(pids)
    ]
    return {"kind": "topology", "t": T_TOPOLOGY, "ranks": ranks}


def lookup(*infos: ProcInfo):
    table = {i.pid: i for i in infos}
    return table.get


# (name, mode, topology pids, process table, expected target pids or None, reason fragment)
CASES = [
    ("single", "single", (11,), (SUPERVISOR, SINGLE), [11], None),
    ("num_gpus: parent excluded", "spawn", (12, 13),
     (SUPERVISOR, SPAWN_PARENT, worker(12), worker(13)), [12, 13], None),
    ("torchrun: torchrun excluded", "torchrun", (12, 13),
     (SUPERVISOR, TORCHRUN, worker(12), worker(13)), [12, 13], None),
    ("num_gpus parent offered as a worker", "spawn", (11, 12),
     (SUPERVISOR, SPAWN_PARENT, worker(12)), None, "launcher"),
    ("torchrun offered as a worker", "torchrun", (11,),
     (SUPERVISOR, TORCHRUN), None, "launcher"),
    ("supervisor offered as a worker", "single", (10,), (SUPERVISOR, SINGLE), None, "launcher"),
    ("pid reused by another program after the topology", "spawn", (12, 13),
     (SUPERVISOR, SPAWN_PARENT, worker(12),
      worker(13, create_time=T_TOPOLOGY + 30, env_job_id=None, ppid=1, cmdline=["vim"])),
     None, "pid 13 (rank 1)"),
    ("pid reused: started before the job", "single", (11,),
     (SUPERVISOR, worker(11, create_time=T_JOB - 500, env_job_id=None)), None, "before this job"),
    ("another uid", "spawn", (12, 13),
     (SUPERVISOR, SPAWN_PARENT, worker(12), worker(13, uid=ME + 4242)), None, "another user"),
    ("handler not yet installed", "spawn", (12, 13),
     (SUPERVISOR, SPAWN_PARENT, worker(12), worker(13, sigcgt_usr1=False)), None, "no SIGUSR1"),
    ("zombie", "single", (11,), (SUPERVISOR, worker(11, zombie=True)), None, "zombie"),
    ("gone", "spawn", (12, 13), (SUPERVISOR, SPAWN_PARENT, worker(12)), None, "not running"),
    ("belongs to another job", "single", (11,),
     (SUPERVISOR, worker(11, env_job_id="OTHER")), None, "job OTHER"),
    ("no NNUI_JOB_ID, not a descendant", "spawn", (12,),
     (SUPERVISOR, SPAWN_PARENT, worker(12, env_job_id=None, ppid=1)), None, "NNUI_JOB_ID"),
    ("no NNUI_JOB_ID but a child of the job's trainer", "spawn", (12,),
     (SUPERVISOR, SPAWN_PARENT, worker(12, env_job_id=None, ppid=11)), [12], None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("mode", "pids", "table", "expected", "reason"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_stop_target_selection(mode, pids, table, expected, reason) -> None:
    plan = plan_stop(job(mode), topology(*pids), 7, proc_lookup=lookup(*table))
    if expected is None:
        assert not plan.ok and plan.targets == () and not plan.queued
        assert reason in plan.reason
    else:
        assert plan.ok, plan.reason
        assert [t.pid for t in plan.targets] == expected
        assert plan.epoch == 7


def test_no_topology_yet_queues_the_stop() -> None:
    plan = plan_stop(job("single"), None, None, proc_lookup=lookup(SUPERVISOR))
    assert (plan.ok, plan.queued, plan.targets) == (False, True, ())


def test_ended_job_is_not_stopped() -> None:
    plan = plan_stop(job("single", exit_code=0), topology(11), 3, proc_lookup=lookup(SINGLE))
    assert not plan.ok and not plan.queued and "ended" in plan.reason


def test_remote_ranks_are_left_to_the_local_ones() -> None:
    topo = topology(12, 13)
    topo["ranks"][1]["host"] = "elsewhere"
    plan = plan_stop(job("torchrun"), topo, 1, lookup(SUPERVISOR, TORCHRUN, worker(12)))
    assert plan.ok and [t.pid for t in plan.targets] == [12]


def test_recorded_create_time_catches_reuse() -> None:
    recorded = [*job("single").processes, ProcessRecord(11, T_JOB + 0.5, "worker", 0)]
    plan = plan_stop(job("single", processes=recorded), topology(11), 1, lookup(SINGLE))
    assert not plan.ok and "pid reused" in plan.reason


def test_second_stop_sends_nothing(tmp_path: Path) -> None:
    sent = [SignalRecord(T_TOPOLOGY + 1, 11, "SIGUSR1", 0, "sent")]
    plan = plan_stop(job("single", signals=sent), topology(11), 2, lookup(SINGLE))
    assert plan.ok and plan.already_signalled
    assert send_stop(plan, job("single"), Registry(tmp_path)) == []


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ([PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer"], True),
        (["/venv/bin/torchrun", "--standalone", "-m", "trainer"], True),
        ([PY, "-m", "trainer", "D", "C", "0", "-num_gpus", "2"], True),
        ([PY, "-m", "trainer", "D", "C", "0", "-num_gpus", "1"], False),
        ([PY, "-m", "trainer", "Dataset001_torchrun", "C", "0"], False),
        (
            [PY, "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"],
            False,
        ),
    ],
)
def test_launcher_cmdlines(cmdline: list[str], expected: bool) -> None:
    assert is_launcher_cmdline(cmdline) is bool(expected)


@pytest.mark.parametrize(
    ("sigcgt", "expected"), [("0000000000000200", True), ("0000000000004002", False)]
)
def test_sigcgt_bit_10_is_sigusr1(sigcgt: str, expected: bool) -> None:
    assert _sigcgt_has(f"Name:\tpython\nSigCgt:\t{sigcgt}\n", signal.SIGUSR1) is expected


# ---- real processes -----------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    values = fake_env(tmp_path)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def _launch(mode: str, gpus: list[str], extra: list[str]) -> tuple[Registry, Job]:
    registry = Registry()
    request = launcher.LaunchRequest(
        "4", "3d_fullres", ["0"], gpus, mode, "cpu", ["--epochs", "200", *extra], True
    )
    plans, problems = launcher.plan_launch(request, resolve_roots(), 2, registry=registry)
    assert problems == []
    return registry, launcher.start(plans[0], registry)


def _view(tracker: JobTracker, job_id: str):
    return next(v for v in tracker.refresh() if v.job.job_id == job_id)


@pytest.mark.parametrize("mode", ["per_gpu", "spawn"])
def test_real_stop_reaches_workers_only(env: dict, mode: str) -> None:
    gpus = ["0", "1"] if mode == "spawn" else ["0"]
    registry, job = _launch(mode, gpus, ["--epoch-time", "0.1"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    view = _view(tracker, job.job_id)
    plan = plan_stop(view.job, view.topology, view.epoch)
    assert plan.ok, plan.reason
    trainer = view.job.process("trainer")
    workers = {t.pid for t in plan.targets}
    assert len(workers) == len(gpus)
    assert (trainer.pid in workers) is (mode == "per_gpu")  # the -num_gpus parent is not a target
    records = send_stop(plan, view.job, registry)
    assert [r.result for r in records] == ["sent"] * len(gpus)
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 15)
    final = _view(tracker, job.job_id)
    assert (final.state, final.exit_code) == ("stopped", 0)
    assert [s.pid for s in registry.get(job.job_id).signals] == sorted(workers)
    # Pressing stop again: the job is over, nothing is planned or sent.
    again = plan_stop(final.job, final.topology, final.epoch)
    assert not again.ok and not again.queued


def test_real_process_without_handler_or_job_is_refused(env: dict, tmp_path: Path) -> None:
    registry, job = _launch("per_gpu", ["0"], ["--epoch-time", "0.1"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    job = registry.get(job.job_id)
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**os.environ, "NNUI_JOB_ID": job.job_id},
    )
    try:
        # (until exec, /proc shows the parent's environment)
        assert wait_until(
            lambda: getattr(proc_info(bystander.pid), "env_job_id", None) == job.job_id
        )
        # It carries the job id but has no handler: SIGUSR1 would kill it.
        fake_topology = {"kind": "topology", "t": time.time(), "ranks": [
            {"global_rank": 0, "local_rank": 0, "host": HOST, "pid": bystander.pid}]}  # fmt: skip
        plan = plan_stop(job, fake_topology, None)
        assert not plan.ok and "no SIGUSR1 handler" in plan.reason
        # Started after the topology was written: a reused pid, whatever it carries.
        old = dict(fake_topology, t=time.time() - 60)
        plan = plan_stop(job, old, None)
        assert not plan.ok and "pid reused" in plan.reason
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_real_queued_stop_is_delivered_once_topology_appears(env: dict) -> None:
    registry, job = _launch("per_gpu", ["0"], ["--start-delay", "1.5", "--epoch-time", "0.1"])
    plan = plan_stop(job, None, None)
    assert plan.queued
    registry.update(job.job_id, queued_stop=True)
    tracker = JobTracker(registry)
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 20)
    final = _view(tracker, job.job_id)
    assert (final.state, final.exit_code, final.job.queued_stop) == ("stopped", 0, False)
    assert any(s.result == "sent" for s in final.job.signals)


def test_real_kill_terms_the_job_tree(env: dict) -> None:
    registry, job = _launch("spawn", ["0", "1"], ["--epoch-time", "0.5"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    job = remember_workers(registry.get(job.job_id), _view(tracker, job.job_id).topology, registry)
    targets = {i.pid for i in plan_kill(job)}
    supervisor = job.process("supervisor").pid
    assert supervisor not in targets and job.process("trainer").pid in targets
    assert len(targets) >= 3  # parent + 2 ranks
    records = kill(job, registry, grace_s=3.0)
    assert {r.signal for r in records} <= {"SIGTERM", "SIGKILL"} and records
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 10)
    assert all(proc_info(pid) is None or proc_info(pid).zombie for pid in targets)
    assert _view(tracker, job.job_id).state == "failed"


def test_real_kill_escalates_to_sigkill_after_grace(env: dict) -> None:
    registry, job = _launch("per_gpu", ["0"], ["--epoch-time", "0.2", "--ignore-term"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    j = registry.get(job.job_id)
    assert {p.role for p in j.processes} == {"supervisor", "trainer", "worker"}
    assert [i.pid for i in plan_kill(j)] == [j.process("trainer").pid]  # not the supervisor
    records = kill(registry.get(job.job_id), registry, grace_s=0.5)
    assert [r.signal for r in records] == ["SIGTERM", "SIGKILL"], records
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 10)
    assert registry.get(job.job_id).exit_code == -signal.SIGKILL
    assert [s.signal for s in registry.get(job.job_id).signals] == ["SIGTERM", "SIGKILL"]
