"""A SIGTERM that reaches the supervisor while it holds the registry's lock (seen under a
loaded box: the kill landed inside the supervisor's own registry write) ends it with the
exit recorded, instead of its handler waiting forever on a lock it holds itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_registry import make_job

from app.services.jobs.registry import Registry

ROOT = Path(__file__).resolve().parents[3]

# The supervisor's first registry read takes the lock and sends SIGTERM to its own process
# inside it: the handler runs at the next bytecode, with the lock held (exactly, no timers).
DRIVER = """
import os, signal, sys
from app.services.supervisor import main as supervisor
from app.services.jobs.registry import Registry

read = Registry.get
fired = []

def read_with_term_inside_the_lock(self, job_id):
    if fired:
        return read(self, job_id)
    fired.append(True)
    with self.locked():
        os.kill(os.getpid(), signal.SIGTERM)
        return read(self, job_id)

Registry.get = read_with_term_inside_the_lock
sys.exit(supervisor.main(sys.argv[1:]))
"""


def test_sigterm_inside_the_registry_lock_is_recorded_not_a_deadlock(tmp_path: Path) -> None:
    registry = Registry(tmp_path / "state")
    job = make_job(gpus=[], device="cpu")
    registry.add(job)
    argv = [sys.executable, "-c", DRIVER, "--job-id", job.job_id,
            "--state-dir", str(tmp_path / "state"), "--", sys.executable, "-c", "pass"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + 15, done.stderr
    assert "Traceback" not in done.stderr
    ended = registry.get(job.job_id)
    assert ended.exit_code == -15 and ended.note == "killed before start"
    assert ended.processes == []  # no trainer was started
