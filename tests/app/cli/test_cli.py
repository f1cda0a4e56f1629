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

ROOT = Path(__file__).resolve().parents[3]


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
        text=True, timeout=120, stdin=subprocess.DEVNULL,
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
    flags = ["--", "--epochs", "300", "--epoch-time", "1.0"]  # outlasts a starved test
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

    unconfirmed = nnui(env, "stop", first)  # no terminal, no --yes: refused, nothing sent
    assert unconfirmed.returncode == 1 and "add --yes" in unconfirmed.stderr
    assert status(env)[first]["state"] == "running"
    stop = nnui(env, "stop", first, "--yes")
    assert stop.returncode == 0, stop.stderr
    assert "rank 0" in stop.stdout and "device cpu" in stop.stdout and "pid " in stop.stdout
    second_stop = nnui(env, "stop", first, "--yes")
    assert second_stop.returncode == 3  # already stopping, or already stopped
    assert "already stopping since" in second_stop.stdout or "stopped" in second_stop.stdout
    assert "sent" not in second_stop.stdout.splitlines()[-1]
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
    assert wait_until(lambda: status(env)[resumed]["state"] == "killed", 10)  # by the user
    assert nnui(env, "kill", resumed, "--yes").returncode == 3


def test_ddp_group_and_queued_stop(env: dict) -> None:
    go = Path(env["NNUI_STATE_DIR"]).parent / "go"  # the trainer starts once this exists
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--ddp", "spawn",
                  "--gpus", "0,1", "--folds", "2",
                  "--", "--epochs", "50", "--hold-until", str(go))  # fmt: skip
    (job,) = launched_ids(result)
    stop = nnui(env, "stop", job, "--yes")
    assert stop.returncode == 0 and "queued" in stop.stdout
    assert nnui(env, "stop", job, "--yes").returncode == 3  # already queued
    go.touch()
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
        (["launch", "9", "3d_fullres", "--cpu", "--folds", "0"], 2, "no dataset"),
        (["status", "--", "--epochs", "3"], 2, "only go with"),
        (["launch"], 2, "error: the following arguments are required: dataset"),
        (["status", "--jsn"], 2, "--jsn (did you mean --json?)"),  # no prefix matching
        (["launch", "4", "3d_fullres", "--fold", "0", "--cpu"], 2, "required: --folds"),
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
    """Nothing found: it says so, names the results tree it looked in and how to look
    elsewhere."""
    lines = nnui(env, "status").stdout.splitlines()
    assert lines[0] == "no jobs"
    assert env["nnUNet_results"] in lines[1] and "--results" in lines[1], lines
    assert "nnUNet_results" in lines[1]
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
    fake = types.ModuleType("app.cli.sbatch")
    fake.sbatch_main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "app.cli.sbatch", fake)
    assert main(["sbatch", "4", "3d_fullres", "--", "--epochs", "3"]) == 0
    assert seen == [["4", "3d_fullres", "--", "--epochs", "3"]]


def test_common_flags_after_the_subcommand(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--folds", "0", "--cpu", "--dry-run",
                  "--results", "/elsewhere")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "nnUNet_results=/elsewhere" in result.stdout


# ---- the state directory, bad registry files, bad launch arguments ---------------------------


@pytest.mark.parametrize(
    "args",
    [[], ["status"], ["status", "--json"], ["stop", "x", "--yes"], ["resume", "x"],
     ["kill", "x", "--yes"], ["launch", "4", "3d_fullres", "--cpu", "--folds", "0"]],
    ids=lambda a: " ".join(a) or "tui",
)  # fmt: skip
def test_state_dir_that_is_a_file_is_one_line(env: dict, tmp_path: Path, args: list[str]) -> None:
    state = tmp_path / "not_a_dir"
    state.write_text("x")
    result = nnui({**env, "NNUI_STATE_DIR": str(state)}, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(state) in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_registry_file_is_reported_and_the_others_still_show(env: dict) -> None:
    from test_registry import make_job

    from app.services.jobs.registry import Registry

    registry = Registry(Path(env["NNUI_STATE_DIR"]))
    registry.add(make_job("1130-120000-f0-abc", exit_code=0, ended_at=1e12))
    (registry.jobs_dir / "1130-120000-f1-bad.json").write_bytes(b'{"job_id": "\xff"}')
    (registry.jobs_dir / "1130-120000-f2-bad.json").write_text(
        json.dumps(make_job("1130-120000-f2-bad", processes=[]).to_dict() | {"gpus": 3})
    )
    result = nnui(env, "status", "--json")
    assert result.returncode == 0, result.stderr
    assert [row["id"] for row in json.loads(result.stdout)] == ["1130-120000-f0-abc"]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and all("corrupt job file" in w for w in warnings), result.stderr
    assert "Traceback" not in result.stderr
    # Looking changes nothing: both files are still there, under their own names.
    assert not list(registry.jobs_dir.glob("*.corrupt"))
    assert (registry.jobs_dir / "1130-120000-f2-bad.json").is_file()
    assert nnui(env, "stop", "f0-abc", "--yes").returncode == 3  # the good one still works


@pytest.mark.parametrize("dry_run", [False, True], ids=["launch", "dry-run"])
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["4", "3d_fulres", "--folds", "0"], "unknown configuration '3d_fulres'"),
        (["4", "3d_fullres", "--folds", "7"], "fold '7' is not one of"),
        (["4", "3d_fullres", "--folds", "0,0"], "listed twice"),
        (["9", "3d_fullres", "--folds", "0"], "no dataset with id 009"),
        (["Dataset004_Other", "3d_fullres", "--folds", "0"], "not found"),
    ],
    ids=["configuration", "fold", "fold twice", "dataset id", "dataset name"],
)
def test_launch_arguments_that_name_nothing(
    env: dict, args: list[str], fragment: str, dry_run: bool
) -> None:
    extra = ["--dry-run"] if dry_run else []
    result = nnui(env, "launch", *args, "--cpu", *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: ") and fragment in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert status(env) == {}  # no job file
    assert list(Path(env["NNUI_STATE_DIR"], "jobs").iterdir()) == []
    assert not Path(env["nnUNet_results"]).exists()  # no run folder, nothing written


def test_launch_with_plans_missing_is_refused_before_writing(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--cpu", "--folds", "0", "--", "-p", "Nope")
    assert result.returncode == 2 and "no plans Nope.json" in result.stderr, result.stderr
    assert not Path(env["nnUNet_results"]).exists()


# ---- kill refuses what is not the job's; resume continues in the job's own roots -----------


def test_kill_of_a_forged_record_is_refused(env: dict) -> None:
    from app.services.jobs.registry import Job, ProcessRecord, Registry
    from app.services.machine.procs import proc_info

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_until(lambda: proc_info(bystander.pid) is not None)
        info = proc_info(bystander.pid)
        registry = Registry(Path(env["NNUI_STATE_DIR"]))
        registry.add(Job(
            job_id="1130-120000-f0-abc", created_at=info.create_time - 1, dataset="D",
            configuration="C", fold="0", mode="single", device="cpu", gpus=[], simulated=False,
            argv=[], env={}, run_dir="/nonexistent", console_path="/nonexistent/c",
            processes=[ProcessRecord(bystander.pid, info.create_time, "trainer", None,
                                     info.start_ticks)],
        ))  # fmt: skip
        result = nnui(env, "kill", "f0-abc", "--yes", "--grace", "1")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "refused" in result.stderr and "NNUI_JOB_ID" in result.stderr
        assert "Traceback" not in result.stderr
        assert bystander.poll() is None  # not signalled
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.slow
def test_resume_continues_in_the_jobs_own_roots(env: dict, tmp_path: Path) -> None:
    from fake_trainer import make_preprocessed

    own = tmp_path / "own"
    make_preprocessed(own / "preprocessed")
    flags = ["--preprocessed", str(own / "preprocessed"), "--results", str(own / "results")]
    result = nnui(env, "launch", "4", "3d_fullres", "--cpu", "--folds", "0", *flags,
                  "--", "--epochs", "300", "--epoch-time", "0.1")  # fmt: skip
    (first,) = launched_ids(result)
    run = status(env)[first]["run_dir"]
    assert run.startswith(str(own / "results"))
    assert wait_until(lambda: (status(env)[first]["epoch"] or 0) >= 2, 20)
    assert nnui(env, "stop", first, "--yes").returncode == 0
    assert wait_until(lambda: status(env)[first]["state"] == "stopped", 20)
    stopped_epoch = status(env)[first]["epoch"]

    # A shell whose nnUNet_* variables point elsewhere (with a dataset of the same id there).
    elsewhere = tmp_path / "elsewhere"
    make_preprocessed(elsewhere / "preprocessed")
    other_env = {**env, "nnUNet_preprocessed": str(elsewhere / "preprocessed"),
                 "nnUNet_results": str(elsewhere / "results")}  # fmt: skip
    result = nnui(other_env, "resume", first)
    # It says what --c continues from (the fake trainer saves no checkpoint file).
    assert f"resume {first}: no checkpoint in " in result.stderr, result.stderr
    (resumed,) = launched_ids(result)
    row = status(other_env)[resumed]
    assert row["run_dir"] == run
    assert wait_until(lambda: (status(other_env)[resumed]["epoch"] or 0) > stopped_epoch, 20)
    assert status(other_env)[resumed]["epoch"] > stopped_epoch  # continued, not from zero
    assert not (elsewhere / "results").exists()
    assert nnui(other_env, "stop", resumed, "--yes").returncode == 0


def test_only_a_bad_registry_file_is_not_no_jobs(env: dict) -> None:
    """Was "no jobs" on stdout while the warning said a job file could not be read."""
    from app.services.jobs.registry import Registry

    registry = Registry(Path(env["NNUI_STATE_DIR"]))
    (registry.jobs_dir / "1130-120000-f1-bad.json").write_text('{"job_id": "1130-')
    result = nnui(env, "status")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "no readable jobs"
    assert "1130-120000-f1-bad.json" in result.stderr and "Traceback" not in result.stderr
