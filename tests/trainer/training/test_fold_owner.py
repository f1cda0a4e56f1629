"""One trainer per fold folder (docs/training.md): a second trainer is refused at once, a finished
fold is not retrained unless asked, and the lock dies with its holder (kill -9 included)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys

import pytest
from test_trainer_run import events, finish, run_dir, start, train_argv, wait_for

from trainer.schema.status import read_status
from trainer.schema.tree import SUMMARY_FILE, checkpoint_file
from trainer.training import fold_lock


def _md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _second(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer", *argv], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.slow
def test_second_trainer_is_refused_and_the_first_finishes_unharmed(demo_preprocessed, tmp_path):
    # Epochs it cannot finish however slowly the second trainer starts on a loaded box (50
    # were done once before the refusal came): only the stop below ends it.
    argv = [*train_argv(demo_preprocessed, tmp_path), "--epochs", "100000"]
    first = start(argv, tmp_path / "first.log")
    folder = run_dir(tmp_path)
    try:
        wait_for(lambda: fold_lock.is_locked(folder), first)
        owner = fold_lock.read_owner(folder)
        assert owner is not None and owner.pid == first.pid and owner.launcher == "by hand"
        second = _second(argv)
        assert second.returncode == 1, second.stderr
        line = second.stderr.strip()
        assert "\n" not in line and f"in use by pid {first.pid}" in line and "by hand" in line
        assert "Traceback" not in second.stdout + second.stderr
        first.send_signal(signal.SIGUSR1)  # now end the first run: it must be unharmed
        assert finish(first) == 0, (tmp_path / "first.log").read_text()
    finally:
        if first.poll() is None:
            first.kill()
    starts = [e for e in events(folder) if e["kind"] == "run_started"]
    assert len(starts) == 1  # the refused trainer wrote nothing into the folder
    assert events(folder)[-1]["kind"] == "stopped"
    from trainer.checkpoint import store

    tensors, meta = store.load(folder / "checkpoint_latest.safetensors")
    assert any(k.startswith("model.") for k in tensors) and meta["epoch_next"] >= 1
    assert not fold_lock.is_locked(folder)  # released when the owner exited


@pytest.mark.slow
def test_finished_fold_is_refused_unless_retrain(demo_preprocessed, tmp_path):
    argv = [*train_argv(demo_preprocessed, tmp_path), "--epochs", "1"]
    assert finish(start(argv, tmp_path / "a.log")) == 0, (tmp_path / "a.log").read_text()
    folder = run_dir(tmp_path)
    final = folder / checkpoint_file("final")
    before = {p.name: _md5(p) for p in (final, folder / "validation" / SUMMARY_FILE)}

    again = _second(argv)
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"error: fold 0 already finished training in {folder}; move that folder to train it "
        "again, or pass --retrain"
    )
    after = {p.name: _md5(p) for p in (final, folder / "validation" / SUMMARY_FILE)}
    assert after == before
    assert not fold_lock.is_locked(folder)

    retrained = _second([*argv, "--retrain"])
    assert retrained.returncode == 0, retrained.stderr
    assert [e["kind"] for e in events(folder)].count("run_started") == 2


@pytest.mark.slow
def test_lock_is_released_when_the_owner_is_killed(demo_preprocessed, tmp_path):
    argv = [*train_argv(demo_preprocessed, tmp_path), "--epochs", "50"]
    first = start(argv, tmp_path / "first.log")
    folder = run_dir(tmp_path)
    try:
        wait_for(lambda: fold_lock.is_locked(folder), first)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    # No clean-up step: the kernel dropped the lock with the process (and its loader workers,
    # which closed their inherited copy at fork).
    assert not fold_lock.is_locked(folder)
    fresh = start([*argv[:-2], "--epochs", "2", "--c"], tmp_path / "fresh.log")
    assert finish(fresh) == 0, (tmp_path / "fresh.log").read_text()
    assert read_status(folder).state == "finished"


def test_lock_refuses_in_process_and_names_the_holder(tmp_path):
    fold_lock.acquire(tmp_path, ["nnui-train", "900", "2d", "0"])
    try:
        code = (
            "import sys; from trainer.training import fold_lock\n"
            "try:\n    fold_lock.acquire(__import__('pathlib').Path(sys.argv[1]), [])\n"
            "except fold_lock.FoldBusy as e:\n    print(e); sys.exit(1)\n"
        )
        other = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert other.returncode == 1
        assert f"in use by pid {os.getpid()}" in other.stdout
    finally:
        fold_lock.release()
    assert not fold_lock.is_locked(tmp_path)


def test_forked_children_do_not_keep_the_lock(tmp_path):
    fold_lock.acquire(tmp_path, [])
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child outlives the owner's release: it must not hold the lock
        os.write(ready_write, b"r")  # fork's hooks have run by now
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        assert os.read(ready_read, 1) == b"r"
        fold_lock.release()
        assert not fold_lock.is_locked(tmp_path)
    finally:
        os.write(write, b"x")
        os.waitpid(pid, 0)


def test_how_started_names_the_launcher():
    assert fold_lock.how_started({"NNUI_JOB_ID": "abc"}) == "nnui job abc"
    assert fold_lock.how_started({"TORCHELASTIC_RUN_ID": "x"}) == "torchrun"
    assert fold_lock.how_started({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == "SLURM job 7"
    assert fold_lock.how_started({}, num_gpus=2) == "by hand, -num_gpus 2"
    assert fold_lock.how_started({}) == "by hand"


def test_abbreviated_flags_are_refused_with_the_close_match(capsys):
    from trainer.run import main

    assert main(["900", "2d", "0", "--epoch", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unrecognized arguments: --epoch 3 (did you mean --epochs?)")
