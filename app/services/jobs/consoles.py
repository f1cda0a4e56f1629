"""One console file per run attempt: `console.<job_id>.<attempt>.log` in the run folder.

A resume is a new job and a `--retries` restart a new attempt of the same job; each gets
its own file, so no attempt overwrites or mixes another's lines and a failure's last lines
are its own. The registry's `console_path` always names the current attempt's file (the
supervisor moves it on at a restart); readers follow that field. Older jobs keep their
shared `console.log`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_ATTEMPT = re.compile(r"^console\.(?P<job>.+)\.(?P<attempt>\d+)\.log$")


def console_name(job_id: str, attempt: int = 1) -> str:
    return f"console.{job_id}.{attempt}.log"


def next_attempt_path(current: Path, job_id: str) -> Path | None:
    """The next attempt's file beside `current`; None for a legacy shared console.log."""
    match = _ATTEMPT.match(current.name)
    if match is None or match["job"] != job_id:
        return None
    return current.with_name(console_name(job_id, int(match["attempt"]) + 1))


def redirect_output(path: Path) -> None:
    """Point this process's stdout and stderr (and so its future children's) at `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for target in (1, 2):
            os.dup2(fd, target)
    finally:
        os.close(fd)
