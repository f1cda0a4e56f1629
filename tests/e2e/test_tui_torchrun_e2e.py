"""Real DDP trainings (2 CPU ranks, gloo, the demo data) launched, stopped and resumed from
the TUI with Pilot (make_app with the real services and a registry in tmp).

torchrun: the launcher entry is a wrapper named `torchrun` that installs a SIGUSR1 handler
recording every such signal to a file and then runs torchrun's main() in-process, so the
wrapper IS the torchrun process nnui would have to avoid. Pressing `s` must reach only the
two ranks: both stop at the same epoch boundary and exit 0, torchrun exits 0 (recorded by
the supervisor) and its signal log stays empty. `r` then continues from the checkpoint.
-num_gpus (spawn): the stop reaches the ranks only, never the spawn parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_tui_board import open_board, settled
from tui_fixtures import kill_started_jobs, screen_of, wait_for

from app.screens.confirm import LaunchConfirmScreen, StopConfirmScreen
from app.screens.dashboard import DashboardScreen
from app.screens.job_detail import JobDetailScreen
from app.screens.seam import TuiConfig
from app.services.jobs.registry import Registry
from app.services.machine.procs import proc_info
from app.tui import make_app
from app.widgets.process_tree import ProcessTree
from trainer.schema.tree import EVENTS_FILE, Roots

pytestmark = pytest.mark.slow

TRAINING_SAFETY_NET_S = 300  # real trainings on a shared box: a hang guard only
# Many epochs: the stop must land before the run ends, however slowly the TUI steps run on a
# busy box (50 were all done under load 20); the fixture kills what is left.
FLAGS = "--epochs 400 --iterations-per-epoch 2 --val-iterations 1"
RECORDING_TORCHRUN = """\
    import os, signal, sys

    def record(signum, frame):
        with open(os.environ["NNUI_SIGNAL_LOG"], "a") as handle:
            handle.write(f"{signal.Signals(signum).name} pid {os.getpid()}\\n")

    signal.signal(signal.SIGUSR1, record)  # would otherwise kill torchrun (exit 138)
    from torch.distributed.run import main

    main()
"""


def _events(job: Any) -> list[dict]:
    path = Path(job.run_dir) / EVENTS_FILE
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):  # a torn last line
            out.append(json.loads(line))
    return out


def _of_job(job: Any, kind: str) -> list[dict]:
    """Events of this job's own run: from its run_started on (the folder also holds the run
    before a resume, whose last events can be less than a second older than this job)."""
    events = _events(job)
    starts = [
        i for i, e in enumerate(events)
        if e["kind"] == "run_started" and e["t"] >= job.created_at - 2.0
    ]  # fmt: skip
    if not starts:
        return []
    return [e for e in events[starts[0] :] if e["kind"] == kind]


def _alive(pid: int) -> bool:
    info = proc_info(pid)
    return info is not None and not info.zombie


@pytest.fixture
def setup(tmp_path: Path, monkeypatch, demo_preprocessed) -> dict:
    roots = Roots(demo_preprocessed.raw, demo_preprocessed.preprocessed, tmp_path / "results")
    roots.results.mkdir()
    state = tmp_path / "state"
    torchrun = tmp_path / "torchrun"  # the name marks it as a launcher, like the real one
    torchrun.write_text(textwrap.dedent(RECORDING_TORCHRUN))
    signal_log = tmp_path / "torchrun-signals.log"
    monkeypatch.delenv("NNUI_TRAINER_SCRIPT", raising=False)
    monkeypatch.setenv("NNUI_TORCHRUN_SCRIPT", str(torchrun))
    monkeypatch.setenv("NNUI_SIGNAL_LOG", str(signal_log))
    monkeypatch.setenv("NNUI_STATE_DIR", str(state))
    for name, value in (("raw", roots.raw), ("preprocessed", roots.preprocessed),
                        ("results", roots.results)):  # fmt: skip
        monkeypatch.setenv(f"nnUNet_{name}", str(value))
    try:
        yield {"roots": roots, "state": state, "signal_log": signal_log}
    finally:
        kill_started_jobs(state)


def _app(setup: dict) -> Any:
    config = TuiConfig(
        roots=setup["roots"], state_dir=setup["state"], simulate_gpus=2, jobs_interval_s=0.25
    )
    return make_app(config)


async def _launch_ddp(app: Any, pilot: Any, torchrun: bool) -> str:
    """Fold 0 on the group of simulated GPUs 0 and 1, via the board's keys."""
    screen = await open_board(app, pilot)
    await pilot.press("space", "right", "space")
    if torchrun:
        await pilot.press("m")
    await pilot.press("f", *FLAGS, "enter")
    await wait_for(lambda: screen.query_one("#flags").value == FLAGS, pilot)
    launcher = "torchrun" if torchrun else "spawn"
    await wait_for(lambda: screen.query_one("#board").model.ddp_launcher == launcher, pilot)
    await settled(screen, pilot, {"0": ["0", "1"]})
    assert screen.problems == [], screen.problems
    plan = screen.plans[0]
    assert plan.mode == ("torchrun" if torchrun else "spawn")
    assert ("--nproc_per_node=2" in plan.argv) is torchrun
    job_id = plan.job_id
    await pilot.press("g")
    await screen_of(app, pilot, DashboardScreen)
    return job_id


async def _stop_after_first_epoch(app: Any, pilot: Any, setup: dict, job_id: str) -> dict:
    """Wait for the topology and one epoch, press s and confirm; return what was checked."""
    registry = Registry(setup["state"])
    await wait_for(
        lambda: (v := app.view_of(job_id)) is not None and v.topology and (v.epoch or 0) >= 1,
        pilot,
        timeout_s=TRAINING_SAFETY_NET_S,
    )
    topology = app.view_of(job_id).topology
    rank_pids = sorted(r["pid"] for r in topology["ranks"])
    assert len(rank_pids) == 2
    # The job detail shows the verified process tree, labelled by role.
    await pilot.press("enter")
    tree = (await screen_of(app, pilot, JobDetailScreen)).query_one(ProcessTree)
    launcher = "torchrun" if registry.get(job_id).mode == "torchrun" else "spawn parent"
    labels = ("supervisor", launcher, "rank 0 (cpu)", "rank 1 (cpu)")
    await wait_for(lambda: all(x in (tree._shown or "") for x in labels), pilot)
    for pid in rank_pids:
        assert str(pid) in tree._shown
    await pilot.press("escape")
    await screen_of(app, pilot, DashboardScreen)
    await pilot.press("s")
    text = (await screen_of(app, pilot, StopConfirmScreen)).query_one("#stop-plan").render().plain
    assert all(f"pid {pid}" in text for pid in rank_pids), text
    await pilot.press("y")
    ended = lambda: registry.get(job_id).exit_code is not None  # noqa: E731
    await wait_for(ended, pilot, timeout_s=TRAINING_SAFETY_NET_S)
    job = registry.get(job_id)
    assert job.exit_code == 0, (job.exit_code, Path(job.console_path).read_text()[-3000:])
    await wait_for(lambda: not any(_alive(p) for p in rank_pids), pilot)
    # SIGUSR1 went to the two ranks and to nothing else (not torchrun, not the spawn parent).
    sent = sorted(s.pid for s in job.signals if s.signal == "SIGUSR1" and s.result == "sent")
    assert sent == rank_pids and job.process("trainer").pid not in sent
    assert all(s.signal == "SIGUSR1" for s in job.signals)
    stopped = _of_job(job, "stopped")
    assert len(stopped) == 1
    epoch = stopped[0]["epoch"]
    # The ranks agreed on one boundary; no epoch was trained after it; and all exited 0
    # there (torchrun, which waits for all its workers, exited 0). The two signals leave
    # one after the other, so an epoch boundary may fall between them: then only rank 0
    # had its flag set at the agreement, which is enough to stop both.
    requested = _of_job(job, "stop_requested")
    assert [e["epoch"] for e in requested] == [epoch]
    assert set(requested[0]["ranks"]) in ({0}, {1}, {0, 1})
    assert [e["epoch"] for e in _of_job(job, "epoch_ended")][-1] == epoch
    console = Path(job.console_path).read_text()
    assert "trainer exited with code 0" in console
    await wait_for(lambda: app.view_of(job_id).state == "stopped", pilot)
    return {"job": job, "epoch": epoch, "rank_pids": rank_pids}


async def test_torchrun_job_stops_from_the_tui_and_resumes(setup: dict) -> None:
    app = _app(setup)
    async with app.run_test(size=(150, 48)) as pilot:
        job_id = await _launch_ddp(app, pilot, torchrun=True)
        stop = await _stop_after_first_epoch(app, pilot, setup, job_id)
        job, epoch = stop["job"], stop["epoch"]
        assert job.mode == "torchrun"
        # torchrun itself never received SIGUSR1 and ended cleanly (exit 0 above).
        log = setup["signal_log"]
        assert not log.exists() or log.read_text() == "", log.read_text()

        # r: resume with --c on the same GPUs, in the same mode.
        await pilot.press("r")
        await screen_of(app, pilot, LaunchConfirmScreen)
        await pilot.press("y")
        registry = Registry(setup["state"])
        await wait_for(lambda: len(registry.list()) == 2, pilot)
        resumed = next(j for j in registry.list() if j.job_id != job_id)
        assert (resumed.mode, resumed.gpus, resumed.fold) == ("torchrun", ["0", "1"], "0")
        assert "--c" in resumed.argv
        first = lambda: _of_job(resumed, "epoch_ended")  # noqa: E731
        await wait_for(first, pilot, timeout_s=TRAINING_SAFETY_NET_S)
        assert len(_of_job(resumed, "run_started")) == 1
        assert len([e for e in _events(resumed) if e["kind"] == "run_started"]) == 2
        assert _of_job(resumed, "epoch_ended")[0]["epoch"] == epoch + 1
        second = lambda: (app.view_of(resumed.job_id).epoch or 0) >= epoch + 2  # noqa: E731
        await wait_for(second, pilot, timeout_s=TRAINING_SAFETY_NET_S)

    # The headless twin says the same.
    env = {**os.environ, "NNUI_STATE_DIR": str(setup["state"])}
    out = subprocess.run(
        [sys.executable, "-m", "app.main", "status", "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    rows = {row["id"]: row for row in json.loads(out.stdout)}
    assert rows[job_id]["state"] == "stopped" and rows[job_id]["epoch"] == epoch + 1
    assert rows[resumed.job_id]["state"] in ("running", "finished")
    assert rows[resumed.job_id]["epoch"] >= epoch + 2


async def test_spawn_job_stop_reaches_only_the_ranks(setup: dict) -> None:
    app = _app(setup)
    async with app.run_test(size=(150, 48)) as pilot:
        job_id = await _launch_ddp(app, pilot, torchrun=False)
        stop = await _stop_after_first_epoch(app, pilot, setup, job_id)
        assert stop["job"].mode == "spawn"
        parent = stop["job"].process("trainer").pid
        assert parent not in stop["rank_pids"]
