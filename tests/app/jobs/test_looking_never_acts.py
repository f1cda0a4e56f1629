"""Looking never acts (docs/contract.md): a refresh or `nnui status` of a job with a queued stop
and a topology reads only — no signal, the registry byte-identical — and the job's
supervisor (RunWatch) is the one that records the workers and delivers the stop. Also: one
bad record in a job's events costs nothing but itself, in every command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_trainer import wait_until

from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker
from app.services.machine.procs import proc_info, process_identity
from app.services.supervisor.main import RunWatch
from trainer.schema.events import encode_event
from trainer.schema.tree import EVENTS_FILE

ROOT = Path(__file__).resolve().parents[3]
JOB_ID = "0101-000000-f0-abc"
# A stand-in worker: catches SIGUSR1 (as a trainer does), notes it, exits 0.
WORKER = """
import os, signal, sys
def on_usr1(signum, frame):
    with open(sys.argv[1], "a") as handle:
        handle.write("USR1\\n")
    os._exit(0)
signal.signal(signal.SIGUSR1, on_usr1)
while True:
    signal.pause()
"""


@dataclass
class LiveJob:
    registry: Registry
    job: Job
    worker: subprocess.Popen[bytes]
    marker: Path  # the worker writes here when it gets SIGUSR1

    @property
    def job_file(self) -> Path:
        return self.registry.jobs_dir / f"{self.job.job_id}.json"


def _start_worker(marker: Path) -> subprocess.Popen[bytes]:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(marker)], env={**os.environ, "NNUI_JOB_ID": JOB_ID}
    )

    def ready() -> bool:
        info = proc_info(worker.pid)
        return info is not None and info.sigcgt_usr1 and info.env_job_id == JOB_ID

    assert wait_until(ready, 20)
    return worker


def _make_job(tmp_path: Path, worker: subprocess.Popen[bytes], created_at: float, **changes):
    registry = Registry(tmp_path / "state")
    run = tmp_path / "run"
    run.mkdir()
    ticks, create_time = process_identity(worker.pid)
    job = Job(
        job_id=JOB_ID, created_at=created_at, dataset="Dataset004_Demo",
        configuration="3d_fullres", fold="0", mode="single", device="cpu", gpus=[],
        simulated=False, argv=[], env={}, run_dir=str(run), console_path=str(run / "c.log"),
        processes=[ProcessRecord(worker.pid, create_time or 0.0, "trainer", None, ticks)],
        **changes,
    )  # fmt: skip
    registry.add(job)
    return registry, job


def write_run(job: Job, pid: int, torn_before_topology: bool = False) -> None:
    now = time.time()
    rank = {"global_rank": 0, "local_rank": 0, "host": socket.gethostname(), "pid": pid}
    lines = encode_event("run_started", t=now, num_epochs=10)
    if torn_before_topology:  # a writer died mid-line; the next record follows the tear
        lines += encode_event("epoch_ended", t=now, epoch=0)[:30]
    lines += encode_event("topology", t=now, ranks=[rank])
    (Path(job.run_dir) / EVENTS_FILE).write_text(lines)


@pytest.fixture
def live(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LiveJob]:
    options = getattr(request, "param", {})
    created_at = time.time() - 1
    marker = tmp_path / "signals.txt"
    worker = _start_worker(marker)
    try:
        queued = options.get("queued_stop", True)
        registry, job = _make_job(tmp_path, worker, created_at, queued_stop=queued)
        write_run(job, worker.pid, options.get("torn", False))
        yield LiveJob(registry, job, worker, marker)
    finally:
        worker.kill()
        worker.wait()


def _file_state(path: Path) -> tuple[bytes, int]:
    return path.read_bytes(), path.stat().st_mtime_ns


def test_refresh_of_a_queued_stop_sends_nothing_and_writes_nothing(
    live: LiveJob, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[tuple] = []
    monkeypatch.setattr(os, "kill", lambda *a: sent.append(("kill", *a)))
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda *a: sent.append(("pidfd", *a)))
    before = _file_state(live.job_file)
    names_before = sorted(p.name for p in live.registry.jobs_dir.iterdir())
    tracker = JobTracker(live.registry)
    for _ in range(2):
        (view,) = tracker.refresh()
    assert view.state == "stopping" and view.topology is not None
    assert sent == []
    assert _file_state(live.job_file) == before
    assert sorted(p.name for p in live.registry.jobs_dir.iterdir()) == names_before


@pytest.mark.parametrize("args", [["status"], ["status", "--json"]])
def test_nnui_status_leaves_the_registry_byte_identical(live: LiveJob, args: list[str]) -> None:
    before = _file_state(live.job_file)
    env = {**os.environ, "NNUI_STATE_DIR": str(live.registry.state_dir)}
    result = subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert JOB_ID in result.stdout and "stopping" in result.stdout
    assert _file_state(live.job_file) == before
    assert live.worker.poll() is None and not live.marker.exists()


@pytest.mark.parametrize("live", [{"torn": False}, {"torn": True}], indirect=True, ids=str)
def test_the_supervisor_delivers_the_queued_stop_and_records_the_worker(live: LiveJob) -> None:
    RunWatch(live.registry, JOB_ID).step()
    assert wait_until(lambda: live.worker.poll() is not None, 20)
    assert live.worker.returncode == 0 and live.marker.read_text() == "USR1\n"
    job = live.registry.get(JOB_ID)
    assert not job.queued_stop
    assert [(s.pid, s.signal, s.result) for s in job.signals] == [
        (live.worker.pid, "SIGUSR1", "sent")
    ]
    (worker,) = [p for p in job.processes if p.role == "worker"]
    assert worker.pid == live.worker.pid and worker.start_ticks is not None


@pytest.mark.parametrize("live", [{"queued_stop": False}], indirect=True)
def test_the_supervisor_records_workers_without_a_stop(live: LiveJob) -> None:
    watch = RunWatch(live.registry, JOB_ID)
    watch.step()
    job = live.registry.get(JOB_ID)
    (worker,) = [p for p in job.processes if p.role == "worker"]
    assert (worker.pid, worker.start_ticks) == (live.worker.pid, process_identity(worker.pid)[0])
    assert job.signals == [] and live.worker.poll() is None
    before = _file_state(live.job_file)
    watch.step()  # nothing new: no second write
    assert _file_state(live.job_file) == before


BAD_LINES = [
    '{"v":1,"t":1e9,"kind":"epoch_ended","epoch":null}',
    '{"v":1,"t":1e9,"kind":"epoch_ended","epoch":"abc"}',
    '{"v":1,"t":1e9,"kind":"epoch_ended","epoch":1e400}',
    '{"v":1,"t":1e9,"kind":"topology","ranks":[{"pid":-1}]}',
    '{"v":1,"t":1e9,"kind":"topology","ranks":[{"pid":0}]}',
    '{"v":1,"t":1e9,"kind":"topology","ranks":"all"}',
    '{"v":1,"t":"later","kind":"epoch_ended","epoch":1}',
]


def _ended_job(registry: Registry, tmp_path: Path, job_id: str, lines: str) -> None:
    run = tmp_path / job_id
    run.mkdir()
    (run / EVENTS_FILE).write_text(lines)
    job = Job(job_id, time.time() - 100, "Dataset004_Demo", "3d_fullres", "0", "single", "cpu",
              [], False, [], {}, str(run), str(run / "c.log"), exit_code=1,
              ended_at=time.time())  # fmt: skip
    registry.add(job)


def test_bad_records_cost_only_themselves_in_every_command(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    t = time.time() - 50
    good = encode_event("run_started", t=t, num_epochs=10) + encode_event(
        "epoch_ended", t=t, epoch=2
    )
    _ended_job(registry, tmp_path, "0101-000000-f0-bad", good + "\n".join(BAD_LINES) + "\n")
    _ended_job(registry, tmp_path, "0101-000000-f1-ok", good)
    env = {**os.environ, "NNUI_STATE_DIR": str(registry.state_dir)}

    def nnui(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT, capture_output=True,
            text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    rows = {r["id"]: r for r in json.loads(nnui("status", "--json").stdout)}
    assert rows["0101-000000-f0-bad"]["num_invalid_events"] == len(BAD_LINES)
    assert rows["0101-000000-f0-bad"]["invalid_event_reason"].startswith("'t' must be")
    assert rows["0101-000000-f1-ok"]["num_invalid_events"] == 0
    assert {r["epoch"] for r in rows.values()} == {3}
    table = nnui("status")
    assert f"{len(BAD_LINES)} invalid event lines skipped" in table.stdout
    for args in (["stop", "f0-bad", "--yes"], ["resume", "f0-bad"], ["kill", "f0-bad", "--yes"]):
        result = nnui(*args)
        assert "Traceback" not in result.stderr and result.returncode in (1, 2, 3), args
