"""The `nnui` command line as a user types it, for tests that drive it in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_nnui(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`nnui ARGS` from the repository root with `env`; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def job_row(env: dict[str, str], job_id: str) -> dict:
    """The job's row of `nnui status --json --all`."""
    rows = json.loads(run_nnui(env, "status", "--json", "--all").stdout)
    return next(row for row in rows if row["id"] == job_id)
