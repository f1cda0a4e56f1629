"""The stall watchdog: the rule as a table, and end to end with a fake trainer that hangs
(no event, no CPU) — the job's supervisor flags it, stops or kills it, records it, and a
final validation that takes long is never flagged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until
from test_cli import nnui, status
from test_scheduler_e2e import job as a_job

from app.services.jobs.registry import Registry
from app.services.supervisor.retries import AttemptEnd, restart_reason
from app.services.supervisor.stall import StallTracker, allowance_s

ROOT = Path(__file__).resolve().parents[3]


def epoch(t: float, took_s: float) -> dict:
    return {"t": t, "kind": "epoch_ended", "epoch": 0, "epoch_time_s": took_s}


def test_allowance_is_a_factor_of_the_median_epoch_with_a_floor() -> None:
    assert allowance_s([10.0, 12.0, 400.0], False, 30.0) == 60.0  # 5 x median 12
    assert allowance_s([1.0, 1.0], False, 30.0) == 30.0  # the floor
    assert allowance_s([], False, 30.0) == 90.0  # before the first epoch: 3 x floor
    assert allowance_s([12.0], True, 30.0) == 360.0  # final validation: 30 epochs
    assert allowance_s([1.0], True, 30.0) == 300.0  # ... or 10 x floor


def tracker_after(records: list[dict]) -> StallTracker:
    tracker = StallTracker(floor_s=10.0, started_at=0.0)
    for record in records:
        tracker.see(record)
    return tracker


def test_quiet_and_idle_is_stalled_quiet_but_busy_is_not() -> None:
    tracker = tracker_after([epoch(2.0, 2.0), epoch(4.0, 2.0)])
    tracker.sample_cpu(5.0, 4.0)
    assert tracker.verdict(13.0) is None  # within the floor
    tracker.sample_cpu(5.1, 20.0)  # 0.1 CPU-s in 16 s: asleep
    assert "no event for 16 s" in (tracker.verdict(20.0) or "")
    busy = tracker_after([epoch(2.0, 2.0), epoch(4.0, 2.0)])
    busy.sample_cpu(5.0, 4.0)
    busy.sample_cpu(14.0, 18.0)  # computing without writing events: progress
    assert busy.verdict(20.0) is None


def test_final_validation_gets_the_larger_allowance() -> None:
    records = [epoch(2.0, 2.0), {"t": 3.0, "kind": "validation_started"}]
    tracker = tracker_after(records)
    tracker.sample_cpu(1.0, 3.0)
    assert tracker.verdict(50.0) is None  # 47 s quiet < 10 x floor
    assert "in final validation" in (tracker.verdict(200.0) or "")
    tracker.see({"t": 201.0, "kind": "validation_finished"})
    assert tracker.verdict(205.0) is None


def test_a_watchdog_ended_attempt_is_restarted_even_after_a_clean_stop() -> None:
    from app.services.jobs.registry import SignalRecord

    stopped = a_job(stall_acted_at=10.0, stall_reason="no event for 9 s",
                    signals=[SignalRecord(10.0, 5, "SIGUSR1", 0, "sent")])  # fmt: skip
    reason = restart_reason(stopped, AttemptEnd(0, False, 5.0))
    assert reason is not None and reason.startswith("stalled (no event for 9 s)")
    assert restart_reason(a_job(retries=0, stall_acted_at=10.0), AttemptEnd(0, False, 5.0)) is None
    user_stop_first = a_job(
        stall_acted_at=10.0, signals=[SignalRecord(8.0, 5, "SIGUSR1", 0, "sent")]
    )
    assert restart_reason(user_stop_first, AttemptEnd(0, False, 5.0)) is None


# ---- end to end: the supervisor acts ------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path):
    values = {**os.environ, **fake_env(tmp_path)}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    values["NNUI_GPU_CLAIMS_DIR"] = str(tmp_path / "claims")
    values["NNUI_SIMULATED_BUSY"] = str(tmp_path / "busy.json")
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def launch(env: dict, *flags: str, trainer: tuple[str, ...]) -> str:
    result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds", "0",
                  "--gpus", "0", *flags, "--", "--epochs", "6", "--epoch-time", "0.2",
                  *trainer)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[0]


def job_events(env: dict) -> list[dict]:
    path = Path(env["NNUI_STATE_DIR"]) / "job_events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_a_hung_run_is_stopped_gracefully_by_its_supervisor(env: dict) -> None:
    job_id = launch(env, "--stall-action", "stop", "--stall-min-s", "2",
                    trainer=("--hang-at", "2"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["state"] == "stopped", 120)
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    (worker,) = [p.pid for p in job.processes if p.role == "worker"]
    usr1 = [s for s in job.signals if s.signal == "SIGUSR1"]
    assert [(s.pid, s.result) for s in usr1] == [(worker, "sent")]
    assert not any(s.signal in ("SIGTERM", "SIGKILL") for s in job.signals)
    assert job.stall_acted_at is not None and "no CPU progress" in (job.stall_reason or "")
    assert wait_until(lambda: [e["event"] for e in job_events(env)] == ["stalled", "stopped"])
    assert "no event for" in job_events(env)[0]["reason"]
    assert "ended by the stall watchdog (stop)" in nnui(env, "status").stdout


@pytest.mark.slow
def test_a_stop_that_is_not_heeded_is_followed_by_a_kill(env: dict) -> None:
    job_id = launch(env, "--stall-action", "stop", "--stall-min-s", "1",
                    trainer=("--hang-at", "2", "--hang-hard"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["exit_code"] is not None, 180)
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    sent = [s.signal for s in job.signals if s.result == "sent"]
    assert sent == ["SIGUSR1", "SIGTERM"]  # graceful first; the grace period; then the kill
    assert job.exit_code == -15 and job.restarts == []  # no --retries: not restarted


@pytest.mark.slow
def test_kill_action_and_a_retry_resumes_the_run(env: dict) -> None:
    job_id = launch(env, "--stall-action", "kill", "--stall-min-s", "2", "--retries", "1",
                    trainer=("--hang-at", "2", "--ignore-term"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished", 180)
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    sent = [(s.signal, s.result) for s in job.signals]
    assert ("SIGTERM", "sent") in sent and ("SIGKILL", "sent") in sent  # TERM ignored: KILL
    assert "SIGUSR1" not in [s for s, _ in sent]
    assert len(job.restarts) == 1 and job.restarts[0].startswith("stalled (")
    assert "exit 137 (SIGKILL)" in job.restarts[0]
    # The registry says "finished" a moment before the supervisor announces it.
    events = ["stalled", "restarted", "finished"]
    assert wait_until(lambda: [e["event"] for e in job_events(env)] == events, 60)


@pytest.mark.slow
def test_a_long_final_validation_is_not_a_stall(env: dict) -> None:
    job_id = launch(env, "--stall-action", "kill", "--stall-min-s", "1",
                    trainer=("--validation-time", "4"))  # fmt: skip
    assert wait_until(lambda: status(env)[job_id]["state"] == "finished", 120)
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    assert job.stalled_at is None and job.stall_acted_at is None and job.signals == []
    # The state is the trainer's; the supervisor's "finished" event follows its reaping.
    assert wait_until(lambda: [e["event"] for e in job_events(env)] == ["finished"], 120)


@pytest.mark.slow
def test_flag_only_by_default_shown_in_status_and_a_user_stop_still_works(env: dict) -> None:
    job_id = launch(env, "--stall-min-s", "1", "--retries", "1", trainer=("--hang-at", "2"))

    def stalled() -> bool:
        return any(a.startswith("stalled: no event for") for a in status(env)[job_id]["alerts"])

    assert wait_until(stalled, 120)
    assert "stalled: no event for" in nnui(env, "status").stdout
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    assert job.stall_acted_at is None and job.signals == []  # none: nothing sent
    assert nnui(env, "stop", job_id, "--yes").returncode == 0  # the user's stop
    assert wait_until(lambda: status(env)[job_id]["state"] == "stopped", 120)
    job = Registry(Path(env["NNUI_STATE_DIR"])).get(job_id)
    assert job.restarts == []  # a user's stop is never restarted
    # The state comes from the trainer's status file; the supervisor's own "stopped" event
    # follows once it has reaped the trainer: wait for it, do not race it.
    assert wait_until(lambda: [e["event"] for e in job_events(env)] == ["stalled", "stopped"], 120)


def test_stall_flag_usage_errors(env: dict) -> None:
    for flags, message in [(["--stall-min-s", "0"], "--stall-min-s must be > 0"),
                           (["--stall-action", "pause"], "invalid choice: 'pause'")]:  # fmt: skip
        result = nnui(env, "launch", "4", "3d_fullres", "--simulate-gpus", "1", "--folds", "0",
                      "--gpus", "0", *flags)  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
