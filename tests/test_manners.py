"""Shared-box manners and failures at hand (issue 14, items 2 and 5): one console file per
run attempt, busy GPUs confirmed, the simulated machine playing other users, dry runs that
list every fold, trainer nice value and threads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_jobs import add_job

from app.services import consoles, supervisor
from app.services.jobs import JobTracker
from app.services.registry import Registry

ROOT = Path(__file__).resolve().parent.parent


# ---- one console per attempt -------------------------------------------------------------


def test_the_next_attempt_gets_its_own_file() -> None:
    first = Path("/r/fold_0") / consoles.console_name("abc", 1)
    assert first.name == "console.abc.1.log"
    assert consoles.next_attempt_path(first, "abc") == Path("/r/fold_0/console.abc.2.log")
    assert consoles.next_attempt_path(Path("/r/console.log"), "abc") is None  # legacy: stays


def test_a_restart_moves_the_console_and_names_it_in_the_registry(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j1", console_path=str(tmp_path / "console.j1.1.log"))
    moved: list[Path] = []
    monkeypatch.setattr(supervisor, "redirect_output", moved.append)
    supervisor._next_console(registry, job.job_id, "exit 137 (SIGKILL)")
    assert moved == [tmp_path / "console.j1.2.log"]
    assert registry.get("j1").console_path == str(tmp_path / "console.j1.2.log")


def test_redirect_output_sends_this_process_and_its_children_to_the_new_file(tmp_path) -> None:
    code = (
        "import subprocess, sys; from pathlib import Path; from app.services import consoles\n"
        "print('before', flush=True); consoles.redirect_output(Path(sys.argv[1]))\n"
        "print('after', flush=True); subprocess.run(['echo', 'child'])\n"
    )
    target = tmp_path / "console.j.2.log"
    result = subprocess.run([sys.executable, "-c", code, str(target)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n" and target.read_text() == "after\nchild\n"


def test_the_console_tail_follows_the_current_attempt(tmp_path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j1", console_path=str(tmp_path / "console.j1.1.log"))
    Path(job.console_path).write_text("attempt one\nTraceback: boom\n")
    tracker = JobTracker(registry)
    assert tracker.refresh()[0].console_tail[-1] == "Traceback: boom"
    second = tmp_path / "console.j1.2.log"
    second.write_text("[nnui] attempt 2\nepoch 3 loss 0.5\n")
    registry.update("j1", console_path=str(second))
    assert tracker.refresh()[0].console_tail == ("[nnui] attempt 2", "epoch 3 loss 0.5")
