"""Trainer flags checked before a launch: `python -m trainer.flag_check` (a child process,
so the app never imports the trainer) parses them as the job will. Answers are cached per
argument list: the board re-checks on every change of its inputs."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import app

CHECK_TIMEOUT_S = 60.0  # a hang guard on a loaded box, not an expectation
# launcher.TRAINER_SCRIPT_ENV: a test's stand-in trainer has flags of its own, not checked.
SCRIPT_OVERRIDE_ENV = "NNUI_TRAINER_SCRIPT"


def checked(trainer_entry: tuple[str, ...]) -> bool:
    """Only nnui's own entries are checked (a user's or a test's own script has its flags)."""
    return not trainer_entry and not os.environ.get(SCRIPT_OVERRIDE_ENV)


@functools.lru_cache(maxsize=64)
def flag_problem(
    engine: str, dataset: str, configuration: str, args: tuple[str, ...]
) -> str | None:
    """One line when the trainer would refuse these flags; None when they parse."""
    command = [sys.executable, "-m", "trainer.flag_check", engine, dataset, configuration, "0"]
    root = str(Path(app.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([*command, *args], capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return None if isinstance(error, subprocess.TimeoutExpired) else f"cannot check: {error}"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    reason = lines[-1].removeprefix("error: ") if lines else f"exit {done.returncode}"
    return f"trainer flags refused: {reason}"
