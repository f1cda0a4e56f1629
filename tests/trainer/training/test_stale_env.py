"""Launcher variables left over from a finished job (issue 16, item 6): RANK/WORLD_SIZE/
LOCAL_RANK/MASTER_* with no launcher around fail in seconds with one line that names the
variables to unset, instead of waiting 10 minutes for ranks that never come and ending in
a 33-line traceback. A live pair with the same variables still trains (test_distributed)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.training import distributed, launch

ROOT = Path(__file__).resolve().parents[3]
CONSOLE_SCRIPT = str(Path(sys.executable).parent / "nnui-train")
STALE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_ENVS = (
    *launch.RENDEZVOUS_VARIABLES, "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "SLURM_NTASKS",
    "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "timeout_s"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, launch.LEFTOVER_START_TIMEOUT_S),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h"},
            launch.LEFTOVER_START_TIMEOUT_S,
        ),
        # a live srun step or mpirun: its ranks may start minutes apart
        ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, None),
        ({"PMI_SIZE": "4", "PMI_RANK": "3"}, None),
    ],
)
def test_first_contact_is_short_only_without_a_live_launcher(env, timeout_s) -> None:
    assert launch.start_timeout_s(env) == timeout_s


def test_leftover_variables_names_only_those_set() -> None:
    env = {"MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "2", "HOME": "/root"}
    assert launch.leftover_variables(env) == ["RANK", "WORLD_SIZE", "MASTER_PORT"]


def test_rank_1_without_rank_0_gives_up_after_the_start_timeout(clean_env) -> None:
    port = _free_port()
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    with pytest.raises(distributed.NoRendezvous, match=f"rank 1 of 2 found nobody listening at "
                       f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}"):  # fmt: skip
        distributed.env_store(1, 2, start_timeout_s=0.2)


def test_rank_0_without_peers_gives_up_and_alone_needs_none(clean_env) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(distributed.NoRendezvous, match=r"rank 0 of 2 listened at .* no other"):
        distributed.env_store(0, 2, start_timeout_s=0.2)
    clean_env.setenv("MASTER_PORT", str(_free_port()))
    assert distributed.env_store(0, 1, start_timeout_s=0.2) is not None  # world 1: no wait


def test_rank_0_on_a_taken_port_says_so(clean_env) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        clean_env.setenv("MASTER_ADDR", "127.0.0.1")
        clean_env.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        with pytest.raises(distributed.NoRendezvous, match="rank 0 cannot listen at"):
            distributed.env_store(0, 2, start_timeout_s=0.2)


@pytest.mark.parametrize("port", ["http", "0", "70000"])
def test_a_master_port_that_is_no_port_is_a_usage_error(clean_env, port: str) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", port)
    with pytest.raises(ValueError, match=f"MASTER_PORT={port} is not a TCP port"):
        distributed.env_store(0, 2, start_timeout_s=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_nnui_train_with_leftover_rank_variables_fails_in_one_line(
    demo_preprocessed, tmp_path, rank: int
) -> None:
    """Rank 0 waits for a rank 1 that never comes; rank 1 for a rank 0 that is not there.
    Old code: 10 minutes, then a 33-line traceback (the safety net below fails it)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENVS}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK=str(rank), WORLD_SIZE="2",
               LOCAL_RANK=str(rank))  # fmt: skip
    argv = [CONSOLE_SCRIPT, "900", "2d", "0", "-device", "cpu", "--preprocessed",
            str(demo_preprocessed.preprocessed), "--results", str(tmp_path / "r")]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and "left over from a finished job" in line, line
    assert f"unset {' '.join(STALE)}" in line, line
    # Nothing recorded, and no empty fold folder left behind by the refused run.
    assert not (tmp_path / "r").exists(), sorted(map(str, (tmp_path / "r").rglob("*")))
