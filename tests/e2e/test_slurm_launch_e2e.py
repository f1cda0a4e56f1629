"""Cross-validation folds on a real one-node SLURM cluster (tests/slurm_cluster.py) through
nnui's own commands: `nnui launch ... --slurm`, `nnui status`, `nnui stop slurm:JOB`,
`nnui resume slurm:JOB`, and `--requeue` through a time limit. The tiny demo dataset trains
on the CPU (one process per fold).

- Two folds launched and followed (SLURM state and epochs on their rows); one stopped
  gracefully (COMPLETED 0:0, checkpoint_latest, status says stopped), resumed by submitting
  its script again, trained to the end with every epoch once; the other ends finished.
- --requeue: the USR1 of the time-limit lead (sent as SLURM sends it) checkpoints the fold
  and its job submits itself again; the board shows the restart; the fold finishes with
  every epoch counted once.

Slow. Skipped when SLURM is not installed, except in CI (CI=true), where it must run.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from trainer import schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster
from nnui_cli import run_nnui

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
SAFETY_NET_S = 600  # a hang guard, never a speed check

cluster = pytest.fixture(scope="module")(slurm_cluster.running_cluster)


def _env(cluster, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, **cluster.env, "PYTHONPATH": str(ROOT),
            "XDG_STATE_HOME": str(tmp_path / "state"), "NNUI_ADOPT_SCOPE": "roots"}  # fmt: skip


def _launch(env, demo, tmp_path: Path, folds: str, epochs: int, *flags: str) -> dict[str, str]:
    """`nnui launch 900 2d --folds F --slurm ...`: {fold: SLURM job id}."""
    done = run_nnui(
        env, "launch", "900", "2d", "--folds", folds, "--slurm", "--cpu", "--cpus-per-task", "1",
        "--slurm-output", str(tmp_path / "out"), "--preprocessed", str(demo.preprocessed),
        "--results", str(tmp_path / "results"), *flags, "--", "--epochs", str(epochs),
        "--iterations-per-epoch", "4", "--val-iterations", "1", "--num-workers", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    jobs = dict(re.findall(r"^slurm:(\d+)\s+fold (\d)", done.stdout, re.MULTILINE))
    return {fold: job for job, fold in jobs.items()}


def _folder(tmp_path: Path, fold: str) -> Path:
    return (
        tmp_path
        / "results"
        / "Dataset900_NnuiDemo"
        / "nnuiTrainer__nnuiPlans__2d"
        / (f"fold_{fold}")
    )


def _kinds(folder: Path, kind: str) -> list[dict]:
    path = folder / schema.EVENTS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(schema.decode_event, lines) if e and e["kind"] == kind]


def _rows(env, tmp_path: Path) -> list[dict]:
    done = run_nnui(env, "status", "--json", "--results", str(tmp_path / "results"))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((tmp_path / "out").glob("*.out")))


def _wait(what: str, predicate, tmp_path: Path):
    deadline = time.monotonic() + SAFETY_NET_S
    while not (found := predicate()):
        assert time.monotonic() < deadline, f"{what}\n{_logs(tmp_path)}"
        time.sleep(0.5)
    return found


def test_two_folds_launched_followed_stopped_and_resumed(cluster, demo_preprocessed, tmp_path):
    env = _env(cluster, tmp_path)
    jobs = _launch(env, demo_preprocessed, tmp_path, "0-1", 6, "--time", "00:30:00")
    assert sorted(jobs) == ["0", "1"]

    def both_followed() -> list[dict] | None:
        rows = _rows(env, tmp_path)
        mine = [r for r in rows if r.get("slurm_job") in jobs.values() and (r["epoch"] or 0) >= 1]
        return mine if len(mine) == 2 else None

    rows = _wait("both folds on the board with an epoch", both_followed, tmp_path)
    assert {r["slurm_state"] for r in rows} == {"RUNNING"}
    assert {r["fold"] for r in rows} == {"0", "1"} and all(r["num_epochs"] == 6 for r in rows)

    done = run_nnui(env, "stop", f"slurm:{jobs['0']}", "--yes")
    assert done.returncode == 0, done.stderr
    assert f"scancel --signal=USR1 --batch {jobs['0']}" in done.stdout
    info = cluster.wait_job(int(jobs["0"]), timeout_s=SAFETY_NET_S)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _logs(tmp_path)
    folder = _folder(tmp_path, "0")
    assert (folder / schema.checkpoint_file("latest")).exists()
    (stopped,) = _kinds(folder, "stopped")
    assert stopped["epoch"] < 5, "the fold ended before the stop could reach it"
    row = next(r for r in _rows(env, tmp_path) if r["run_dir"] == str(folder))
    assert row["state"] == "stopped", row

    done = run_nnui(env, "resume", f"slurm:{jobs['0']}")
    assert done.returncode == 0, done.stderr
    (again,) = re.findall(r"^slurm:(\d+)", done.stdout, re.MULTILINE)
    for job in (again, jobs["1"]):
        info = cluster.wait_job(int(job), timeout_s=SAFETY_NET_S)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _logs(tmp_path)
    for fold in ("0", "1"):
        folder = _folder(tmp_path, fold)
        assert [e["epoch"] for e in _kinds(folder, "epoch_ended")] == list(range(6))
        assert schema.read_status(folder).state == schema.State.FINISHED
    done = run_nnui(env, "resume", f"slurm:{again}")
    assert done.returncode == 3 and "finished" in done.stdout, done.stdout + done.stderr


def test_requeue_runs_through_the_time_limit(cluster, demo_preprocessed, tmp_path):
    # SLURM's USR1 is due 30 s after each job's start (it may come up to ~30 s early): within
    # the lead window from the start, held by the script until the job trained an epoch. The
    # test sends the first one itself, as SLURM does (to the batch shell), after an epoch, so
    # that the first job requeues however fast the machine trains.
    env = _env(cluster, tmp_path)
    flags = ("--time", "00:02:00", "--signal-lead", "90", "--requeue")
    jobs = _launch(env, demo_preprocessed, tmp_path, "0", 4, *flags)
    first, folder = int(jobs["0"]), _folder(tmp_path, "0")
    _wait("the first epoch", lambda: _kinds(folder, "epoch_ended"), tmp_path)
    # (check=False: on a slow machine SLURM's own lead may have come first and the job ended)
    cluster.run("scancel", "--signal=USR1", "--batch", str(first), check=False)
    info = cluster.wait_job(first, timeout_s=SAFETY_NET_S)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), _logs(tmp_path)
    assert "requeued as job" in _logs(tmp_path)

    def restarted() -> dict | None:
        rows = _rows(env, tmp_path)
        return next((r for r in rows if r["run_dir"] == str(folder) and r["restarts"]), None)

    row = _wait("the board shows the restart", restarted, tmp_path)
    assert row["slurm_state"] in ("PENDING", "RUNNING") and int(row["slurm_job"]) > first, row
    _wait("the fold finished", lambda: _kinds(folder, "finished"), tmp_path)
    assert [e["epoch"] for e in _kinds(folder, "epoch_ended")] == list(range(4))
    assert len(_kinds(folder, "run_started")) >= 2
    assert (folder / schema.checkpoint_file("final")).exists()
