"""Job views: state table, epoch/N, ETA per fold and for the cross-validation, alerts, and
incremental refresh over frozen run folders."""

from __future__ import annotations

import ast
import json
import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from app.services.cross_validation import cross_validation_eta_s
from app.services.jobs import views as jobs_module
from app.services.jobs.registry import Job, ProcessRecord, Registry, SignalRecord
from app.services.jobs.simulated_load import simulated_gpu_load
from app.services.jobs.views import JobTracker, JobView
from app.services.machine.gpus import GIB, GpuMonitor, GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.machine.procs import proc_info
from trainer.schema.events import encode_event
from trainer.schema.status import State

NOW = time.time()
_ME = proc_info(os.getpid())
ME_ALIVE = ProcessRecord(_ME.pid, _ME.create_time, "supervisor", None, _ME.start_ticks)
DEAD = ProcessRecord(999_999_1, 1.0, "supervisor")


def add_job(registry: Registry, tmp: Path, job_id: str, **changes: object) -> Job:
    folder = tmp / job_id
    folder.mkdir(parents=True, exist_ok=True)
    values = dict(
        job_id=job_id, created_at=NOW - 100, dataset="Dataset004_Demo",
        configuration="3d_fullres", fold="0", mode="single", device="cuda", gpus=["0"],
        simulated=False, argv=[], env={}, run_dir=str(folder),
        console_path=str(folder / "console.log"), processes=[DEAD],
    )  # fmt: skip
    values.update(changes)
    job = Job(**values)
    registry.add(job)
    return job


def write_events(job: Job, *lines: str) -> None:
    with open(Path(job.run_dir) / "events.jsonl", "a") as handle:
        handle.write("".join(lines))


def run_started(t: float, num_epochs: int = 10) -> str:
    return encode_event("run_started", t=t, num_epochs=num_epochs, world_size=1)


def topology(t: float) -> str:
    return encode_event("topology", t=t, ranks=[{"global_rank": 0, "pid": 1, "host": "h"}])


def epoch(t: float, n: int, loss: float = 0.5, seconds: float = 2.0) -> str:
    return encode_event(
        "epoch_ended", t=t, epoch=n, train_loss=loss, val_loss=0.6, mean_fg_dice=0.7,
        ema_fg_dice=0.65, lr=0.01, epoch_time_s=seconds, iterations_per_s=125.0,
    )  # fmt: skip


T = NOW - 50  # events of the job under test (after its created_at)
# (name, job changes, event lines, expected state)
STATE_CASES = [
    ("starting", dict(processes=[ME_ALIVE]), [], "starting"),
    ("running", dict(processes=[ME_ALIVE]), [run_started(T), topology(T)], "running"),
    ("stopping (signal sent)",
     dict(processes=[ME_ALIVE], signals=[SignalRecord(T, 1, "SIGUSR1", 0, "sent")]),
     [run_started(T), topology(T)], "stopping"),
    ("stopping (trainer says so)", dict(processes=[ME_ALIVE]),
     [run_started(T), topology(T), encode_event("stop_requested", t=T, epoch=1)], "stopping"),
    ("stopping (SIGUSR1 heard mid-epoch)", dict(processes=[ME_ALIVE]),
     [run_started(T), topology(T), encode_event("stop_heard", t=T, epoch=0)], "stopping"),
    ("stop queued before topology", dict(processes=[ME_ALIVE], queued_stop=True), [], "stopping"),
    ("queued behind another job", dict(processes=[ME_ALIVE], after="other"), [], "queued"),
    ("stopped", dict(exit_code=0), [run_started(T), encode_event("stopped", t=T)], "stopped"),
    ("finished", dict(exit_code=0), [run_started(T), encode_event("finished", t=T)], "finished"),
    ("failed by exit code", dict(exit_code=1), [run_started(T)], "failed"),
    ("killed", dict(exit_code=-15), [run_started(T), epoch(T, 0)], "failed"),
    ("lost: no process, no exit code", dict(), [run_started(T), topology(T), epoch(T, 0)], "lost"),
    ("ended without supervisor record", dict(), [run_started(T), encode_event("stopped", t=T)],
     "stopped"),
    ("an earlier run's stop is not this job's", dict(processes=[ME_ALIVE]),
     [encode_event("stopped", t=NOW - 1000), run_started(T), topology(T)], "running"),
    ("stopped before its turn", dict(exit_code=0, after="x", note="stopped before it started"),
     [], "stopped"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "events", "state"), [c[1:] for c in STATE_CASES], ids=[c[0] for c in STATE_CASES]
)
def test_state_table(tmp_path: Path, changes: dict, events: list[str], state: str) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", **changes)
    write_events(job, *events)
    (view,) = JobTracker(registry).refresh()
    assert view.state == state


def test_progress_eta_and_failed_console(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    write_events(
        job, run_started(T), topology(T), *(epoch(T + i, i, seconds=2 + i) for i in range(4))
    )
    tracker = JobTracker(registry)
    (view,) = tracker.refresh()
    assert (view.state, view.epoch, view.num_epochs) == ("running", 4, 10)
    assert (view.train_loss, view.val_loss, view.mean_dice, view.ema_dice, view.it_per_s) == (
        0.5, 0.6, 0.7, 0.65, 125.0,
    )  # fmt: skip
    # 6 epochs left x the median recent epoch time, counted down since the last epoch
    # ended (~47 s ago, longer than an epoch: the 5 after the overrunning one remain).
    assert view.eta_s == pytest.approx(5 * 3.5)
    assert [p.epoch for p in view.history] == [0, 1, 2, 3]
    # incremental: only the appended epoch is read
    write_events(job, epoch(T + 5, 4, seconds=3.5))
    (view,) = tracker.refresh()
    assert view.epoch == 5 and view.eta_s == pytest.approx(4 * 3.5)


def test_failed_job_shows_exit_code_and_console(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", exit_code=2)
    Path(job.console_path).write_text("".join(f"line {i}\n" for i in range(100)) + "Boom\n")
    (view,) = JobTracker(registry).refresh()
    assert (view.state, view.exit_code) == ("failed", 2)
    assert view.console_tail[-1] == "Boom" and len(view.console_tail) <= 40


def test_resumed_run_keeps_the_earlier_curve(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    old = NOW - 1000
    write_events(
        job, run_started(old), epoch(old, 0), epoch(old, 1), encode_event("stopped", t=old)
    )
    write_events(job, run_started(T), topology(T), epoch(T, 2))
    (view,) = JobTracker(registry).refresh()
    assert view.state == "running" and [p.epoch for p in view.history] == [0, 1, 2]


def snapshot_with_alice() -> MachineSnapshot:
    alice = GpuProcess(4242, "alice", GIB, "python", False)
    gpu = GpuSnapshot(0, "H100", "GPU-0", GIB, 80 * GIB, 50, 40, 100.0, (alice,))
    return MachineSnapshot((gpu,), False, None, NOW)


def test_alerts_nan_stalled_foreign(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    stale = NOW - 400
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=stale - 10)
    write_events(job, run_started(stale), topology(stale), epoch(stale, 0, loss=math.nan))
    (view,) = JobTracker(registry).refresh(snapshot_with_alice())
    # Quiet alone is no stall: the supervisor's watchdog (stall.py) decides, the view reads it.
    assert not any(a.startswith("stalled") for a in view.alerts)
    registry.update("j", stalled_at=NOW, stall_reason="no event for 400 s, no CPU progress")
    (view,) = JobTracker(registry).refresh(snapshot_with_alice())
    assert view.train_loss is None
    kinds = sorted(alert.split(" ")[0] for alert in view.alerts)
    assert kinds == ["GPU", "NaN", "stalled:"], view.alerts
    assert any("alice" in a for a in view.alerts)


@pytest.mark.parametrize(
    ("shares", "alert"),
    [((0.5, 0.4, 0.45), True), ((0.5, 0.1, 0.45), False), ((0.5, 0.5), False),
     ((0.1, 0.1, 0.1), False)],
)  # fmt: skip
def test_data_wait_share_is_shown_and_alerts_when_it_stays_high(
    tmp_path: Path, shares: tuple, alert: bool
) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    lines = [run_started(T), topology(T)]
    for n, share in enumerate(shares):
        line = json.loads(epoch(T + n, n))
        line["data_wait_share"] = share
        lines.append(json.dumps(line) + "\n")
    write_events(job, *lines)
    (view,) = JobTracker(registry).refresh()
    assert view.state == "running" and view.data_wait_share == shares[-1]
    waiting = [a for a in view.alerts if a.startswith("waiting for data")]
    assert bool(waiting) is alert, view.alerts
    if alert:
        assert "45%" in waiting[0] and "--num-workers" in waiting[0]


def test_recent_events_are_not_stalled(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    now = time.time()  # not the module's NOW: a slow suite can reach this test minutes later
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE], created_at=now - 100)
    write_events(job, run_started(now - 5), topology(now - 5), epoch(now - 1, 0, seconds=30))
    (view,) = JobTracker(registry).refresh()
    assert view.alerts == ()


def view(job_id: str, state: str, eta: float | None, after: str | None = None) -> JobView:
    job = Job(job_id, 0, "D", "C", "0", "single", "cuda", ["0"], False, [], {}, "/r", "/c",
              after=after)  # fmt: skip
    return JobView(job, state, 1, 10, None, None, None, None, None, eta, (), None, (), (), None,
                   mean_epoch_time_s=None if eta is None else 2.0)  # fmt: skip


@pytest.mark.parametrize(
    ("views", "expected"),
    [
        ([view("a", "running", 20.0), view("b", "running", 50.0)], 50.0),  # parallel
        ([view("a", "running", 20.0), view("b", "queued", None, after="a")], 20.0 + 9 * 2.0),
        ([view("a", "finished", None), view("b", "running", 5.0)], 5.0),
        ([view("a", "finished", None)], None),
    ],
)
def test_cross_validation_eta(tmp_path: Path, views: list[JobView], expected: float | None) -> None:
    assert cross_validation_eta_s(views) == expected


def test_simulated_gpu_load_follows_live_simulated_jobs(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    trainer = ProcessRecord(ME_ALIVE.pid, ME_ALIVE.create_time, "trainer", None, _ME.start_ticks)
    add_job(registry, tmp_path, "live", simulated=True, gpus=["1"], processes=[trainer])
    add_job(registry, tmp_path, "ended", simulated=True, gpus=["0"], processes=[trainer],
            exit_code=0)  # fmt: skip
    add_job(registry, tmp_path, "real", gpus=["0"], processes=[trainer])
    assert simulated_gpu_load(registry) == {1: [(os.getpid(), "nnui live")]}


def test_ended_job_ignores_the_resumed_run_in_its_folder(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    t0 = NOW - 100
    old = add_job(registry, tmp_path, "old", created_at=t0, exit_code=0, ended_at=t0 + 10)
    new = add_job(registry, tmp_path, "new", created_at=t0 + 20, run_dir=old.run_dir,
                  console_path=old.console_path, processes=[ME_ALIVE])  # fmt: skip
    write_events(old, run_started(t0 + 1), epoch(t0 + 2, 0), encode_event("stopped", t=t0 + 3))
    write_events(new, run_started(t0 + 21), topology(t0 + 21), epoch(t0 + 22, 1))
    write_events(new, encode_event("failed", t=t0 + 23))
    views = {v.job.job_id: v for v in JobTracker(registry).refresh()}
    assert (views["old"].state, views["old"].epoch) == ("stopped", 1)
    assert (views["new"].state, views["new"].epoch) == ("failed", 2)
    assert [p.epoch for p in views["new"].history] == [0, 1]


BAD_LINES = [
    '{"v":1,"t":TIME,"kind":"epoch_ended","epoch":null}',
    '{"v":1,"t":TIME,"kind":"epoch_ended","epoch":"abc"}',
    '{"v":1,"t":TIME,"kind":"epoch_ended","epoch":1e400}',
    '{"v":1,"t":TIME,"kind":"topology","ranks":[{"pid":-1}]}',
    '{"v":1,"t":TIME,"kind":"topology","ranks":[{"pid":0}]}',
    '{"v":1,"t":TIME,"kind":"topology","ranks":"all"}',
    '{"v":1,"t":"later","kind":"epoch_ended","epoch":1}',
]


@pytest.mark.parametrize("bad", BAD_LINES)
def test_one_bad_record_costs_only_itself(tmp_path: Path, bad: str) -> None:
    registry = Registry(tmp_path / "state")
    broken = add_job(registry, tmp_path, "broken", processes=[ME_ALIVE])
    fine = add_job(registry, tmp_path, "fine", processes=[ME_ALIVE])
    line = bad.replace("TIME", repr(T)) + "\n"
    write_events(broken, run_started(T), epoch(T, 0), line, topology(T), epoch(T, 1))
    write_events(fine, run_started(T), topology(T), epoch(T, 0))
    views = {v.job.job_id: v for v in JobTracker(registry).refresh()}
    assert (views["broken"].state, views["broken"].epoch) == ("running", 2)
    assert views["broken"].topology["ranks"][0]["pid"] == 1
    assert views["broken"].num_invalid_events == 1
    assert "1 invalid event lines skipped" in views["broken"].alerts
    assert (views["fine"].state, views["fine"].epoch) == ("running", 1)
    # (T is fixed at import: on a slow run a "stalled" alert may come up, never this one.)
    assert not any("invalid" in alert for alert in views["fine"].alerts)


def test_a_torn_line_before_the_topology_does_not_hide_it(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    write_events(job, run_started(T), epoch(T, 0)[:20], topology(T))  # a writer died mid-line
    (view,) = JobTracker(registry).refresh()
    assert view.state == "running" and view.topology is not None
    assert view.num_invalid_events == 1


def test_views_carry_states_of_the_one_enum(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    add_job(registry, tmp_path, "j")
    (view,) = JobTracker(registry).refresh()
    assert view.state is State.LOST and view.state == "lost"


def test_gpus_does_not_import_jobs() -> None:
    """The services gpus<->jobs cycle stays cut: the simulated load is the caller's."""
    source = (
        Path(__file__).resolve().parents[3] / "app" / "services" / "machine" / "gpus.py"
    ).read_text()
    imported = {
        node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    }
    assert not {"app.services.jobs.views", "app.services.jobs.registry"} & imported
    assert all(not g.processes for g in GpuMonitor(simulate=2).snapshot().gpus)


def test_unchanged_files_are_not_parsed_again_and_changes_show(tmp_path: Path, monkeypatch) -> None:
    """A refresh with nothing new hands back the same Job, epochs and console (nothing
    re-read or re-copied); a registry write, a new epoch and a console line show at the next
    refresh, and the ETA still counts down between epochs."""
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    write_events(job, run_started(time.time() - 5), topology(time.time() - 5))
    write_events(job, epoch(time.time() - 3, 0, seconds=100.0))
    Path(job.console_path).write_text("epoch 0\n")
    tracker = JobTracker(registry)
    (first,) = tracker.refresh()
    later = time.time() + 7  # the ETA's clock moves on 7 s
    monkeypatch.setattr(jobs_module, "time", SimpleNamespace(time=lambda: later))
    (again,) = tracker.refresh()
    assert again.job is first.job  # the cached registry entry, not a fresh deep copy
    assert again.history is first.history and again.console_tail is first.console_tail
    assert again.eta_s == pytest.approx(first.eta_s - 7, abs=0.5)  # nothing new in the files
    assert registry.list()[0] is not first.job  # other readers still get their own copy
    registry.update("j", note="changed")
    write_events(job, epoch(time.time(), 1, seconds=100.0))
    with open(job.console_path, "a") as handle:
        handle.write("epoch 1\n")
    (changed,) = tracker.refresh()
    assert changed.job is not first.job and changed.job.note == "changed"
    assert [p.epoch for p in changed.history] == [0, 1] and changed.epoch == 2
    assert changed.console_tail == ("epoch 0", "epoch 1")


def test_the_run_s_class_names_reach_the_view(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j", processes=[ME_ALIVE])
    names = ["whole tumor", "tumor core", "enhancing tumor"]
    write_events(job, encode_event("run_started", t=T, num_epochs=5, world_size=1,
                                   class_names=names), topology(T))  # fmt: skip
    (view,) = JobTracker(registry).refresh()
    assert view.class_names == tuple(names)
