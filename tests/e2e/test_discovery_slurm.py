"""A user's own sbatch script that runs `srun python -m trainer ...` on a real one-node SLURM
cluster (tests/slurm_cluster.py): nnui lists it with its SLURM state, stops it with
`scancel --signal=USR1 JOB.STEP` (the step's task is the worker; never the batch shell) and
the job ends COMPLETED 0:0 with its checkpoint. A held job of the same kind is listed
PENDING and `nnui stop` cancels it (it had trained nothing).

Slow. Skipped when SLURM is not installed, except in CI (CI=true), where it must run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.schema.status import State, read_status
from trainer.schema.tree import checkpoint_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
pytestmark = pytest.mark.slow
SAFETY_NET_S = 300


cluster = pytest.fixture(scope="module")(slurm_cluster.running_cluster)


def _script(demo, tmp_path: Path, results: Path) -> Path:
    """The user's own job script: one task, the trainer run by srun (no nnui involved)."""
    args = ["900", "2d", "0", "-device", "cpu", "--epochs", "300", "--iterations-per-epoch",
            "2", "--val-iterations", "1", "--num-workers", "1", "--preprocessed",
            str(demo.preprocessed), "--results", str(results)]  # fmt: skip
    path = tmp_path / "mytrain.sbatch"
    path.write_text(
        "#!/bin/bash\n#SBATCH --job-name=mytrain\n#SBATCH --ntasks=1\n"
        f"#SBATCH --output={tmp_path}/%j.out\n"
        f"cd {ROOT}\nexport PYTHONPATH={ROOT}\n"
        f"srun {PY} -m trainer {' '.join(args)}\n"
    )
    return path


def _rows(cluster, tmp_path: Path, results: Path) -> list[dict]:
    done = _nnui(cluster, tmp_path, "status", "--json", "--results", str(results))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _nnui(cluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **cluster.env, "PYTHONPATH": str(ROOT),
           "XDG_STATE_HOME": str(tmp_path / "state")}  # fmt: skip
    return subprocess.run([PY, "-m", "app.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)  # fmt: skip


def test_own_sbatch_script_listed_stopped_by_scancel_and_pending_cancelled(
    cluster, demo_preprocessed, tmp_path
) -> None:
    results = tmp_path / "results"
    script = _script(demo_preprocessed, tmp_path, results)
    job = cluster.submit(script)
    held = cluster.submit(script, "--hold")
    deadline = time.monotonic() + SAFETY_NET_S
    while True:
        rows = _rows(cluster, tmp_path, results)
        mine = [r for r in rows if r.get("slurm_job") == str(job) and (r["epoch"] or 0) >= 1]
        if mine:
            break
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), state
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    (run,) = mine
    assert (run["slurm_state"], run["launcher"], run["num_ranks"]) == ("RUNNING", "srun", 1)
    (pending,) = [r for r in rows if r["id"] == f"slurm:{held}"]
    assert (pending["state"], pending["slurm_state"]) == ("queued", "PENDING")

    done = _nnui(cluster, tmp_path, "stop", run["id"], "--yes", "--results", str(results))
    assert done.returncode == 0, done.stderr
    assert f"scancel --signal=USR1 {job}.0" in done.stdout, done.stdout
    info = cluster.wait_job(job)
    log = "".join(p.read_text() for p in tmp_path.glob("*.out"))
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    folder = Path(run["run_dir"])
    assert (folder / checkpoint_file("latest")).exists(), log
    assert read_status(folder).state == State.STOPPED

    done = _nnui(cluster, tmp_path, "stop", f"slurm:{held}", "--yes", "--results", str(results))
    assert done.returncode == 0 and "cancelled" in done.stdout, done.stderr
    assert cluster.wait_job(held)["JobState"] == "CANCELLED"
