"""Stop safety (docs/contract.md): which pids get SIGUSR1, all or none — a table with a fake process
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

from app.services.jobs.liveness import record_alive
from app.services.jobs.registry import Job, ProcessRecord, Registry, SignalRecord
from app.services.jobs.views import JobTracker
from app.services.launch import launcher
from app.services.launch import request as launch_request
from app.services.machine.procs import (
    ProcInfo,
    is_same_process,
    proc_info,
    process_start_ticks,
    process_table,
    sigcgt_has,
)
from app.services.signals.proctree import process_tree
from app.services.signals.send import kill, remember_workers, send_stop
from app.services.signals.targets import is_launcher_cmdline, plan_kill, plan_stop
from trainer.schema.tree import resolve_roots

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
    # An old record (no start_ticks): wall-clock start time, 1 s tolerance.
    recorded = [*job("single").processes, ProcessRecord(11, T_JOB - 0.5, "worker", 0)]
    plan = plan_stop(job("single", processes=recorded), topology(11), 1, lookup(SINGLE))
    assert not plan.ok and "pid reused" in plan.reason


# (recorded create_time, recorded start_ticks, live create_time, live start_ticks, same?)
IDENTITY_CASES = [
    (T_JOB + 1.0, 500, T_JOB + 1.7, 500, True),  # wall clock adjusted by 0.7 s: same process
    (T_JOB + 1.0, 500, T_JOB - 30.0, 500, True),  # even a big clock step does not matter
    (T_JOB + 1.0, 500, T_JOB + 1.0, 501, False),  # pid reused within the same second
    (T_JOB + 1.0, None, T_JOB + 1.7, 500, True),  # old record: create_time within 1 s
    (T_JOB + 1.0, None, T_JOB + 2.5, 500, False),  # old record: too far apart
    (T_JOB + 1.0, 500, T_JOB + 1.7, None, True),  # ticks unreadable: fall back to time
]


@pytest.mark.parametrize(("rec_t", "rec_ticks", "live_t", "live_ticks", "same"), IDENTITY_CASES)
def test_identity_is_start_ticks_and_survives_clock_drift(
    rec_t: float, rec_ticks: int | None, live_t: float, live_ticks: int | None, same: bool
) -> None:
    live = worker(11, ppid=10, create_time=live_t, start_ticks=live_ticks)
    record = ProcessRecord(11, rec_t, "trainer", None, rec_ticks)
    assert is_same_process(11, rec_t, lookup(live), rec_ticks) is same
    assert record_alive(record, lookup(live)) is same
    # The stop check of a recorded worker follows the same rule (topology written 5 s later).
    recorded = [ProcessRecord(10, T_JOB + 1, "supervisor"), replace(record, role="worker", rank=0)]
    plan = plan_stop(job("single", processes=recorded), topology(11), 1, lookup(live))
    if same and live_t >= T_JOB - 2:
        assert plan.ok, plan.reason
        assert plan.targets[0].start_ticks == live_ticks
    elif not same:
        assert not plan.ok and "pid reused" in plan.reason


def test_real_start_ticks_are_stable_and_exact() -> None:
    me = proc_info(os.getpid())
    assert me is not None and me.start_ticks == process_start_ticks(os.getpid())
    record = ProcessRecord(os.getpid(), me.create_time + 0.7, "trainer", None, me.start_ticks)
    assert record_alive(record)  # drifted wall-clock start time, same ticks
    assert not record_alive(replace(record, start_ticks=me.start_ticks + 1))


def test_a_zombie_or_a_gone_child_is_not_alive() -> None:
    """The cheap liveness read (/proc/PID/stat) agrees with proc_info: an exited child not
    yet reaped is a zombie, a reaped one is gone; both are dead to the board."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = process_start_ticks(child.pid)
    record = ProcessRecord(child.pid, 0.0, "trainer", None, ticks)
    wait_until(lambda: (info := proc_info(child.pid)) is not None and info.zombie)
    assert not record_alive(record)
    child.wait()
    assert not record_alive(record)


def test_process_table_roots_bring_their_descendants() -> None:
    """roots= keeps the matching processes and everything below them (a worker forked by
    the run, whatever its argv), and nothing else."""
    marker = f"nnui-roots-{os.getpid()}"
    code = (
        "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
        "'import sys; sys.stdin.read()'], stdin=subprocess.PIPE); print(c.pid, flush=True); "
        "sys.stdin.read(); c.communicate(b'')"
    )
    parent = subprocess.Popen([sys.executable, "-c", code, marker], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        child = int(parent.stdout.readline())
        by_pid: dict = {}

        def both_listed() -> bool:
            # The child's pid is known from its fork on; while it is still exec'ing its
            # /proc entry has no cmdline yet and the table rightly skips it for that read.
            nonlocal by_pid
            by_pid = {row.pid: row for row in process_table(roots=lambda a: marker in a)}
            return set(by_pid) == {parent.pid, child}

        assert wait_until(both_listed), set(by_pid)
        assert by_pid[child].ppid == parent.pid and marker not in by_pid[child].cmdline
        assert by_pid[parent.pid].start_ticks == process_start_ticks(parent.pid)
    finally:
        parent.communicate("")
    assert not process_table(roots=lambda argv: marker in argv)


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
    assert sigcgt_has(f"Name:\tpython\nSigCgt:\t{sigcgt}\n", signal.SIGUSR1) is expected


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
    request = launch_request.LaunchRequest(
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
    assert _view(tracker, job.job_id).state == "killed"  # by the user, not a failure


def test_real_kill_escalates_to_sigkill_after_grace(env: dict) -> None:
    registry, job = _launch("per_gpu", ["0"], ["--epoch-time", "0.2", "--ignore-term"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    # The supervisor records the worker once it sees the topology (looking never writes).
    roles = {"supervisor", "trainer", "worker"}
    assert wait_until(lambda: {p.role for p in registry.get(job.job_id).processes} == roles, 15)
    j = registry.get(job.job_id)
    assert [i.pid for i in plan_kill(j)] == [j.process("trainer").pid]  # not the supervisor
    records = kill(registry.get(job.job_id), registry, grace_s=0.5)
    assert [r.signal for r in records] == ["SIGTERM", "SIGKILL"], records
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 10)
    assert registry.get(job.job_id).exit_code == -signal.SIGKILL
    assert [s.signal for s in registry.get(job.job_id).signals] == ["SIGTERM", "SIGKILL"]


def test_real_process_tree_labels_roles_of_a_two_rank_job(env: dict) -> None:
    registry, job = _launch("spawn", ["0", "1"], ["--epoch-time", "0.2"])
    tracker = JobTracker(registry)
    assert wait_until(lambda: _view(tracker, job.job_id).topology is not None, 15)
    view = _view(tracker, job.job_id)
    job = registry.get(job.job_id)
    # Every record carries the exact identity (start ticks since boot).
    assert all(p.start_ticks is not None for p in job.processes), job.processes
    ranks = {r["pid"]: r for r in view.topology["ranks"]}
    for tree in (process_tree(job, view.topology), process_tree(job)):  # topology read from disk
        by_pid = {n.pid: n for n in tree}
        assert by_pid[job.process("supervisor").pid].role == "supervisor"
        parent = by_pid[job.process("trainer").pid]
        assert (parent.role, parent.ppid) == ("spawn parent", job.process("supervisor").pid)
        for pid, entry in ranks.items():
            node = by_pid[pid]
            assert (node.role, node.rank, node.ppid) == ("rank", entry["global_rank"], parent.pid)
            assert node.label == f"rank {entry['global_rank']} ({entry['device']})"
        assert {n.role for n in tree} <= {"supervisor", "spawn parent", "rank", "loader worker",
                                          "other"}  # fmt: skip
    # An unrelated process of ours (not recorded, not a descendant, not a rank) is left out.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert stranger.pid not in {n.pid for n in process_tree(job, view.topology)}
    finally:
        stranger.kill()
        stranger.wait()


# ---- bad pids and malformed topologies: data errors, never targets, never tracebacks -------

BAD_PIDS = [0, -1, -11, True, "11", 11.0, None, 10**30, [11]]


@pytest.mark.parametrize("bad", BAD_PIDS, ids=[repr(b)[:12] for b in BAD_PIDS])
def test_bad_topology_pid_is_a_data_error(bad: object) -> None:
    topo = topology(12, 13)
    topo["ranks"][1]["pid"] = bad
    table = lookup(SUPERVISOR, SPAWN_PARENT, worker(12), worker(13))
    plan = plan_stop(job("spawn"), topo, 1, proc_lookup=table)
    assert not plan.ok and plan.targets == () and "malformed" in plan.reason
    assert proc_info(bad) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "topo",
    [
        {"kind": "topology", "t": T_TOPOLOGY, "ranks": "all"},
        {"kind": "topology", "t": "later", "ranks": [{"pid": 11, "global_rank": 0}]},
        {"kind": "topology", "t": T_TOPOLOGY, "ranks": [{"pid": 11, "global_rank": "abc"}]},
        {"kind": "topology", "t": T_TOPOLOGY, "ranks": [{"pid": 11, "local_rank": -3}]},
        {"kind": "topology", "t": T_TOPOLOGY, "ranks": [None, 5, "x"]},
        {"kind": "topology", "t": float("nan"), "ranks": [{"pid": 11}]},
        "not even a dict",
    ],
)
def test_malformed_topology_sends_nothing(topo: object, tmp_path: Path) -> None:
    plan = plan_stop(job("single"), topo, 1, proc_lookup=lookup(SUPERVISOR, SINGLE))  # type: ignore[arg-type]
    assert not plan.ok and plan.targets == ()
    registry = Registry(tmp_path)
    registry.add(job("single", run_dir=str(tmp_path)))
    assert remember_workers(job("single"), topo, registry, lookup(SUPERVISOR, SINGLE)).processes \
        == job("single").processes  # fmt: skip


# Named ids: pytest-xdist workers must collect the same test names (the pid differs).
@pytest.mark.parametrize("bad", [0, -1, -os.getpid()], ids=["0", "-1", "-own pid"])
def test_send_refuses_non_pids_without_signalling(bad: int) -> None:
    from app.services.signals.send import _send

    # os.kill(0 | -N) would signal this very process group: it must never be reached.
    assert _send(bad, 0.0, signal.SIGTERM).startswith("refused")


# ---- kill: the stop's identity checks (a registry record proves nothing) --------------------

TRAINER = worker(11, ppid=10)
NO_SCAN = lambda job_id: []  # noqa: E731 - no /proc sweep in the table tests

# (name, process table, recorded processes, expected targets, expected refused pids, fragment)
KILL_CASES = [
    ("the job's tree", (SUPERVISOR, TRAINER, worker(12, ppid=11), worker(13, ppid=11)),
     None, [11, 12, 13], [], None),
    ("forged record: a process without the job id", (SUPERVISOR, worker(11, env_job_id=None)),
     None, [], [11], "NNUI_JOB_ID"),
    ("forged record: another job's process", (SUPERVISOR, worker(11, env_job_id="OTHER")),
     None, [], [11], "job OTHER"),
    ("child without env of a trainer that carries the id",
     (SUPERVISOR, TRAINER, worker(12, ppid=11, env_job_id=None)), None, [11, 12], [], None),
    ("child without env of a forged trainer", (SUPERVISOR, worker(11, env_job_id=None),
     worker(12, ppid=11, env_job_id=None)), None, [], [11, 12], "NNUI_JOB_ID"),
    ("a child older than the job (pid reused)", (SUPERVISOR, TRAINER,
     worker(12, ppid=11, create_time=T_JOB - 100)), None, [11], [12], "before this job"),
    ("a child of another user", (SUPERVISOR, TRAINER, worker(12, ppid=11, uid=ME + 4242)), None,
     [11], [12], "another user"),
    ("zombie is skipped", (SUPERVISOR, worker(11, zombie=True)), None, [], [], None),
    ("no trainer yet: the supervisor", (SUPERVISOR,),
     [ProcessRecord(10, T_JOB + 1, "supervisor")], [10], [], None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("table", "records", "targets", "refused", "fragment"),
    [c[1:] for c in KILL_CASES],
    ids=[c[0] for c in KILL_CASES],
)
def test_kill_target_selection(table, records, targets, refused, fragment) -> None:
    from app.services.signals.targets import kill_plan

    changes = {} if records is None else {"processes": records}
    kids = {11: [p.pid for p in table if p.ppid == 11]}
    plan = kill_plan(job("spawn", **changes), lookup(*table), lambda pid: kids.get(pid, []),
                     NO_SCAN)  # fmt: skip
    assert sorted(i.pid for i in plan.targets) == targets
    assert sorted(pid for pid, _ in plan.refused) == refused
    if fragment is not None:
        assert all(fragment in why for _, why in plan.refused), plan.refused
    assert 10 in {i.pid for i in plan.targets} or records is None  # supervisor kept otherwise


def test_kill_sweeps_an_unrecorded_trainer_carrying_the_job_id() -> None:
    from app.services.signals.targets import kill_plan

    recorded = [ProcessRecord(10, T_JOB + 1, "supervisor")]  # trainer not recorded yet
    table = lookup(SUPERVISOR, TRAINER, worker(99, env_job_id="OTHER"))
    plan = kill_plan(job("single", processes=recorded), table, lambda pid: [], lambda j: [11, 99])
    assert sorted(i.pid for i in plan.targets) == [10, 11]
    assert [pid for pid, _ in plan.refused] == [99]


def _bystander(job_id: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "NNUI_JOB_ID"}
    if job_id is not None:
        env["NNUI_JOB_ID"] = job_id
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    # until exec, /proc shows the parent's environment
    assert wait_until(lambda: getattr(proc_info(process.pid), "env_job_id", 0) == job_id)
    return process


@pytest.mark.parametrize("carries", [None, "1130-120000-f0-zzz"], ids=["no job id", "other job"])
def test_real_kill_refuses_a_forged_record(tmp_path: Path, carries: str | None) -> None:
    registry = Registry(tmp_path)
    bystander = _bystander(carries)
    try:
        ticks = process_start_ticks(bystander.pid)
        info = proc_info(bystander.pid)
        forged = Job(
            job_id="1130-120000-f0-abc", created_at=info.create_time - 1, dataset="D",
            configuration="C", fold="0", mode="single", device="cpu", gpus=[], simulated=False,
            argv=[], env={}, run_dir=str(tmp_path), console_path=str(tmp_path / "console.log"),
            processes=[ProcessRecord(bystander.pid, info.create_time, "trainer", None, ticks),
                       ProcessRecord(bystander.pid, info.create_time, "worker", 0, ticks)],
        )  # fmt: skip
        registry.add(forged)
        assert plan_kill(forged) == []
        records = kill(forged, registry, grace_s=0.5)
        assert [(r.pid, r.result.split(":")[0]) for r in records] == [(bystander.pid, "refused")]
        assert bystander.poll() is None  # never signalled
        job_after = registry.get(forged.job_id)
        assert job_after.killed_at is None and job_after.exit_code is None
    finally:
        bystander.kill()
        bystander.wait()


def test_real_kill_in_the_supervisors_first_second_ends_killed(env: dict) -> None:
    from app.services.jobs.job_state import derive_state
    from app.services.machine.procs import pids_with_job_id

    registry = Registry()
    request = launch_request.LaunchRequest(
        "4", "3d_fullres", ["0"], ["0"], "per_gpu", "cpu", ["--epochs", "200"], True
    )
    plans, problems = launcher.plan_launch(request, resolve_roots(), 2, registry=registry)
    assert problems == []
    job = launcher.start(plans[0], registry)  # the supervisor is still starting up
    records = kill(job, registry, grace_s=3.0)
    assert records and all(r.result == "sent" for r in records if r.signal == "SIGTERM")
    final = registry.get(job.job_id)
    assert final.exit_code is not None and final.ended_at is not None
    assert final.killed_at is not None
    assert pids_with_job_id(job.job_id) == []  # nothing of the job is left running
    tracker = JobTracker(registry)
    assert _view(tracker, job.job_id).state != "lost"
    assert derive_state is not None
