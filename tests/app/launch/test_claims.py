"""Atomic claims of a run folder (docs/contract.md): check-and-register is one step across processes
and users; a claim is stale only when its holder is verifiably gone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until

from app.services.jobs.registry import Registry
from app.services.launch import fold_claims as claims
from app.services.launch.fold_claims import CLAIM_FILE, ClaimRefused

ROOT = Path(__file__).resolve().parents[3]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_claim(run_dir: Path, **changes: object) -> None:
    data = {"job_id": "J-old", "host": socket.gethostname(), "uid": os.getuid(),
            "pid": os.getpid(), "start_ticks": None, "created_at": 0.0}  # fmt: skip
    data.update(changes)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CLAIM_FILE).write_text(json.dumps(data))


def test_take_names_the_job_and_refuses_a_second_live_claim(tmp_path: Path) -> None:
    run = tmp_path / "fold_0"
    run.mkdir()
    with claims.locked(tmp_path):
        claims.take(run, "0", "J1")
    claim = claims.read(run)
    assert (claim.job_id, claim.pid, claim.host) == ("J1", os.getpid(), socket.gethostname())
    assert claim.start_ticks is not None
    with claims.locked(tmp_path), pytest.raises(ClaimRefused, match="claimed by job J1"):
        claims.take(run, "0", "J2")
    claims.release(run, "J2")  # not ours: left alone
    assert claims.read(run).job_id == "J1"
    claims.release(run, "J1")
    assert claims.read(run) is None


def test_stale_claim_of_a_dead_holder_is_taken_over(tmp_path: Path) -> None:
    run = tmp_path / "fold_0"
    _write_claim(run, pid=_dead_pid(), start_ticks=1)
    assert claims.check(run, "0") is None
    claims.take(run, "0", "J-new")
    assert claims.read(run).job_id == "J-new"


def test_reused_pid_is_not_the_holder(tmp_path: Path) -> None:
    run = tmp_path / "fold_0"
    from app.services.machine.procs import process_start_ticks

    _write_claim(run, pid=os.getpid(), start_ticks=process_start_ticks(os.getpid()) + 1)
    assert claims.check(run, "0") is None  # same pid, other start ticks: stale


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [({"host": "elsewhere"}, "on host elsewhere"), ({"pid": -1}, "cannot read the claim"),
     ({"pid": "x"}, "cannot read the claim"), ({"created_at": "now"}, "cannot read the claim")],
)  # fmt: skip
def test_unverifiable_claims_are_never_taken_over(
    tmp_path: Path, changes: dict, fragment: str
) -> None:
    run = tmp_path / "fold_0"
    _write_claim(run, **changes)
    with pytest.raises(ClaimRefused, match=fragment):
        claims.take(run, "0", "J-new")
    assert json.loads((run / CLAIM_FILE).read_text())["job_id"] == "J-old"


def test_garbage_claim_file_is_refused_with_its_path(tmp_path: Path) -> None:
    run = tmp_path / "fold_0"
    run.mkdir()
    (run / CLAIM_FILE).write_bytes(b"\xff\xfe not json")
    with pytest.raises(ClaimRefused) as caught:
        claims.check(run, "0")
    assert str(run / CLAIM_FILE) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_claim_of_another_users_live_process_holds(tmp_path: Path) -> None:
    from app.services.machine.procs import process_start_ticks

    other = subprocess.Popen(["sleep", "60"], user=65534)
    try:
        assert wait_until(lambda: process_start_ticks(other.pid) is not None)
        run = tmp_path / "fold_0"
        _write_claim(run, uid=65534, pid=other.pid, start_ticks=process_start_ticks(other.pid))
        with pytest.raises(ClaimRefused, match="uid 65534"):
            claims.take(run, "0", "J-new")
    finally:
        other.kill()
        other.wait()


# ---- several real `nnui launch` of one fold, released at the same moment -------------------

BARRIER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from app.services.launch import launcher
ready, go = Path(sys.argv[1]), Path(sys.argv[2])
original = launcher.start

def start(plan, registry):
    # Every launch has passed its checks; all wait here and go at once.
    ready.touch()
    deadline = time.monotonic() + 120
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    return original(plan, registry)

launcher.start = start
from app.main import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.fixture
def env(tmp_path: Path):
    values = {**os.environ, **fake_env(tmp_path)}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


@pytest.mark.parametrize("num_launches", [3])
def test_simultaneous_launches_of_one_fold_let_exactly_one_in(
    env: dict, tmp_path: Path, num_launches: int
) -> None:
    script = tmp_path / "barrier.py"
    script.write_text(BARRIER.format(root=str(ROOT)))
    go = tmp_path / "go"
    args = ["launch", "4", "3d_fullres", "--cpu", "--folds", "0",
            "--", "--epochs", "300", "--epoch-time", "0.2"]  # fmt: skip
    launches = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / f"ready_{i}"), str(go), *args],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        for i in range(num_launches)
    ]
    try:
        ready = [tmp_path / f"ready_{i}" for i in range(num_launches)]
        assert wait_until(lambda: all(p.exists() for p in ready), 120)
        go.touch()
        outputs = [p.communicate(timeout=120) for p in launches]
    finally:
        for process in launches:
            if process.poll() is None:
                process.kill()
    codes = sorted(p.returncode for p in launches)
    assert codes == [0] + [1] * (num_launches - 1), outputs
    for process, (_out, err) in zip(launches, outputs, strict=True):
        assert "Traceback" not in err
        if process.returncode == 1:
            assert err.startswith("error: refused to start fold 0: ") and "already running" in err
            assert len(err.strip().splitlines()) == 1, err
    jobs = list(Path(env["NNUI_STATE_DIR"], "jobs").glob("*.json"))
    assert len(jobs) == 1
    run_dir = Path(json.loads(jobs[0].read_text())["run_dir"])
    assert claims.read(run_dir).job_id == jobs[0].stem


def test_a_job_whose_trainer_ended_no_longer_holds_its_fold(env) -> None:
    """The supervisor drops the claim before it records the exit code, so a resume that
    waits for the exit code never meets the ended job's claim (its supervisor may still be
    on its way out)."""
    argv = [sys.executable, "-m", "app.main", "launch", "4", "2d", "--cpu", "--folds", "0",
            "--", "--epochs", "1", "--epoch-time", "0.05"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    job_id, run_dir = done.stdout.split()[0], Path(done.stdout.split()[-1])
    registry = Registry(Path(env["NNUI_STATE_DIR"]))
    assert wait_until(lambda: registry.get(job_id).exit_code is not None)
    assert not (run_dir / claims.CLAIM_FILE).exists()
    status = subprocess.run([sys.executable, "-m", "app.main", "status", "--json"], env=env,
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert json.loads(status.stdout)[0]["state"] == "finished"
