"""Fuzz (seeded, fast): random and mutated registry files and topologies never make the
registry, `nnui status` or the stop/kill planning raise; bad files are set aside and
reported, good ones load with every field of the right type."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from app.services.jobs.registry import Job, Registry
from app.services.machine.procs import PID_MAX
from app.services.signals.targets import kill_plan, plan_stop

SEEDS = range(4)
FILES_PER_SEED = 60
GOOD_ID = "1130-120000-f0-good"


def _garbage(rng: random.Random, depth: int = 0) -> object:
    pool = [
        None, True, False, 0, -1, -(2**31), 2**64, 10**30, 1.5, float("nan"), float("inf"),
        -1e308, "", "x", "later", "\u0000", "\udcff"[:0] + "é" * 3, "-1", [], {}, [1, "a", None],
        {"pid": -1}, {"pid": "x", "role": 3}, "a" * 5000,
    ]  # fmt: skip
    if depth < 3 and rng.random() < 0.2:
        return [_garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3 and rng.random() < 0.1:
        return {rng.choice(["pid", "rank", "t", "x"]): _garbage(rng, depth + 1)}
    return rng.choice(pool)


def _base(job_id: str) -> dict:
    return {
        "job_id": job_id, "created_at": 1000.0, "dataset": "Dataset004_Demo",
        "configuration": "3d_fullres", "fold": "0", "mode": "single", "device": "cpu",
        "gpus": ["0"], "simulated": True, "argv": ["python", "-m", "trainer"],
        "env": {"NNUI_JOB_ID": job_id}, "run_dir": "runs/x", "console_path": "runs/x/c.log",
        "processes": [{"pid": 10, "create_time": 1001.0, "role": "supervisor", "rank": None,
                       "start_ticks": 5}],
        "signals": [{"t": 1002.0, "pid": 0, "signal": "SIGUSR1", "rank": None,
                     "result": "refused: x"}],
        "exit_code": None, "ended_at": None, "queued_stop": False,
    }  # fmt: skip


def _odd_but_typed(rng: random.Random, data: dict) -> None:
    """Values of the right type that are still odd: they load, and then must not hurt."""
    data["processes"] = [
        {"pid": rng.choice([1, 2, PID_MAX, rng.randint(2, 60000)]),
         "create_time": rng.choice([0.0, -5.0, 1e12, 1000.5]),
         "role": rng.choice(["supervisor", "trainer", "worker", "", "?"]),
         "rank": rng.choice([None, 0, 7]), "start_ticks": rng.choice([None, 0, 2**40])}
        for _ in range(rng.randint(0, 4))
    ]  # fmt: skip
    data["gpus"] = rng.choice([[], ["0"], ["x", ""], ["0", "0", "99"]])
    data["mode"] = rng.choice(["single", "spawn", "torchrun", "weird", ""])
    data["fold"] = rng.choice(["0", "all", "7", ""])
    data["run_dir"] = rng.choice(["", "/", "runs/x", "/nonexistent/fold_0", "\u00e9"])
    data["exit_code"] = rng.choice([None, 0, -9, 2**31])
    data["ended_at"] = rng.choice([None, 0.0, 1e12])
    data["queued_stop"] = rng.choice([True, False])
    data["after"] = rng.choice([None, "1130-120000-f0-001", "nope"])
    data["from_the_future"] = _garbage(rng)


def _mutate(rng: random.Random, data: dict) -> bytes:
    """Odd but typed values (half the cases), or one to three structural mutations, then
    maybe byte-level damage."""
    if rng.random() < 0.5:
        _odd_but_typed(rng, data)
        return json.dumps(data).encode()
    for _ in range(rng.randint(1, 3)):
        choice = rng.random()
        target = data
        if choice < 0.3 and data.get("processes"):
            target = rng.choice(data["processes"]) if isinstance(data["processes"], list) else data
            if not isinstance(target, dict):
                target = data
        key = rng.choice([*target.keys(), "unknown_field"]) if target else "x"
        if rng.random() < 0.15:
            target.pop(key, None)
        else:
            target[key] = _garbage(rng)
    text = json.dumps(data, allow_nan=True).encode()
    damage = rng.random()
    if damage < 0.1:
        text = text[: rng.randint(0, len(text))]
    elif damage < 0.2:
        index = rng.randint(0, max(0, len(text) - 1))
        text = text[:index] + bytes([rng.randint(0x80, 0xFF)]) + text[index + 1 :]
    elif damage < 0.25:
        text = b"[" * 20000 + text
    return text


def _topology(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return _garbage(rng)
    ranks = [
        {"pid": rng.choice([0, -1, 1, 10, PID_MAX + 1, "x", None, True, rng.randint(2, 60000)]),
         "global_rank": rng.choice([0, 1, -1, "a", None]), "host": rng.choice(["localhost", 3])}
        for _ in range(rng.randint(0, 3))
    ]  # fmt: skip
    return {"kind": "topology", "t": _garbage(rng) if rng.random() < 0.3 else 1005.0,
            "ranks": ranks if rng.random() < 0.9 else _garbage(rng)}  # fmt: skip


def _lookup(pid: int):
    return None  # planning only: no process table needed to find the failures


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_registry_files_never_raise(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rng = random.Random(seed)
    registry = Registry(tmp_path / "state")
    registry.add(Job.from_dict(_base(GOOD_ID)))
    names = []
    for index in range(FILES_PER_SEED):
        job_id = f"1130-120000-f0-{index:03d}"
        names.append(job_id)
        (registry.jobs_dir / f"{job_id}.json").write_bytes(_mutate(rng, _base(job_id)))

    jobs = registry.list()
    loaded = {j.job_id for j in jobs}
    assert GOOD_ID in loaded
    for job_id in names:
        set_aside = any(f"{job_id}.json " in p for p in registry.problems)
        assert (registry.jobs_dir / f"{job_id}.json").exists()  # never renamed by a reader
        assert (job_id in loaded) is not set_aside, job_id
        if set_aside:
            assert any(f"{job_id}.json" in p for p in registry.problems)
    for job in jobs:
        assert Job.from_dict(job.to_dict()) == job  # well-typed: it round-trips
        assert all(0 < p.pid <= PID_MAX for p in job.processes)
        for _ in range(3):
            plan = plan_stop(job, _topology(rng), None, proc_lookup=_lookup)  # type: ignore[arg-type]
            assert not plan.ok and plan.targets == ()
        assert kill_plan(job, _lookup, lambda pid: [], lambda job_id: []).targets == ()

    # The headless status over the same folder: the good job and every loaded one, no traceback.
    from app.main import main

    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    for args in (["status", "--all"], ["status", "--all", "--json"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert GOOD_ID in out and all(job_id in out for job_id in loaded)


def test_fuzzed_topologies_never_raise_against_real_processes() -> None:
    """plan_stop and the process table (/proc) with random topologies: refusals, no crash."""
    rng = random.Random(7)
    job = Job.from_dict(_base(GOOD_ID))
    for _ in range(300):
        plan = plan_stop(job, _topology(rng), None)  # type: ignore[arg-type]
        assert not plan.ok and plan.targets == ()
