"""A hand-edited registry record claims a fold folder and points at a live process that is
not the fold's trainer (a `sleep`): the run really training in that folder (started by hand)
is still listed by `nnui status`, and a stop through the forged record signals nothing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from test_discovery import (
    ROOT,
    _events,
    _fake_trainer,
    _fold,
    _nnui,
    _start_fake,
    _wait,
    started,  # noqa: F401 (the fixture)
)

from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.machine.procs import proc_info, read_sigcgt_usr1
from trainer.schema.tree import EVENTS_FILE


def _forged(registry: Registry, folder: Path, pid: int, created_at: float) -> str:
    info = proc_info(pid)
    assert info is not None
    job_id = "0101-000000-f0-abc"
    registry.add(Job(
        job_id=job_id, created_at=created_at, dataset="Dataset900_NnuiDemo",
        configuration="2d", fold="0", mode="single", device="cpu", gpus=[], simulated=False,
        argv=["nnui-train"], env={}, run_dir=str(folder), console_path=str(folder / "c.log"),
        processes=[ProcessRecord(pid, info.create_time, "supervisor", None, info.start_ticks),
                   ProcessRecord(pid, info.create_time, "trainer", None, info.start_ticks)],
    ))  # fmt: skip
    return job_id


@pytest.mark.parametrize("offset_s", [-60.0, 600.0])  # created before the run, or "after"
def test_a_forged_record_never_hides_the_real_run_of_its_fold(started, tmp_path, offset_s):  # noqa: F811
    script = _fake_trainer(tmp_path)
    results = tmp_path / "results"
    folder = _fold(results, "0")
    log = tmp_path / "signals.log"
    real = _start_fake(started, script, results, "0", log, FAKE_OPEN=str(folder / EVENTS_FILE))
    _events(folder, time.time(), [real.pid])
    _wait(lambda: read_sigcgt_usr1(real.pid), "the stand-in's handler")
    bystander = started.start(["sleep", "3600"])
    state = tmp_path / "state"
    forged = _forged(Registry(state), folder, bystander.pid, time.time() + offset_s)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNUI_STATE_DIR": str(state)}
    done = _nnui("status", "--json", "--results", str(results), env=env)
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in json.loads(done.stdout)}
    assert rows[f"run:{real.pid}"]["run_dir"] == str(folder.resolve())  # the real run
    assert rows[f"run:{real.pid}"]["adopted"] and forged in rows
    table = _nnui("status", "--results", str(results), env=env).stdout
    assert f"run:{real.pid}" in table, table  # the table's one row of the folder: the run
    stop = _nnui("stop", forged, "--yes", "--results", str(results), env=env)
    # Refused, or queued for a supervisor that does not exist: never sent.
    assert "SIGUSR1 to" not in stop.stdout and "sent;" not in stop.stdout, stop.stdout
    assert bystander.poll() is None and real.poll() is None
    assert not log.exists() or "SIGUSR1" not in log.read_text()  # nothing reached the run
