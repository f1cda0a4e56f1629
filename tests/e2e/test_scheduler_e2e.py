"""The shared-box scheduler end to end with the fake trainer on simulated GPUs: folds that
wait for a free GPU (another user's busy GPU, each other), a waiting job cancelled by a stop,
crashed runs resumed with --c (`--retries`), ends that are never restarted, and the
`--on-event` hook. Everything is done by the jobs' supervisors after `nnui launch` exited."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until
from test_cli import launched_ids as launched
from test_cli import nnui, status

from app.services.jobs.registry import Job, SignalRecord
from app.services.supervisor.retries import AttemptEnd, describe_exit, restart_reason

ROOT = Path(__file__).resolve().parents[2]
HOOK = """
import json, os, sys
keys = ("NNUI_EVENT", "NNUI_JOB_ID", "NNUI_FOLD", "NNUI_DATASET", "NNUI_DICE", "NNUI_EXIT_CODE",
        "NNUI_REASON", "NNUI_GPUS")
with open(sys.argv[1], "a") as out:
    out.write(json.dumps({k: os.environ.get(k) for k in keys}) + "\\n")
"""


@pytest.fixture
def env(tmp_path: Path):
    values = {**os.environ, **fake_env(tmp_path)}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    values["NNUI_GPU_CLAIMS_DIR"] = str(tmp_path / "claims")
    values["NNUI_SIMULATED_BUSY"] = str(tmp_path / "busy.json")
    (tmp_path / "hook.py").write_text(HOOK)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def hook_flag(env: dict) -> str:
    tmp = Path(env["NNUI_STATE_DIR"]).parent
    return f"{sys.executable} {tmp / 'hook.py'} {tmp / 'hook.jsonl'}"


def hook_calls(env: dict) -> list[dict]:
    path = Path(env["NNUI_STATE_DIR"]).parent / "hook.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def events(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "events.jsonl").read_text().splitlines()]


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    now = most = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


def busy(env: dict, gpus: dict[str, list[dict]]) -> None:
    path = Path(env["NNUI_SIMULATED_BUSY"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(gpus))
    os.replace(tmp, path)


BOB = {"pid": 4411, "user": "bob", "used_gib": 37, "util": 90}


@pytest.mark.slow
def test_three_folds_when_free_on_two_gpus_one_busy(env: dict) -> None:
    busy(env, {"1": [BOB]})  # a colleague's job on GPU 1
    # Fold 0 holds GPU 0 until `go` exists (however slow the box), so fold 1 waits for both.
    go = Path(env["NNUI_STATE_DIR"]).parent / "go"
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0,1,2",
                  "--gpus", "0,1", "--when-free", "--on-event", hook_flag(env), "--",
                  "--epochs", "6", "--epoch-time", "1.0", "--hold-until", str(go))  # fmt: skip
    ids = launched(result)
    assert len(ids) == 3
    # nnui has exited: the supervisors wait. Fold 1 waits for bob's GPU, fold 2 behind it.
    seen: dict = {}

    def bob_named() -> bool:
        seen.update(status(env))  # one reading for the check and the asserts below
        return "bob" in (seen[ids[1]]["waiting_reason"] or "")

    assert wait_until(bob_named)
    rows = seen
    assert "GPU 1: 37 GiB used by user bob (pid 4411)" in rows[ids[1]]["waiting_reason"]
    assert rows[ids[1]]["state"] == "queued" and rows[ids[2]]["state"] == "queued"
    assert rows[ids[2]]["waiting_reason"]

    # GPU 0's reason is fold 0's claim, or its trainer's process once it runs: either one.
    def table_says_why() -> bool:
        table = nnui(env, "status").stdout
        bob = "GPU 1: 37 GiB used by user bob (pid 4411)"
        return f"{ids[1]}: waiting: GPU 0: " in table and bob in table

    assert wait_until(table_says_why)
    go.write_text("")  # fold 0 trains now
    busy(env, {})  # bob is done
    assert wait_until(lambda: all(r["state"] == "finished" for r in status(env).values()), 240)
    rows = status(env)
    spans = []
    for job_id in ids:
        kinds = events(rows[job_id]["run_dir"])
        start = next(e["t"] for e in kinds if e["kind"] == "run_started")
        end = next(e["t"] for e in kinds if e["kind"] == "finished")
        spans.append((start, end))
        assert len(rows[job_id]["gpus"]) == 1 and rows[job_id]["gpus"][0] in ("0", "1")
    assert max_overlap(spans) <= 2  # never more than two at once, on two GPUs
    for i in range(3):  # and never two at once on one GPU
        for j in range(i + 1, 3):
            if rows[ids[i]]["gpus"] == rows[ids[j]]["gpus"]:
                assert spans[i][1] <= spans[j][0] or spans[j][1] <= spans[i][0]
    calls = hook_calls(env)
    assert sorted(c["NNUI_JOB_ID"] for c in calls if c["NNUI_EVENT"] == "finished") == sorted(ids)
    started = [c for c in calls if c["NNUI_EVENT"] == "started"]
    assert len(started) == 3 and all(c["NNUI_GPUS"] in ("0", "1") for c in started)
    finished = [c for c in calls if c["NNUI_EVENT"] == "finished"]
    assert all(c["NNUI_DATASET"] == "Dataset004_Demo" and c["NNUI_DICE"] for c in finished)


@pytest.mark.slow
def test_a_stop_cancels_a_waiting_job(env: dict) -> None:
    busy(env, {"0": [BOB]})
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1",
                              "--folds", "0", "--gpus", "any", "--when-free"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["waiting_reason"] is not None)
    again = nnui(env, "priority", job_id[-3:], "5")  # re-ordered while it waits
    assert again.returncode == 0, again.stderr
    assert status(env)[job_id]["priority"] == 5
    stop = nnui(env, "stop", job_id, "--yes")
    assert stop.returncode == 0, stop.stderr
    assert wait_until(lambda: status(env)[job_id]["state"] == "stopped")
    row = status(env)[job_id]
    assert row["exit_code"] == 0 and row["worker_pids"] == []
    assert not (Path(row["run_dir"]) / "events.jsonl").exists()  # no trainer ever started
    assert nnui(env, "priority", job_id, "1").returncode == 3  # nothing waits any more


@pytest.mark.slow
def test_kill_9_of_the_worker_resumes_with_c(env: dict) -> None:
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds",
                              "0", "--gpus", "0", "--retries", "2", "--on-event", hook_flag(env),
                              "--", "--epochs", "6", "--epoch-time", "3"))  # fmt: skip
    # Read once: the kill must land before the last epoch however slow `nnui status` is
    # (with 0.5 s epochs and two reads, a loaded box saw the worker already gone).
    seen: dict = {}

    def at_epoch_2() -> bool:
        seen.update(status(env)[job_id])
        return (seen["epoch"] or 0) >= 2

    assert wait_until(at_epoch_2)
    (worker,) = seen["worker_pids"]
    os.kill(worker, signal.SIGKILL)  # e.g. the OOM killer: a signal nnui did not send
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished", 240)
    row = status(env)[job_id]
    assert row["restarts"] == ["exit 137 (SIGKILL)"] and row["exit_code"] == 0
    assert "restarts 1/2: exit 137 (SIGKILL)" in nnui(env, "status").stdout
    starts = [e for e in events(row["run_dir"]) if e["kind"] == "run_started"]
    assert len(starts) == 2 and "--c" not in starts[0]["argv"] and "--c" in starts[1]["argv"]
    first = Path(row["run_dir"], f"console.{job_id}.1.log").read_text()
    second = Path(row["console_path"])  # one file per attempt, the current one in the row
    assert second.name == f"console.{job_id}.2.log"
    assert "epoch 0 loss" in first and "restart 1/2 with --c" in first
    assert "attempt 2" in second.read_text() and "epoch 5 loss" in second.read_text()
    assert "epoch 5 loss" not in first
    kinds = [c["NNUI_EVENT"] for c in hook_calls(env)]
    assert kinds == ["restarted", "finished"]
    assert hook_calls(env)[0]["NNUI_REASON"] == "exit 137 (SIGKILL)"
    watched = watch_lines(env, 2)
    assert [(r["event"], r["job_id"]) for r in watched] == [
        ("restarted", job_id), ("finished", job_id)
    ]  # fmt: skip
    assert watched[0]["reason"] == "exit 137 (SIGKILL)" and watched[1]["exit_code"] == 0


def watch_lines(env: dict, count: int) -> list[dict]:
    """The first `count` records `nnui watch --json --all` prints (it follows until ended)."""
    watch = subprocess.Popen(
        [sys.executable, "-m", "app.main", "watch", "--json", "--all"], env=env, cwd=ROOT,
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        return [json.loads(watch.stdout.readline()) for _ in range(count)]
    finally:
        watch.kill()  # by its own Popen handle (pid), never by name
        watch.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainer_flags", "exit_code"),
    [(["--fail-at", "1", "--fail-code", "2"], 2), (["--nan-at", "0", "--fail-at", "1"], 3)],
    ids=["exit 2 (usage)", "NaN loss"],
)
def test_never_restarted(env: dict, trainer_flags: list[str], exit_code: int) -> None:
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds",
                              "0", "--gpus", "0", "--retries", "2", "--on-event", hook_flag(env),
                              "--", "--epochs", "6", "--epoch-time", "0.2",
                              *trainer_flags))  # fmt: skip
    ended = lambda: status(env)[job_id]["exit_code"] is not None  # noqa: E731
    assert wait_until(ended, 120)
    assert wait_until(lambda: len(hook_calls(env)) >= 1)  # the hook runs after the exit code
    row = status(env)[job_id]
    assert row["state"] == "failed"
    assert row["exit_code"] == exit_code and row["restarts"] == []
    assert [e["kind"] for e in events(row["run_dir"])].count("run_started") == 1
    assert [(c["NNUI_EVENT"], c["NNUI_EXIT_CODE"]) for c in hook_calls(env)] == [
        ("failed", str(exit_code))
    ]


@pytest.mark.slow
def test_a_user_kill_is_not_restarted(env: dict) -> None:
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds",
                              "0", "--gpus", "0", "--retries", "2", "--", "--epochs", "300",
                              "--epoch-time", "0.5"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["state"] == "running")
    kill = nnui(env, "kill", job_id, "--yes", "--grace", "5")
    assert kill.returncode == 0, kill.stderr
    assert wait_until(lambda: status(env)[job_id]["state"] == "killed")
    row = status(env)[job_id]
    assert row["restarts"] == [] and row["exit_code"] is not None
    assert [e["kind"] for e in events(row["run_dir"])].count("run_started") == 1


# ---- the restart decision, as a table ----------------------------------------------------


def job(retries: int = 2, restarts: tuple[str, ...] = (), **changes) -> Job:
    values = dict(queued_stop=False, killed_at=None)
    values.update(changes)
    return Job("j", 0.0, "D", "3d_fullres", "0", "single", "cpu", [], True, [], {}, "/r",
               "/r/console.log", retries=retries, restarts=list(restarts), **values)  # fmt: skip


STOP_SENT = [SignalRecord(10.0, 5, "SIGUSR1", 0, "sent")]
OLD_STOP = [SignalRecord(1.0, 5, "SIGUSR1", 0, "sent")]  # to an earlier attempt

RESTART_CASES = [
    ("SIGKILL (OOM killer)", job(), AttemptEnd(-9, False, 5.0), "exit 137 (SIGKILL)"),
    ("crash exit 1", job(), AttemptEnd(1, False, 5.0), "exit 1"),
    ("clean end", job(), AttemptEnd(0, False, 5.0), None),
    ("usage error", job(), AttemptEnd(2, False, 5.0), None),
    ("NaN loss", job(), AttemptEnd(3, True, 5.0), None),
    ("no retries", job(retries=0), AttemptEnd(-9, False, 5.0), None),
    ("retries used up", job(restarts=("exit 1", "exit 1")), AttemptEnd(1, False, 5.0), None),
    ("user stop of this attempt", job(signals=STOP_SENT), AttemptEnd(-10, False, 5.0), None),
    ("stop of an earlier attempt", job(signals=OLD_STOP), AttemptEnd(-9, False, 5.0),
     "exit 137 (SIGKILL)"),
    ("user kill", job(killed_at=6.0), AttemptEnd(-15, False, 5.0), None),
    ("queued stop", job(queued_stop=True), AttemptEnd(1, False, 5.0), None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("the_job", "end", "reason"), [c[1:] for c in RESTART_CASES], ids=[c[0] for c in RESTART_CASES]
)
def test_restart_decision(the_job: Job, end: AttemptEnd, reason: str | None) -> None:
    assert restart_reason(the_job, end) == reason


def test_describe_exit() -> None:
    assert describe_exit(-9) == "exit 137 (SIGKILL)"
    assert describe_exit(-15) == "exit 143 (SIGTERM)"
    assert describe_exit(1) == "exit 1"


USAGE_CASES = [
    (["--share", "--when-free"], "--share needs --min-free-gib or --max-util"),
    (["--max-util", "30"], "go with --when-free"),
    (["--when-free", "--sequential"], "drop --sequential"),
    (["--when-free", "--max-util", "130"], "--max-util must be 0..100"),
    (["--retries", "-1"], "--retries must be 0..1000"),
    (["--on-event", "'unterminated"], "--on-event"),
    (["--on-event", ""], "--on-event needs a command"),
]


@pytest.mark.parametrize(("flags", "message"), USAGE_CASES, ids=[m for _, m in USAGE_CASES])
def test_schedule_usage_errors(env: dict, flags: list[str], message: str) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0",
                  "--gpus", "0", *flags)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr
    assert status(env) == {}  # nothing launched, nothing written


def test_gpus_any_needs_when_free(env: dict) -> None:
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds", "0",
                  "--gpus", "any")  # fmt: skip
    assert result.returncode == 2 and "--gpus any goes with --when-free" in result.stderr


@pytest.mark.slow
def test_a_job_started_at_once_holds_its_gpu_and_a_waiting_job_can_be_killed(env: dict) -> None:
    (running,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1",
                               "--folds", "0", "--gpus", "0", "--", "--epochs", "300",
                               "--epoch-time", "0.5"))  # fmt: skip
    assert wait_until(lambda: status(env)[running]["state"] == "running")
    (waiting,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1",
                               "--folds", "1", "--gpus", "0", "--when-free"))  # fmt: skip
    reason = lambda: status(env)[waiting]["waiting_reason"] or ""  # noqa: E731
    assert wait_until(lambda: f"GPU 0: claimed by nnui job {running}" in reason())
    kill = nnui(env, "kill", waiting, "--yes", "--grace", "5")
    assert kill.returncode == 0, kill.stderr
    assert wait_until(lambda: status(env)[waiting]["state"] == "killed")
    row = status(env)[waiting]
    assert row["worker_pids"] == [] and not (Path(row["run_dir"]) / "events.jsonl").exists()
    assert status(env)[running]["state"] == "running"  # the other job is untouched


@pytest.mark.slow
def test_a_ddp_group_waits_until_all_its_gpus_are_free(env: dict) -> None:
    busy(env, {"1": [BOB]})
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "2", "--folds",
                              "0", "--gpus", "0,1", "--ddp", "spawn", "--when-free", "--",
                              "--epochs", "2", "--epoch-time", "0.3"))  # fmt: skip
    reason = lambda: status(env)[job_id]["waiting_reason"] or ""  # noqa: E731
    assert wait_until(lambda: "GPU 1: 37 GiB used by user bob" in reason())
    assert "GPU 0" not in reason()  # GPU 0 alone is free, but the group needs both
    assert status(env)[job_id]["state"] == "queued"
    busy(env, {})
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished")
    row = status(env)[job_id]
    assert row["gpus"] == ["0", "1"] and row["mode"] == "spawn"
    ranks = next(e for e in events(row["run_dir"]) if e["kind"] == "topology")["ranks"]
    assert len(ranks) == 2


def test_hook_argv_is_split_once_and_never_run_through_a_shell() -> None:
    from app.services.supervisor.hooks import parse_hook

    assert parse_hook("notify-send 'fold done' $HOME;rm") == [
        "notify-send",
        "fold done",
        "$HOME;rm",
    ]


def test_a_stop_during_the_back_off_cancels_the_restart(tmp_path: Path) -> None:
    from app.services.jobs.registry import Registry
    from app.services.supervisor import main as supervisor

    registry = Registry(tmp_path / "state")
    registry.add(job(queued_stop=True))
    assert supervisor._back_off(registry, "j", delay_s=600.0) is False  # at once, not in 600 s
    registry.update("j", queued_stop=False)
    assert supervisor._back_off(registry, "j", delay_s=0.0) is True


@pytest.mark.slow
def test_a_hook_that_cannot_start_costs_the_job_nothing(env: dict) -> None:
    (job_id,) = launched(nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds",
                              "0", "--gpus", "0", "--on-event", "/nonexistent/hook --x", "--",
                              "--epochs", "2", "--epoch-time", "0.2"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished")
    console = Path(status(env)[job_id]["console_path"])
    assert wait_until(lambda: "--on-event command /nonexistent/hook" in console.read_text())
