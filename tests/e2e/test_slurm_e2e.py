"""The `nnui sbatch` job script on a real one-node SLURM cluster (munged/slurmctld/slurmd
started by tests/slurm_cluster.py), training the tiny demo dataset on the CPU with torchrun.

- USR1 the way SLURM sends it at `--signal=B:USR1@N` (deterministically:
  `scancel --signal=USR1 --batch`): the job ends COMPLETED 0:0 with checkpoint_latest;
  submitting the same script again resumes (--c) and finishes.
- A real `--signal=B:USR1@N` inside a short time limit: stopped gracefully, not TIMEOUT.

Slow. Skipped when SLURM is not installed, except in CI (CI=true), where it must run.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.services.slurm import script as slurm
from trainer.schema.events import decode_event
from trainer.schema.status import State, read_status
from trainer.schema.tree import EVENTS_FILE, checkpoint_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurm_cluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


cluster = pytest.fixture(scope="module")(slurm_cluster.running_cluster)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spec(demo, tmp_path: Path, epochs: int, **changes) -> slurm.JobSpec:
    spec = slurm.JobSpec(
        dataset="900",
        configuration="2d",
        fold="0",
        nodes=1,
        gpus_per_node=0,
        procs_per_node=2,
        cpus_per_task=os.cpu_count() or 1,
        time_limit="00:30:00",
        output_dir=tmp_path / "out",
        workdir=ROOT,
        python=sys.executable,
        rdzv_port=_free_port(),
        trainer_args=(
            "--epochs", str(epochs), "--iterations-per-epoch", "4", "--val-iterations", "1",
            "--num-workers", "1", "--preprocessed", str(demo.preprocessed),
            "--results", str(tmp_path / "results"),
        ),
    )  # fmt: skip
    return replace(spec, **changes)


def _folder(tmp_path: Path) -> Path:
    return tmp_path / "results" / "Dataset900_NnuiDemo" / "nnuiTrainer__nnuiPlans__2d" / "fold_0"


def _events(folder: Path) -> list[dict]:
    path = folder / EVENTS_FILE
    if not path.exists():
        return []
    return [e for e in map(decode_event, path.read_text().splitlines()) if e]


def _kinds(folder: Path, kind: str) -> list[dict]:
    return [e for e in _events(folder) if e["kind"] == kind]


def _job_log(spec: slurm.JobSpec) -> str:
    return "\n".join(p.read_text() for p in sorted(spec.output_dir.glob("*.out")))


def _wait_for_epoch(cluster, job_id: int, folder: Path, spec, timeout_s: float = 600) -> None:
    """Until the first epoch is recorded; `timeout_s` only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not _kinds(folder, "epoch_ended"):
        state = cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"{state}\n{_job_log(spec)}"
        assert time.monotonic() < deadline, f"no epoch after {timeout_s} s\n{_job_log(spec)}"
        time.sleep(0.5)


def test_usr1_stops_gracefully_and_resubmission_resumes(cluster, demo_preprocessed, tmp_path):
    spec = _spec(demo_preprocessed, tmp_path, epochs=12)
    script = slurm.write_script(spec)
    folder = _folder(tmp_path)
    job = cluster.submit(script)
    _wait_for_epoch(cluster, job, folder, spec)
    # Exactly what SLURM does at --signal=B:USR1@N: USR1 to the batch shell only.
    cluster.run("scancel", "--signal=USR1", "--batch", str(job))
    info = cluster.wait_job(job)
    log = _job_log(spec)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert (folder / checkpoint_file("latest")).exists(), log
    (stopped,) = _kinds(folder, "stopped")
    assert read_status(folder).state == State.STOPPED
    assert stopped["epoch"] < 11, "the run ended before the signal could stop it"
    (topology,) = _kinds(folder, "topology")
    assert [r["local_rank"] for r in topology["ranks"]] == [0, 1]
    assert {e["launcher"] for e in _kinds(folder, "run_started")} == {"torchrun"}

    again = cluster.submit(script)  # the same script: --c resumes
    info = cluster.wait_job(again)
    log = _job_log(spec)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert _kinds(folder, "finished"), log
    assert [e["epoch"] for e in _kinds(folder, "epoch_ended")] == list(range(12))
    assert (folder / checkpoint_file("final")).exists()


def test_signal_before_time_limit_stops_gracefully(cluster, demo_preprocessed, tmp_path):
    # USR1 due 30 s after start (SLURM checks every 30 s, so it may come earlier, even
    # while torchrun starts); far too many epochs to finish within the 2-minute limit.
    spec = _spec(demo_preprocessed, tmp_path, epochs=5000, time_limit="00:02:00", signal_lead_s=90)
    script = slurm.write_script(spec)
    job = cluster.submit(script)
    info = cluster.wait_job(job, timeout_s=600)  # a hang guard, not a speed check
    log = _job_log(spec)
    # COMPLETED, not TIMEOUT: the signal stopped it before SLURM's limit would have killed it.
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    folder = _folder(tmp_path)
    assert _kinds(folder, "stopped"), log
    assert not _kinds(folder, "finished")
    assert read_status(folder).state == State.STOPPED
