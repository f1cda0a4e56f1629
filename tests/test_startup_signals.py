"""SIGUSR1 at any moment of start-up (issue 16, item 5): never fatal once the first line of
an entry point ran, and honoured later (a stop before training, exit 0).

"Any moment" is made exact without timers: a test-only `sitecustomize` adds an audit hook
that counts the imports of the process from the entry point's first one on and sends
SIGUSR1 to its own process at import number K, for every K in a sweep. The imports before
the handler exists (trainer, trainer.run's first line, trainer.stop, signal) and the
interpreter's own start-up are the unavoidable window (README) and are not counted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from trainer import stop
from trainer.schema.events import decode_event
from trainer.schema.status import read_status
from trainer.schema.tree import EVENTS_FILE, run_dir

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "nnui-train")
ENTRIES = {
    "console script": [CONSOLE_SCRIPT],
    "python -m trainer": [sys.executable, "-m", "trainer"],
}

# Imports that run before the handler can exist: the entry's package and modules, the
# handler's module and its one stdlib dependency. Counting starts after them.
HOOK = """
import os, sys
_AT = os.environ.pop("NNUI_TEST_USR1_AT_IMPORT", None)  # one process, not its children
_LOG = os.environ.pop("NNUI_TEST_IMPORT_LOG", None)
_BEFORE = {"trainer", "trainer.__main__", "trainer.run", "trainer.stop", "signal", "__future__"}
_count = [-1]

def _hook(event, args):
    if event != "import":
        return
    if _count[0] < 0:
        _count[0] = 0 if args[0] == "trainer" else -1
        return
    if _count[0] == 0 and args[0] in _BEFORE:
        return
    _count[0] += 1
    if _LOG:
        with open(_LOG, "a") as log:
            log.write(args[0] + "\\n")
    if _AT is not None and _count[0] == int(_AT):
        os.kill(os.getpid(), 10)

sys.addaudithook(_hook)
"""


@pytest.fixture
def hooked_env(tmp_path: Path) -> dict[str, str]:
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NNUI_TEST_")}
    env.update(PYTHONPATH=f"{hook_dir}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    return env


def _run(
    argv: list[str], env: dict[str, str], timeout_s: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


def _imports_after_handler(argv: list[str], env: dict[str, str], log: Path) -> list[str]:
    """The imports the hook counts in a run without a signal (its first process only)."""
    _run(argv, {**env, "NNUI_TEST_IMPORT_LOG": str(log)})
    return log.read_text().splitlines()


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_sigusr1_at_every_import_after_the_first_line_is_not_fatal(entry, hooked_env, tmp_path):
    """Old code: the handler came in main(), after ~80 imports: a signal at any of them was
    exit 138. Each K here is a run that is signalled at its K-th import and must still end
    as it would have without the signal (an unknown dataset: one error line, exit 2)."""
    argv = [*ENTRIES[entry], "999", "2d", "0", "-device", "cpu",
            "--preprocessed", str(tmp_path / "none"), "--results", str(tmp_path / "r")]  # fmt: skip
    names = _imports_after_handler(argv, hooked_env, tmp_path / "imports.log")
    assert "argparse" in names[:5]  # the sweep covers trainer.run's own imports
    stride = 2 if entry == "console script" else 6
    for at in range(1, len(names) + 1, stride):
        done = _run(argv, {**hooked_env, "NNUI_TEST_USR1_AT_IMPORT": str(at)})
        where = f"SIGUSR1 at import {at} ({names[at - 1]}): exit {done.returncode}"
        assert done.returncode == 2, f"{where} (-{signal.SIGUSR1} = killed by it) {done.stderr}"
        assert done.stderr.startswith("error: no dataset"), f"{where}: {done.stderr}"


# ---- honoured later: real trainings on the demo --------------------------------------------


def _train_argv(demo, results: Path, *extra: str) -> list[str]:
    return [
        "900", "2d", "0", "-device", "cpu", "--epochs", "2", "--iterations-per-epoch", "2",
        "--val-iterations", "1", "--num-workers", "1", "--preprocessed", str(demo.preprocessed),
        "--results", str(results), *extra,
    ]  # fmt: skip


def _run_dir(results: Path) -> Path:
    return run_dir(results, "Dataset900_NnuiDemo", "2d", "0")


def _kinds(results: Path) -> list[str]:
    lines = (_run_dir(results) / EVENTS_FILE).read_text().splitlines()
    return [decode_event(line)["kind"] for line in lines]


def _assert_stopped_before_training(results: Path, log: str) -> None:
    kinds = _kinds(results)
    assert kinds[-2:] == ["stop_requested", "stopped"], log
    assert "epoch_ended" not in kinds
    assert read_status(_run_dir(results)).state == "stopped"


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_sigusr1_at_the_first_import_after_the_handler_stops_before_training(
    entry, hooked_env, demo_preprocessed, tmp_path
):
    argv = [*ENTRIES[entry], *_train_argv(demo_preprocessed, tmp_path / "r")]
    done = _run(argv, {**hooked_env, "NNUI_TEST_USR1_AT_IMPORT": "1"}, timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_stopped_before_training(tmp_path / "r", done.stdout + done.stderr)


def catches_sigusr1(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in text.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & (1 << (signal.SIGUSR1 - 1)))


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            continue
    return found


def _signal_each_new_child(parent: subprocess.Popen, wanted: int, is_worker: Callable[[int], bool]):
    """SIGUSR1 to every child of `parent` the moment it shows up (often before its exec),
    until `wanted` workers were signalled; returns their pids."""
    signalled: set[int] = set()
    workers: set[int] = set()
    deadline = time.monotonic() + 180
    while len(workers) < wanted:
        assert parent.poll() is None, f"exited {parent.returncode} before {wanted} children"
        assert time.monotonic() < deadline, "timed out waiting for the children"
        for pid in children(parent.pid) - signalled:
            # A short-lived helper child (e.g. ldconfig run by ctypes' find_library) may be
            # gone between the listing and the signal: nothing to stop there. A rank that
            # died would show in the parent's exit code, which the caller checks.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            signalled.add(pid)
        workers.update(pid for pid in signalled if is_worker(pid))
    return workers


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.slow
def test_spawn_parent_and_its_ranks_signalled_the_moment_they_exist(demo_preprocessed, tmp_path):
    """The parent at the first moment its handler exists, each child (ranks, multiprocessing's
    resource tracker) the moment its pid exists: nothing dies, every rank stops before
    training, exit 0. The children start with SIGUSR1 held (stop.hold in the parent)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = tmp_path / "spawn.log"
    with open(log, "w") as out:
        parent = subprocess.Popen(
            [CONSOLE_SCRIPT, *_train_argv(demo_preprocessed, tmp_path / "r", "-num_gpus", "2")],
            env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        while not catches_sigusr1(parent.pid):
            assert parent.poll() is None, log.read_text()
        parent.send_signal(signal.SIGUSR1)
        _signal_each_new_child(parent, 2, lambda pid: "--multiprocessing-fork" in _cmdline(pid))
        assert parent.wait(timeout=240) == 0, log.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    _assert_stopped_before_training(tmp_path / "r", log.read_text())


@pytest.mark.slow
def test_torchrun_workers_signalled_the_moment_they_exist(demo_preprocessed, tmp_path):
    """torchrun started the way a launcher should (SIGUSR1 held, README): each worker is
    signalled the moment its pid exists, before its interpreter runs; none dies, the job
    stops before training and torchrun exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "trainer", *_train_argv(demo_preprocessed, tmp_path / "r")]  # fmt: skip
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:
        torchrun = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=stop.hold,
        )  # fmt: skip
    try:
        _signal_each_new_child(torchrun, 2, lambda pid: True)
        assert torchrun.wait(timeout=240) == 0, log.read_text()
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
    _assert_stopped_before_training(tmp_path / "r", log.read_text())
