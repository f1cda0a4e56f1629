"""The job registry: round trip, locked updates (two writers), corrupt files set aside."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from app.services.registry import Job, ProcessRecord, Registry, SignalRecord, new_job_id


def make_job(job_id: str = "1130-120000-f0-abc", **changes: object) -> Job:
    values = dict(
        job_id=job_id, created_at=time.time(), dataset="Dataset004_Demo",
        configuration="3d_fullres", fold="0", mode="single", device="cuda", gpus=["0"],
        simulated=False, argv=["python", "-m", "trainer"], env={"NNUI_JOB_ID": job_id},
        run_dir="/r", console_path="/r/console.log",
    )  # fmt: skip
    values.update(changes)
    return Job(**values)


def test_round_trip_and_update(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    job = make_job(processes=[ProcessRecord(1, 2.5, "supervisor")])
    registry.add(job)
    assert registry.get(job.job_id) == job
    updated = registry.update(job.job_id, exit_code=0, ended_at=3.0)
    assert (updated.exit_code, registry.get(job.job_id).ended_at) == (0, 3.0)
    registry.record_signal(job.job_id, SignalRecord(4.0, 7, "SIGUSR1", 0, "sent"))
    assert registry.get(job.job_id).signals == [SignalRecord(4.0, 7, "SIGUSR1", 0, "sent")]
    with pytest.raises(KeyError):
        registry.get("nope")
    with pytest.raises(ValueError, match="already exists"):
        registry.add(job)
    with pytest.raises(AttributeError):
        registry.update(job.job_id, no_such_field=1)


def test_state_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "s"))
    Registry().add(make_job())
    assert (tmp_path / "s" / "jobs" / "1130-120000-f0-abc.json").is_file()


def test_unknown_keys_are_ignored_for_forward_compatibility(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    data = make_job().to_dict() | {"from_the_future": 1}
    (registry.jobs_dir / "1130-120000-f0-abc.json").write_text(json.dumps(data))
    assert registry.get("1130-120000-f0-abc").fold == "0"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"job_id": "x"}', ""])
def test_corrupt_file_is_set_aside_and_reported(tmp_path: Path, content: str) -> None:
    registry = Registry(tmp_path)
    registry.add(make_job("good"))
    (registry.jobs_dir / "bad.json").write_text(content)
    assert [j.job_id for j in registry.list()] == ["good"]
    assert (registry.jobs_dir / "bad.json.corrupt").exists()
    assert len(registry.problems) == 1 and "bad.json" in registry.problems[0]
    assert [j.job_id for j in registry.list()] == ["good"]  # reported once


def _append_signals(state_dir: str, count: int, pid: int) -> None:
    registry = Registry(Path(state_dir))
    for i in range(count):
        registry.record_signal("shared", SignalRecord(float(i), pid, "SIGUSR1", None, "sent"))


def test_two_writers_lose_nothing(tmp_path: Path) -> None:
    Registry(tmp_path).add(make_job("shared"))
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_signals, args=(str(tmp_path), 40, p)) for p in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    signals = Registry(tmp_path).get("shared").signals
    assert sorted(s.pid for s in signals) == [1] * 40 + [2] * 40


def test_resolve_by_prefix_or_suffix(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    registry.add(make_job("1130-120000-f0-abc"))
    registry.add(make_job("1130-120000-f1-def"))
    assert registry.resolve("1130-120000-f0-abc").fold == "0"
    assert registry.resolve("def").job_id == "1130-120000-f1-def"
    with pytest.raises(KeyError, match="several"):
        registry.resolve("1130")
    with pytest.raises(KeyError, match="no job"):
        registry.resolve("zzz")
    with pytest.raises(KeyError):
        registry.get("../etc/passwd")


def test_job_ids_are_unique_and_name_the_fold() -> None:
    ids = {new_job_id("all", when=0.0) for _ in range(50)}
    assert len(ids) > 40 and all("-fall-" in i for i in ids)
