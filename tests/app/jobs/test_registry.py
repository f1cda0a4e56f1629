"""The job registry: round trip, locked updates (two writers), corrupt files set aside."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from app.services.jobs.registry import Job, ProcessRecord, Registry, SignalRecord, new_job_id


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
    assert (registry.jobs_dir / "bad.json").read_text() == content  # looking changes nothing
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


# ---- files that are not jobs: set aside like a corrupt one, the others still load ----------

GOOD = "1130-120000-f0-abc"


def _mutated(**changes: object) -> bytes:
    data = make_job("bad").to_dict()
    data["processes"] = [{"pid": 10, "create_time": 1.0, "role": "supervisor"}]
    for key, value in changes.items():
        if value is KeyError:
            data.pop(key)
        else:
            data[key] = value
    return json.dumps(data).encode()


# (name, file bytes, fragment of the message)
BAD_FILES = [
    ("not UTF-8", b'{"job_id": "bad", "dataset": "\xff\xfe"}', "utf-8"),
    ("not UTF-8 inside a valid job", _mutated(note="x").replace(b'"x"', b'"\xc3\x28"'), "utf-8"),
    ("pid a string", _mutated(processes=[{"pid": "x", "create_time": 1.0, "role": "trainer"}]),
     "processes[0].pid"),
    ("pid zero", _mutated(processes=[{"pid": 0, "create_time": 1.0, "role": "trainer"}]),
     "processes[0].pid"),
    ("pid negative", _mutated(processes=[{"pid": -1, "create_time": 1.0, "role": "trainer"}]),
     "processes[0].pid"),
    ("pid a bool", _mutated(processes=[{"pid": True, "create_time": 1.0, "role": "trainer"}]),
     "processes[0].pid"),
    ("pid huge", _mutated(processes=[{"pid": 10**30, "create_time": 1.0, "role": "trainer"}]),
     "processes[0].pid"),
    ("gpus a number", _mutated(gpus=3), "gpus"),
    ("processes not a list", _mutated(processes={"pid": 1}), "processes"),
    ("a process not an object", _mutated(processes=[7]), "processes[0]"),
    ("a process without pid", _mutated(processes=[{"create_time": 1.0, "role": "x"}]),
     "processes[0]: missing pid"),
    ("signal pid negative", _mutated(signals=[{"t": 1.0, "pid": -5, "signal": "SIGTERM",
                                               "rank": None, "result": "sent"}]), "signals[0].pid"),
    ("created_at a string", _mutated(created_at="later"), "created_at"),
    ("created_at infinite",
     _mutated(created_at=1.0).replace(b'"created_at": 1.0', b'"created_at": 1e400'), "created_at"),
    ("created_at NaN", _mutated(created_at=float("nan")), "created_at"),
    ("exit code a string", _mutated(exit_code="0"), "exit_code"),
    ("env not strings", _mutated(env={"A": 1}), "env"),
    ("argv not a list", _mutated(argv="python -m trainer"), "argv"),
    ("simulated not a bool", _mutated(simulated="yes"), "simulated"),
    ("a required field missing", _mutated(run_dir=KeyError), "missing run_dir"),
    ("names another job", _mutated(job_id="other"), "names job 'other'"),
    ("job id with a slash", _mutated(job_id="../x"), "job_id"),
    ("deep nesting", b"[" * 100000 + b"]" * 100000, "bad.json"),
    ("a huge integer literal", b'{"job_id": ' + b"9" * 5000 + b"}", "bad.json"),
]  # fmt: skip


@pytest.mark.parametrize(("content", "fragment"), [c[1:] for c in BAD_FILES],
                         ids=[c[0] for c in BAD_FILES])  # fmt: skip
def test_bad_job_file_is_set_aside_like_a_corrupt_one(
    tmp_path: Path, content: bytes, fragment: str
) -> None:
    registry = Registry(tmp_path)
    registry.add(make_job(GOOD))
    (registry.jobs_dir / "bad.json").write_bytes(content)
    assert [j.job_id for j in registry.list()] == [GOOD]
    assert (registry.jobs_dir / "bad.json").read_bytes() == content  # left as it is
    assert len(registry.problems) == 1, registry.problems
    assert "corrupt job file bad.json" in registry.problems[0]
    assert fragment in registry.problems[0], registry.problems[0]
    assert "\n" not in registry.problems[0]
    with pytest.raises(KeyError):
        registry.get("bad")
    assert registry.resolve(GOOD[-3:]).job_id == GOOD


def test_unreadable_job_file_is_reported_and_left_alone(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    registry.add(make_job(GOOD))
    (registry.jobs_dir / "odd.json").mkdir()
    assert [j.job_id for j in registry.list()] == [GOOD]
    assert [j.job_id for j in registry.list()] == [GOOD]
    assert len(registry.problems) == 1 and "cannot read job file odd.json" in registry.problems[0]


def test_a_job_with_bad_fields_is_never_written(tmp_path: Path) -> None:
    registry = Registry(tmp_path)
    registry.add(make_job(GOOD))
    with pytest.raises(ValueError, match="processes"):
        registry.add_process(GOOD, ProcessRecord(-1, 1.0, "trainer"))
    with pytest.raises(ValueError, match="gpus"):
        registry.update(GOOD, gpus=3)
    assert registry.get(GOOD).processes == [] and registry.problems == []


def test_refusal_records_keep_pid_zero(tmp_path: Path) -> None:
    # send_stop records a refusal that reached no process with pid 0: valid, never signalled.
    registry = Registry(tmp_path)
    registry.add(make_job(GOOD))
    registry.record_signal(GOOD, SignalRecord(1.0, 0, "SIGUSR1", None, "refused: no"))
    assert registry.get(GOOD).signals[0].pid == 0 and registry.problems == []


@pytest.mark.parametrize("layout", ["state dir is a file", "below a file", "jobs is a file",
                                    "lock is a folder"])  # fmt: skip
def test_unusable_state_dir_is_one_line(tmp_path: Path, layout: str) -> None:
    from app.services.jobs.registry import StateDirError

    state = tmp_path / "state"
    if layout == "state dir is a file":
        state.write_text("x")
    elif layout == "below a file":
        (tmp_path / "file").write_text("x")
        state = tmp_path / "file" / "state"
    elif layout == "jobs is a file":
        state.mkdir()
        (state / "jobs").write_text("x")
    else:
        (state / "jobs").mkdir(parents=True)
        (state / "lock").mkdir()
    with pytest.raises(StateDirError) as caught:
        Registry(state)
    message = str(caught.value)
    assert "\n" not in message and "NNUI_STATE_DIR" in message and str(state) in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_state_dir_is_one_line(tmp_path: Path) -> None:
    from app.services.jobs.registry import StateDirError

    (tmp_path / "state" / "jobs").mkdir(parents=True)
    (tmp_path / "state" / "lock").touch()
    (tmp_path / "state" / "jobs").chmod(0o500)
    try:
        with pytest.raises(StateDirError, match="not writable"):
            Registry(tmp_path / "state")
    finally:
        (tmp_path / "state" / "jobs").chmod(0o700)


def test_list_sees_every_change_and_hands_out_fresh_jobs(tmp_path: Path) -> None:
    """list() reuses what it parsed for unchanged files: a write (update, another
    writer's file, a corrupt overwrite) is seen at once, and a caller's change to a listed
    Job never reaches the next list()."""
    registry = Registry(tmp_path)
    registry.add(make_job())
    first = registry.list()
    first[0].exit_code = 99  # a caller changing its copy
    first[0].env["NNUI_JOB_ID"] = "changed"
    again = registry.list()[0]
    assert again.exit_code is None and again.env["NNUI_JOB_ID"] == "1130-120000-f0-abc"
    registry.update("1130-120000-f0-abc", exit_code=0)
    assert registry.list()[0].exit_code == 0
    Registry(tmp_path).update("1130-120000-f0-abc", exit_code=3)  # another process's write
    assert registry.list()[0].exit_code == 3
    path = tmp_path / "jobs" / "1130-120000-f0-abc.json"
    path.write_text("{not json")  # in place, same size class: still re-read
    assert registry.list() == [] and "corrupt job file" in registry.list_problems[0]


def test_the_boards_list_looks_at_no_job_file_while_the_folder_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """list(copies=False) (the board, every second): an unchanged jobs folder is not looked
    at file by file; a write by another process (a rename into the folder) is seen at the
    next list, a file edited in place within FOLDER_TRUST_S."""
    registry = Registry(tmp_path)
    for n in range(3):
        registry.add(make_job(f"1130-120000-f{n}-abc"))
    assert len(registry.list(copies=False)) == 3
    looked: list[Path] = []
    real = Registry._read_listed

    def counting(self: Registry, path: Path, *rest: object) -> object:
        looked.append(path)
        return real(self, path, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(Registry, "_read_listed", counting)
    assert len(registry.list(copies=False)) == 3 and looked == []
    Registry(tmp_path).update("1130-120000-f1-abc", exit_code=3)  # another process's write
    folder = tmp_path / "jobs"
    stamp = folder.stat().st_mtime_ns
    os.utime(folder, ns=(stamp + 10**9, stamp + 10**9))  # one kernel tick can hold two writes
    listed = {j.job_id: j.exit_code for j in registry.list(copies=False)}
    assert listed["1130-120000-f1-abc"] == 3 and len(looked) == 3
    path = folder / "1130-120000-f2-abc.json"
    data = json.loads(path.read_text())
    data["exit_code"] = 1
    with open(path, "r+") as handle:  # by hand, in place: the folder does not change
        handle.write(json.dumps(data, indent=1))
        handle.truncate()
    monkeypatch.setattr(Registry, "FOLDER_TRUST_S", 0.0)  # the next full look is due
    listed = {j.job_id: j.exit_code for j in registry.list(copies=False)}
    assert listed["1130-120000-f2-abc"] == 1
