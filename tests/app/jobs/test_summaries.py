"""History at the cost of what changed: the board and `nnui status` read a finished run's
events.jsonl once, keep a compact summary in nnui's own state folder, and afterwards read
only what was appended (or all again when the file was replaced); looking writes nothing
into run folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_jobs import add_job, epoch, run_started, topology, write_events

from app.main import main
from app.services import tail as tail_module
from app.services.jobs.adopted import EndedScan
from app.services.jobs.registry import Registry
from app.services.jobs.summaries import CACHE_DIR, CACHE_FILE
from app.services.jobs.views import JobTracker
from trainer.schema.events import encode_event
from trainer.schema.tree import EVENTS_FILE

T = 1_700_000_000.0
NUM_EPOCHS = 30


class ByteCount:
    """Bytes read through the tail layer (the one reader of events files), per file name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read: dict[str, int] = {}
        real = tail_module._open_regular

        def counting(path: Path) -> Any:
            handle = real(path)
            if handle is None:
                return None
            count, name = self, Path(path).name

            class Counted:
                def __enter__(self) -> Counted:
                    return self

                def __exit__(self, *exc: object) -> None:
                    handle.close()

                def fileno(self) -> int:
                    return handle.fileno()

                def seek(self, offset: int) -> int:
                    return handle.seek(offset)

                def read(self, size: int = -1) -> bytes:
                    data = handle.read(size)
                    count.read[name] = count.read.get(name, 0) + len(data)
                    return data

            return Counted()

        monkeypatch.setattr(tail_module, "_open_regular", counting)

    def events(self) -> int:
        return self.read.get(EVENTS_FILE, 0)


def finished_run(registry: Registry, tmp: Path, job_id: str = "0101-000000-f0-aaa"):
    job = add_job(registry, tmp, job_id, exit_code=0, created_at=T - 10, ended_at=T + 500)
    lines = [run_started(T, num_epochs=NUM_EPOCHS), topology(T)]
    lines += [epoch(T + 1 + n, n, loss=0.5 - n / 100) for n in range(NUM_EPOCHS)]
    lines += [encode_event("validation_finished", t=T + 400, mean_fg_dice=0.8125, num_cases=2),
              encode_event("finished", t=T + 401)]  # fmt: skip
    write_events(job, *lines)
    return job


def row(registry: Registry) -> tuple:
    (view,) = JobTracker(Registry(registry.state_dir)).refresh()
    return view.state, view.epoch, view.train_loss, view.final_dice, len(view.history)


def test_a_new_reader_reads_no_byte_of_an_unchanged_finished_run(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    finished_run(registry, tmp_path)
    first = row(registry)  # reads the file once, writes the summary
    assert first[:4] == ("finished", NUM_EPOCHS, pytest.approx(0.21), pytest.approx(0.8125))
    assert (tmp_path / "state" / CACHE_DIR / CACHE_FILE).is_file()
    count = ByteCount(monkeypatch)
    tracker = JobTracker(Registry(registry.state_dir))  # another nnui, started later
    (view,) = tracker.refresh()
    (again,) = tracker.refresh()  # and its next poll
    assert count.events() == 0
    assert (view.state, view.epoch, view.final_dice) == ("finished", NUM_EPOCHS, 0.8125)
    assert again.epoch == NUM_EPOCHS and view.history[-1].epoch == NUM_EPOCHS - 1
    assert view.started_t == T and view.checkpoints == again.checkpoints


def test_an_appended_file_is_read_from_its_last_offset_only(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    row(registry)
    extra = encode_event("stop_requested", t=T + 402, epoch=NUM_EPOCHS - 1)
    write_events(job, extra)
    count = ByteCount(monkeypatch)
    (view,) = JobTracker(Registry(registry.state_dir)).refresh()
    assert count.events() == len(extra.encode())
    assert view.state == "finished" and view.epoch == NUM_EPOCHS


def test_a_replaced_or_truncated_file_is_read_again_whole(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    row(registry)
    path = Path(job.run_dir) / EVENTS_FILE
    text = run_started(T, num_epochs=NUM_EPOCHS) + epoch(T + 1, 0) + epoch(T + 2, 1)
    replacement = path.with_name("events.new")
    replacement.write_text(text)
    os.replace(replacement, path)  # a new inode, smaller
    count = ByteCount(monkeypatch)
    (view,) = JobTracker(Registry(registry.state_dir)).refresh()
    assert count.events() == len(text.encode())
    assert view.epoch == 2 and view.final_dice is None


def test_a_damaged_cache_is_ignored_and_written_anew(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    expected = row(registry)
    cache = tmp_path / "state" / CACHE_DIR / CACHE_FILE
    for damage in (b"{not json", b'{"version": 1, "entries": {"x": 3}}', b"[]", b"\x00" * 10):
        cache.write_bytes(damage)
        count = ByteCount(monkeypatch)
        assert row(registry) == expected
        assert count.events() == (Path(job.run_dir) / EVENTS_FILE).stat().st_size
        monkeypatch.undo()
        assert cache.read_bytes() != damage  # rebuilt
    cache.unlink()  # deleting it only costs a read
    assert row(registry) == expected


def test_a_summary_that_does_not_fit_the_job_is_not_used(tmp_path, monkeypatch) -> None:
    """The job's record changed (its end): the summary of its old record is not its own."""
    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    row(registry)
    registry.update(job.job_id, ended_at=T + 900)
    count = ByteCount(monkeypatch)
    assert row(registry)[1] == NUM_EPOCHS
    assert count.events() == (Path(job.run_dir) / EVENTS_FILE).stat().st_size


def test_a_shown_detail_gets_the_whole_curves(tmp_path) -> None:
    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    row(registry)
    tracker = JobTracker(Registry(registry.state_dir))
    (compact,) = tracker.refresh()
    assert 0 < len(compact.history) < NUM_EPOCHS  # the row's newest epochs only
    tracker.want_curves([job.job_id])
    (whole,) = tracker.refresh()
    assert [p.epoch for p in whole.history] == list(range(NUM_EPOCHS))
    assert whole.state == "finished" and whole.final_dice == 0.8125


def _fold(root: Path, fold: int) -> Path:
    folder = root / "Dataset004_Demo" / "nnUNetTrainer__nnUNetPlans__3d_fullres" / f"fold_{fold}"
    folder.mkdir(parents=True)
    lines = [run_started(T + fold, num_epochs=3), *(epoch(T + fold + n, n) for n in range(3))]
    (folder / EVENTS_FILE).write_text("".join([*lines, encode_event("finished", t=T + 9)]))
    return folder


def test_runs_that_ended_unseen_are_not_read_again(tmp_path, monkeypatch) -> None:
    from app.services.jobs.summaries import SummaryCache

    root = tmp_path / "results"
    for fold in range(3):
        _fold(root, fold)
    (tmp_path / "state").mkdir()
    cache = SummaryCache(tmp_path / "state")
    first = EndedScan(cache).runs([root], [], set())
    assert len(first) == 3
    cache.save_if_due(0.0)
    count = ByteCount(monkeypatch)
    again = EndedScan(SummaryCache(tmp_path / "state")).runs([root], [], set())
    assert count.events() == 0
    assert sorted(j.job_id for j in again) == sorted(j.job_id for j in first)


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_looking_writes_only_into_nnuis_state_folder(tmp_path, monkeypatch, capsys) -> None:
    state, root = tmp_path / "state", tmp_path / "results"
    registry = Registry(state)
    finished_run(registry, tmp_path / "runs")
    _fold(root, 0)
    monkeypatch.setenv("NNUI_STATE_DIR", str(state))
    before = {**_tree(tmp_path / "runs"), **_tree(root)}
    for _ in range(2):
        assert main(["status", "--all", "--json", "--results", str(root)]) == 0
    capsys.readouterr()
    assert {**_tree(tmp_path / "runs"), **_tree(root)} == before
    assert (state / CACHE_DIR / CACHE_FILE).is_file()


def test_nnui_cv_reads_no_byte_of_unchanged_finished_runs(tmp_path, monkeypatch, capsys) -> None:
    import json

    state = tmp_path / "state"
    registry = Registry(state)
    finished_run(registry, tmp_path / "runs")  # one GPU, run_started at T, ended at T + 500
    monkeypatch.setenv("NNUI_STATE_DIR", str(state))
    argv = ["cv", "--json", "--results", str(tmp_path / "results")]
    # The first look, another process, reads the file and keeps its summary; this one
    # (nothing remembered in memory) then reads no byte of it.
    done = subprocess.run([sys.executable, "-m", "app.main", *argv], capture_output=True,
                          text=True, env={**os.environ, "NNUI_STATE_DIR": str(state)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    first = done.stdout
    count = ByteCount(monkeypatch)
    assert main(argv) == 0
    assert count.events() == 0
    second = capsys.readouterr().out
    assert second == first
    (row_,) = json.loads(second)
    assert row_["gpu_hours"] == pytest.approx(500 / 3600)  # from the kept start
    assert [f["dice"] for f in row_["folds"] if f["fold"] == "0"] == [0.8125]


def test_a_recheck_that_finds_nothing_new_hands_out_the_same_view(tmp_path, monkeypatch) -> None:
    """An ended job's view is made again every ENDED_RECHECK_S; when nothing changed it is
    the very same object (the board redraws a row only for a new view: hundreds of rows
    were rebuilt every 30 s), and a changed record is a new view."""
    from app.services.jobs import views as views_module

    registry = Registry(tmp_path / "state")
    job = finished_run(registry, tmp_path)
    tracker = JobTracker(Registry(registry.state_dir))
    monkeypatch.setattr(views_module, "ENDED_RECHECK_S", -1.0)  # every refresh rechecks
    made = []
    real_view = JobTracker._view
    monkeypatch.setattr(JobTracker, "_view", lambda *a: made.append(1) or real_view(*a))
    (first,) = tracker.refresh()
    (again,) = tracker.refresh()
    assert len(made) == 2 and again is first  # made again, found the same
    registry.update(job.job_id, exit_code=1)
    (changed,) = tracker.refresh()
    assert changed is not first and changed.exit_code == 1
