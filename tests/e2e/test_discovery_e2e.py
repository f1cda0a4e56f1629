"""Hand-started trainings (not launched by nnui) adopted end to end, on the CPU (gloo).

Three runs started by hand in one results root, one fold each: a torchrun run with two
workers (the agent is a wrapper named `torchrun` that records every SIGUSR1 it gets, as in
test_tui_torchrun_e2e.py), a `-num_gpus 2` run and a single process. Each is one job with
its rank count in `nnui status --json` and on the board. The torchrun run is stopped with
`s` on the board, the others with `nnui stop JOB --yes`; each exits 0 (torchrun's own exit 0
and its empty signal log prove the agent was not signalled) with a loadable checkpoint, and
is then listed stopped. The single run is resumed the way it was started (`--c`) and killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from tui_fixtures import kill_started_jobs, screen_of, wait_for

from app.screens.confirm import StopConfirmScreen
from app.screens.dashboard import DashboardScreen
from app.screens.seam import TuiConfig
from app.tui import make_app
from trainer.schema.tree import Roots, checkpoint_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
SAFETY_NET_S = 300  # real trainings on a shared box: a hang guard only
RECORDING_TORCHRUN = """\
    import os, signal, sys

    def record(signum, frame):
        with open(os.environ["NNUI_SIGNAL_LOG"], "a") as handle:
            handle.write(f"{signal.Signals(signum).name} pid {os.getpid()}\\n")

    signal.signal(signal.SIGUSR1, record)  # would otherwise kill torchrun (exit 138)
    from torch.distributed.run import main

    main()
"""


def _train_args(demo, results: Path, fold: str) -> list[str]:
    return ["900", "2d", fold, "-device", "cpu", "--epochs", "300", "--iterations-per-epoch",
            "2", "--val-iterations", "1", "--num-workers", "1", "--preprocessed",
            str(demo.preprocessed), "--results", str(results)]  # fmt: skip


class Hand:
    """Runs started by hand (their own sessions), killed by their group at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.procs = tmp_path, {}
        self.states: list[Path] = []  # registries of jobs nnui resume started

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.tmp_path / f"{name}.log", "w") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)  # fmt: skip
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()[-3000:]

    def cleanup(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for state in self.states:
            kill_started_jobs(state)


@pytest.fixture
def hand(tmp_path: Path):
    runs = Hand(tmp_path)
    try:
        yield runs
    finally:
        runs.cleanup()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NNUI_JOB_ID")}  # fmt: skip
    env.update(
        PYTHONPATH=str(ROOT),
        XDG_STATE_HOME=str(tmp_path / "state"),
        NNUI_SIGNAL_LOG=str(tmp_path / "torchrun-signals.log"),
        NNUI_NO_BELL="1",
    )
    return env


def _nnui(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "app.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)  # fmt: skip


def _rows(env: dict[str, str], results: Path) -> dict[str, dict]:
    done = _nnui(env, "status", "--json", "--results", str(results))
    assert done.returncode == 0, done.stderr
    return {r["id"]: r for r in json.loads(done.stdout) if str(results) in (r["run_dir"] or "")}


def _until(predicate, what: str, timeout_s: float = SAFETY_NET_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


async def test_hand_started_runs_are_adopted_stopped_and_resumed(demo_preprocessed, tmp_path,
                                                                hand) -> None:  # fmt: skip
    results = tmp_path / "results"
    env = _env(tmp_path)
    torchrun = tmp_path / "torchrun"  # the name marks it as torchrun, like the real one
    torchrun.write_text(textwrap.dedent(RECORDING_TORCHRUN))
    demo = demo_preprocessed
    started = {
        "torchrun": hand.start("torchrun", [PY, str(torchrun), "--standalone",
                                            "--nproc_per_node=2", "-m", "trainer",
                                            *_train_args(demo, results, "0")], env),
        "spawn": hand.start("spawn", [PY, "-m", "trainer", *_train_args(demo, results, "1"),
                                      "-num_gpus", "2"], env),
        "single": hand.start("single", [PY, "-m", "trainer", *_train_args(demo, results, "2")],
                             env),
    }  # fmt: skip
    ids = {name: f"run:{proc.pid}" for name, proc in started.items()}
    expected = {"torchrun": ("torchrun", 2), "spawn": ("spawn", 2), "single": ("single", 1)}

    def ready() -> dict[str, dict] | None:
        rows = _rows(env, results)
        for name in started:
            assert started[name].poll() is None, hand.log(name)
        ok = all(ids[n] in rows and (rows[ids[n]]["epoch"] or 0) >= 1 for n in started)
        return rows if ok else None

    rows = _until(ready, "three adopted runs past their first epoch")
    for name, (launcher, num_ranks) in expected.items():
        row = rows[ids[name]]
        assert (row["adopted"], row["launcher"], row["num_ranks"]) == (True, launcher, num_ranks)
        workers = [p for p in row["processes"] if p["role"] == "worker"]
        assert sorted(p["rank"] for p in workers) == list(range(num_ranks)), row["processes"]
        assert sum(r["run_dir"] == row["run_dir"] for r in rows.values()) == 1  # one job
    assert rows[ids["torchrun"]]["processes"][0]["role"] == "agent"
    assert rows[ids["spawn"]]["processes"][0]["role"] == "launcher"

    await _board_lists_and_stops(demo, results, ids["torchrun"], set(ids.values()))
    for name in ("spawn", "single"):
        done = _nnui(env, "stop", ids[name], "--yes", "--results", str(results))
        assert done.returncode == 0, done.stderr
        sent = [line for line in done.stdout.splitlines() if line.strip().startswith("pid ")]
        assert len(sent) == expected[name][1], done.stdout
    for name, proc in started.items():
        assert proc.wait(timeout=SAFETY_NET_S) == 0, hand.log(name)
    log = tmp_path / "torchrun-signals.log"
    assert not log.exists() or log.read_text() == "", log.read_text()
    rows = _rows(env, results)
    for name in started:
        row = rows.get(ids[name], None)
        folder = Path(next(r["run_dir"] for r in rows.values()
                           if r["run_dir"].endswith(f"fold_{_fold(name)}")))  # fmt: skip
        _check_checkpoint(folder / checkpoint_file("latest"))
        assert row is None or row["state"] == "stopped", row
        assert any(r["state"] == "stopped" and r["run_dir"] == str(folder)
                   for r in rows.values()), rows  # fmt: skip
    _resume_and_kill(env, results, rows, hand)


def _fold(name: str) -> str:
    return {"torchrun": "0", "spawn": "1", "single": "2"}[name]


def _check_checkpoint(path: Path) -> None:
    from trainer.checkpoint.store import load

    tensors, meta = load(path)
    assert tensors and meta


async def _board_lists_and_stops(demo, results: Path, job_id: str, ids: set[str]) -> None:
    """The board lists the three runs; `s` on the torchrun one (filtered) reaches its two
    workers only."""
    config = TuiConfig(roots=Roots(demo.raw, demo.preprocessed, results),
                       state_dir=results.parent / "state", simulate_gpus=2,
                       jobs_interval_s=0.25, procs_interval_s=0.5)  # fmt: skip
    app = make_app(config)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(lambda: all(app.view_of(i) is not None for i in ids), pilot,
                       timeout_s=SAFETY_NET_S)  # fmt: skip
        view = app.view_of(job_id)
        assert not view.watch_only and len(view.topology["ranks"]) == 2
        rank_pids = sorted(r["pid"] for r in view.topology["ranks"])
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("slash", *job_id.removeprefix("run:"), "enter")
        await pilot.press("s")
        screen = await screen_of(app, pilot, StopConfirmScreen)
        text = screen.query_one("#stop-plan").render().plain
        assert all(f"pid {pid}" in text for pid in rank_pids), text
        await pilot.press("y")
        await wait_for(lambda: app.view_of(job_id) is None
                       or app.view_of(job_id).state in ("stopping", "stopped"), pilot,
                       timeout_s=SAFETY_NET_S)  # fmt: skip


def _resume_and_kill(env: dict[str, str], results: Path, rows: dict, hand: Hand) -> None:
    """`nnui resume` starts the single run again as it was started (its argv + --c, its
    roots), as an nnui job from then on: listed once (not also adopted); kill ends it."""
    stopped = next(i for i, r in rows.items() if r["run_dir"].endswith("fold_2"))
    done = _nnui(env, "resume", stopped, "--results", str(results))
    assert done.returncode == 0, done.stderr
    new_id = done.stdout.split()[0]
    assert "--c" in done.stderr and "--epochs 300" in done.stderr, done.stderr
    hand.states.append(Path(env["XDG_STATE_HOME"]) / "nnui")

    def live() -> list[dict] | None:
        found = [r for r in _rows(env, results).values() if r["run_dir"].endswith("fold_2")
                 and r["state"] in ("running", "starting")]  # fmt: skip
        return found if found and (found[0]["epoch"] or 0) > 0 else None

    (row,) = _until(live, "the resumed run")  # one row: nnui's job, not an adopted copy
    assert row["id"] == new_id and not row["adopted"]
    done = _nnui(env, "kill", new_id, "--yes", "--grace", "20")
    assert done.returncode == 0, done.stderr
