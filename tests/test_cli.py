"""The headless CLI end to end with the fake trainer: launch, status, stop, resume, kill, and the
documented exit codes (0 ok, 1 refused, 2 usage/unknown job, 3 nothing to do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path: Path):
    values = {**os.environ, **fake_env(tmp_path)}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def nnui(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def status(env: dict) -> dict[str, dict]:
    result = nnui(env, "status", "--json")
    assert result.returncode == 0, result.stderr
    return {row["id"]: row for row in json.loads(result.stdout)}


def launched_ids(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line.split()[0] for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_launch_status_stop_resume(env: dict) -> None:
    flags = ["--", "--epochs", "300", "--epoch-time", "0.1"]
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0,1",
                  "--gpus", "0,1", *flags)  # fmt: skip
    first, second = launched_ids(result)
    assert wait_until(lambda: all(r["state"] == "running" for r in status(env).values()), 20)
    rows = status(env)
    assert rows[first]["gpus"] == ["0"] and rows[second]["gpus"] == ["1"]
    assert rows[first]["simulated"] and rows[first]["num_epochs"] == 300
    table = nnui(env, "status").stdout
    assert first in table and "(sim)" in table and "/300" in table

    again = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0",
                 "--gpus", "0", *flags)  # fmt: skip
    assert again.returncode == 1 and "already running" in again.stderr

    stop = nnui(env, "stop", first, "--yes")
    assert stop.returncode == 0, stop.stderr
    assert "rank 0" in stop.stdout and "device cpu" in stop.stdout and "pid " in stop.stdout
    second_stop = nnui(env, "stop", first, "--yes")
    assert second_stop.returncode == 3  # already stopping, or already stopped
    assert wait_until(lambda: status(env)[first]["exit_code"] is not None, 15)
    assert (status(env)[first]["state"], status(env)[first]["exit_code"]) == ("stopped", 0)
    assert nnui(env, "stop", first, "--yes").returncode == 3

    resume = nnui(env, "resume", first, "--simulate-gpus", "2")
    (resumed,) = launched_ids(resume)
    assert wait_until(lambda: status(env)[resumed]["state"] == "running", 20)
    row = status(env)[resumed]
    assert (row["fold"], row["gpus"]) == ("0", ["0"]) and row["epoch"] >= 1
    assert nnui(env, "resume", second).returncode == 3  # still running: nothing to do

    assert nnui(env, "kill", resumed).returncode == 2  # needs --yes
    killed = nnui(env, "kill", resumed, "--yes", "--grace", "2")
    assert killed.returncode == 0 and "SIGTERM" in killed.stdout
    assert wait_until(lambda: status(env)[resumed]["state"] == "failed", 10)
    assert nnui(env, "kill", resumed, "--yes").returncode == 3


def test_ddp_group_and_queued_stop(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--ddp", "spawn",
                  "--gpus", "0,1", "--folds", "2",
                  "--", "--epochs", "50", "--start-delay", "1.5")  # fmt: skip
    (job,) = launched_ids(result)
    stop = nnui(env, "stop", job, "--yes")
    assert stop.returncode == 0 and "queued" in stop.stdout
    assert nnui(env, "stop", job, "--yes").returncode == 3  # already queued
    assert wait_until(lambda: status(env)[job]["exit_code"] is not None, 20)
    row = status(env)[job]
    assert row["state"] == "stopped"
    assert row["mode"] == "spawn" and row["exit_code"] == 0 and len(row["worker_pids"]) == 2


@pytest.mark.parametrize(
    ("args", "code", "fragment"),
    [
        (["stop", "nope"], 2, "error: no job 'nope'"),
        (["resume", "nope"], 2, "no job"),
        (["kill", "nope", "--yes"], 2, "no job"),
        (["launch", "4", "3d_fullres", "--folds", "0"], 2, "--gpus"),
        (["launch", "4", "3d_fullres", "--folds", "0", "--gpus", "0"], 1, "--cpu"),  # no driver
        (["launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0", "--gpus", "5"], 2,
         "does not exist"),
        (["launch", "4", "3d_fullres", "--simulate-gpus", "4", "--ddp", "spawn", "--folds", "0",
          "--gpus", "0,1,2"], 1, "global batch size 2"),
        (["launch", "9", "3d_fullres", "--cpu", "--folds", "0"], 1, "no dataset"),
        (["status", "--", "--epochs", "3"], 2, "only go with"),
        (["launch"], 2, "usage"),
    ],
)  # fmt: skip
def test_refusals_and_usage_errors(env: dict, args: list[str], code: int, fragment: str) -> None:
    result = nnui(env, *args)
    assert result.returncode == code, result.stdout + result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_dry_run_prints_the_exact_command(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--cpu", "--folds", "0", "--dry-run",
                  "--", "--epochs", "3", "--iterations-per-epoch", "5")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "NNUI_JOB_ID=" in result.stdout and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in result.stdout
    assert "-device cpu --epochs 3 --iterations-per-epoch 5" in result.stdout
    assert status(env) == {}


def test_status_without_jobs(env: dict) -> None:
    assert nnui(env, "status").stdout.strip() == "no jobs"
    assert status(env) == {}


def test_no_subcommand_opens_the_tui_with_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from app.main import main

    seen = {}
    fake = types.ModuleType("app.tui")
    fake.run_tui = lambda options: seen.setdefault("options", options) and 7
    monkeypatch.setitem(sys.modules, "app.tui", fake)
    assert main(["--simulate-gpus", "2", "--readonly", "--no-mouse", "--results", "/r"]) == 7
    options = seen["options"]
    assert (options.simulate_gpus, options.readonly, options.no_mouse) == (2, True, True)
    assert (options.results, options.preprocessed, options.command) == ("/r", None, None)


def test_sbatch_is_handed_over_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from app.main import main

    seen = []
    fake = types.ModuleType("app.services.slurm")
    fake.sbatch_main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "app.services.slurm", fake)
    assert main(["sbatch", "4", "3d_fullres", "--", "--epochs", "3"]) == 0
    assert seen == [["4", "3d_fullres", "--", "--epochs", "3"]]


def test_common_flags_after_the_subcommand(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--folds", "0", "--cpu", "--dry-run",
                  "--results", "/elsewhere")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "nnUNet_results=/elsewhere" in result.stdout
