"""Real multi-process trainings on the CPU (gloo): -num_gpus, torchrun, two torchrun "nodes",
graceful stop through one rank or through the spawn parent, resume, and the user errors.

All slow: each run starts 2-3 Python processes that import torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.schema.events import decode_event
from trainer.schema.status import State, read_status
from trainer.schema.tree import EVENTS_FILE, SUMMARY_FILE, VALIDATION_DIR, checkpoint_file

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ENVS = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_STEP_ID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "CUDA_VISIBLE_DEVICES",
)

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENVS}
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trainer_args(demo, results: Path, *extra: str, configuration: str = "2d") -> list[str]:
    return [
        "900",
        configuration,
        "0",
        "-device",
        "cpu",
        "--epochs",
        "2",
        "--iterations-per-epoch",
        "2",
        "--val-iterations",
        "1",
        "--num-workers",
        "1",
        "--preprocessed",
        str(demo.preprocessed),
        "--results",
        str(results),
        *extra,
    ]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "trainer"]


class Procs:
    """Processes a test started; killed by PID (and their listed ranks) at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen] = []
        self.rank_pids: set[int] = set()

    def start(self, argv: list[str], name: str, env: dict[str, str] | None = None):
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed by the child's exit
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env or _env(),
            start_new_session=True,
        )
        log.close()
        self.started.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def cleanup(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for pid in self.rank_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


def run_folder(results: Path, configuration: str = "2d") -> Path:
    return results / "Dataset900_NnuiDemo" / f"nnuiTrainer__nnuiPlans__{configuration}" / "fold_0"


def events(folder: Path) -> list[dict]:
    path = folder / EVENTS_FILE
    if not path.exists():
        return []
    out = [decode_event(line) for line in path.read_text().splitlines()]
    return [e for e in out if e is not None]


def of_kind(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e["kind"] == kind]


def wait_events(folder: Path, kind: str, count: int, proc: subprocess.Popen, timeout_s=300):
    """Until `count` events of `kind` exist (or the process ended); the timeout only
    guards against a hang on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = of_kind(events(folder), kind)
        if len(found) >= count:
            return found
        assert proc.poll() is None, f"exited {proc.returncode} before {count} {kind} events"
        assert time.monotonic() < deadline, f"no {count} {kind} events in {timeout_s} s"
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout_s: float = 600) -> int:
    return proc.wait(timeout=timeout_s)


def assert_clean_finish(folder: Path, world_size: int, launcher: str) -> list[dict]:
    evs = events(folder)
    (started,) = of_kind(evs, "run_started")
    assert (started["world_size"], started["launcher"]) == (world_size, launcher)
    (topology,) = of_kind(evs, "topology")
    ranks = topology["ranks"]
    assert [r["global_rank"] for r in ranks] == list(range(world_size))
    assert len({r["pid"] for r in ranks}) == world_size
    assert all(r["sigusr1_handler"] for r in ranks)
    assert of_kind(evs, "finished")
    assert (folder / checkpoint_file("final")).exists()
    assert (folder / VALIDATION_DIR / SUMMARY_FILE).exists()
    return ranks


# ---- launch modes --------------------------------------------------------------------------


def test_num_gpus_2_trains_end_to_end(demo_preprocessed, tmp_path, procs) -> None:
    proc = procs.start(
        [
            sys.executable,
            "-m",
            "trainer",
            *trainer_args(demo_preprocessed, tmp_path / "r", "-num_gpus", "2"),
        ],
        "spawn",
    )
    assert finish(proc) == 0, procs.log("spawn")
    ranks = assert_clean_finish(run_folder(tmp_path / "r"), 2, "spawn")
    assert proc.pid not in {r["pid"] for r in ranks}  # the parent is not a worker
    assert [r["local_rank"] for r in ranks] == [0, 1]
    # Global batch 4 split 2 + 2; oversampling stays exact globally (1 of 4 forced).
    assert [r["batch_size"] for r in ranks] == [2, 2]
    assert [r["oversample_foreground_percent"] for r in ranks] == [0.0, 0.5]


def test_torchrun_two_processes(demo_preprocessed, tmp_path, procs) -> None:
    argv = torchrun("--standalone", "--nproc_per_node=2")
    proc = procs.start([*argv, *trainer_args(demo_preprocessed, tmp_path / "r")], "torchrun")
    assert finish(proc) == 0, procs.log("torchrun")
    ranks = assert_clean_finish(run_folder(tmp_path / "r"), 2, "torchrun")
    assert [r["local_rank"] for r in ranks] == [0, 1]


def _start_two_nodes(procs: Procs, demo, tmp_path: Path, name: str, *extra: str):
    """Two torchrun "nodes" on localhost with static ranks (node 0 holds global rank 0),
    each with its own results root, as on two machines without a shared file system."""
    port = _free_port()
    return [
        procs.start(
            [
                *torchrun(
                    "--nnodes=2",
                    f"--node_rank={node}",
                    "--nproc_per_node=1",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                ),
                *trainer_args(demo, tmp_path / f"{name}{node}", *extra),
            ],
            f"{name}-node{node}",
        )
        for node in range(2)
    ]


def test_two_torchrun_nodes_only_rank0_writes_npz_and_resume(demo_preprocessed, tmp_path, procs):
    """--npz: rank 1's probabilities reach rank 0, which writes them; the other node's results
    stay empty. --c: only node 0 has the checkpoint; rank 0 hands it to rank 1, and the
    stopped-and-resumed curves equal the uninterrupted ones."""
    epochs = ("--epochs", "4")
    raw = ("--raw", str(demo_preprocessed.raw))  # final validation in the raw geometry
    nodes = _start_two_nodes(procs, demo_preprocessed, tmp_path, "whole", *epochs, "--npz", *raw)
    codes = [finish(p) for p in nodes]
    assert codes == [0, 0], procs.log("whole-node0") + procs.log("whole-node1")
    whole = run_folder(tmp_path / "whole0")
    ranks = assert_clean_finish(whole, 2, "torchrun")
    assert [r["local_rank"] for r in ranks] == [0, 0]  # one process per node
    assert not any((tmp_path / "whole1").rglob("*")), "a non-zero rank wrote under results"
    summary = (whole / VALIDATION_DIR / SUMMARY_FILE).read_text()
    import json

    import numpy as np

    files = [Path(c["prediction_file"]).name for c in json.loads(summary)["metric_per_case"]]
    case_ids = [name.split(".", 1)[0] for name in files]
    assert len(case_ids) == 2  # one predicted by each rank
    for case_id in case_ids:
        with np.load(whole / VALIDATION_DIR / f"{case_id}.npz") as saved:
            probabilities = saved["probabilities"]
        assert probabilities.dtype == np.float32
        assert np.allclose(probabilities.sum(0), 1, atol=1e-4)
    assert not list((whole / VALIDATION_DIR).glob(".*.tmp"))

    first = _start_two_nodes(procs, demo_preprocessed, tmp_path, "split", *epochs)
    folder = run_folder(tmp_path / "split0")
    (topology,) = wait_events(folder, "topology", 1, first[0])
    procs.rank_pids.update(r["pid"] for r in topology["ranks"])
    wait_events(folder, "epoch_ended", 1, first[0])
    os.kill(topology["ranks"][1]["pid"], signal.SIGUSR1)  # the rank on the other node
    stopped = _assert_stopped_together(folder, [finish(p) for p in first])
    assert stopped["epoch"] < 3, "stopped too late to test resuming"
    assert not any((tmp_path / "split1").rglob("*"))
    resumed = _start_two_nodes(procs, demo_preprocessed, tmp_path, "split", *epochs, "--c")
    codes = [finish(p) for p in resumed]
    assert codes == [0, 0], procs.log("split-node0") + procs.log("split-node1")
    assert not any((tmp_path / "split1").rglob("*"))
    split_epochs = of_kind(events(folder), "epoch_ended")
    whole_epochs = of_kind(events(whole), "epoch_ended")
    assert [e["epoch"] for e in split_epochs] == [0, 1, 2, 3]
    for key in ("train_loss", "val_loss", "mean_fg_dice", "lr"):
        assert [e[key] for e in split_epochs] == pytest.approx(
            [e[key] for e in whole_epochs], rel=1e-5
        ), key
    assert of_kind(events(folder), "finished")


def test_stale_rank_alone_changes_nothing(demo_preprocessed, tmp_path, procs) -> None:
    proc = procs.start(
        [
            sys.executable,
            "-m",
            "trainer",
            *trainer_args(demo_preprocessed, tmp_path / "r", "--epochs", "1"),
        ],
        "single",
        env=_env(RANK="1"),
    )
    assert finish(proc) == 0, procs.log("single")
    ranks = assert_clean_finish(run_folder(tmp_path / "r"), 1, "single")
    assert ranks[0]["pid"] == proc.pid


# ---- user errors: one line, exit 2 -----------------------------------------------------------


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_num_gpus_under_a_launcher_is_refused(demo_preprocessed, tmp_path) -> None:
    argv = trainer_args(demo_preprocessed, tmp_path / "r", "-num_gpus", "2")
    done = subprocess.run(
        [sys.executable, "-m", "trainer", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(TORCHELASTIC_RUN_ID="x", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),
        timeout=120,
    )
    assert "launcher" in _one_error_line(done)


def test_global_batch_smaller_than_world_is_refused(demo_preprocessed, tmp_path) -> None:
    argv = trainer_args(
        demo_preprocessed, tmp_path / "r", "-num_gpus", "3", configuration="3d_fullres"
    )
    done = subprocess.run(
        [sys.executable, "-m", "trainer", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert "global batch size 2 < world size 3" in _one_error_line(done)


# ---- graceful stop -------------------------------------------------------------------------


def _assert_stopped_together(folder: Path, proc_codes: list[int]) -> dict:
    assert all(code == 0 for code in proc_codes), proc_codes
    evs = events(folder)
    (stopped,) = of_kind(evs, "stopped")
    assert of_kind(evs, "stop_requested")
    assert not of_kind(evs, "finished")
    assert (folder / checkpoint_file("latest")).exists()
    assert read_status(folder).state == State.STOPPED
    return stopped


def test_sigusr1_to_rank_1_under_torchrun_stops_all(demo_preprocessed, tmp_path, procs) -> None:
    argv = torchrun("--standalone", "--nproc_per_node=2")
    results = tmp_path / "r"
    proc = procs.start(
        [*argv, *trainer_args(demo_preprocessed, results, "--epochs", "200")], "torchrun"
    )
    folder = run_folder(results)
    (topology,) = wait_events(folder, "topology", 1, proc)
    ranks = topology["ranks"]
    procs.rank_pids.update(r["pid"] for r in ranks)
    wait_events(folder, "epoch_ended", 1, proc)
    os.kill(ranks[1]["pid"], signal.SIGUSR1)  # one rank only; never torchrun itself
    assert finish(proc) == 0, procs.log("torchrun")
    stopped = _assert_stopped_together(folder, [proc.returncode])
    last_epoch = of_kind(events(folder), "epoch_ended")[-1]["epoch"]
    assert stopped["epoch"] == last_epoch
    (request,) = of_kind(events(folder), "stop_requested")
    assert 1 in request["ranks"] and 0 not in request["ranks"]
    for rank in ranks:  # every worker is gone, none left orphaned
        assert not _alive(rank["pid"])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stop_spawn_run(demo, results: Path, procs: Procs, name: str, *extra: str):
    proc = procs.start(
        [sys.executable, "-m", "trainer", *trainer_args(demo, results, "-num_gpus", "2", *extra)],
        name,
    )
    folder = run_folder(results)
    (topology,) = wait_events(folder, "topology", 1, proc)
    procs.rank_pids.update(r["pid"] for r in topology["ranks"])
    wait_events(folder, "epoch_ended", 1, proc)
    proc.send_signal(signal.SIGUSR1)  # to the -num_gpus parent: it forwards, it does not die
    assert finish(proc) == 0, procs.log(name)
    return folder, topology


def test_sigusr1_to_num_gpus_parent_stops_all(demo_preprocessed, tmp_path, procs) -> None:
    folder, topology = _stop_spawn_run(
        demo_preprocessed, tmp_path / "r", procs, "spawn", "--epochs", "200"
    )
    stopped = _assert_stopped_together(folder, [0])
    assert stopped["epoch"] == of_kind(events(folder), "epoch_ended")[-1]["epoch"]
    (request,) = of_kind(events(folder), "stop_requested")
    assert sorted(request["ranks"]) == [0, 1]
    for rank in topology["ranks"]:
        assert not _alive(rank["pid"])


def test_ddp_resume_continues_exactly(demo_preprocessed, tmp_path, procs) -> None:
    """Stop a -num_gpus 2 run after an epoch, resume it with --c: same curves as unbroken."""
    epochs = ("--epochs", "4")
    whole = procs.start(
        [
            sys.executable,
            "-m",
            "trainer",
            *trainer_args(demo_preprocessed, tmp_path / "whole", "-num_gpus", "2", *epochs),
        ],
        "whole",
    )
    assert finish(whole) == 0, procs.log("whole")
    folder, _ = _stop_spawn_run(demo_preprocessed, tmp_path / "split", procs, "first", *epochs)
    stopped = _assert_stopped_together(folder, [0])
    assert stopped["epoch"] < 3, "stopped too late to test resuming"
    resumed = procs.start(
        [
            sys.executable,
            "-m",
            "trainer",
            *trainer_args(demo_preprocessed, tmp_path / "split", "-num_gpus", "2", *epochs, "--c"),
        ],
        "resumed",
    )
    assert finish(resumed) == 0, procs.log("resumed")
    split_epochs = of_kind(events(folder), "epoch_ended")
    whole_epochs = of_kind(events(run_folder(tmp_path / "whole")), "epoch_ended")
    assert [e["epoch"] for e in split_epochs] == [0, 1, 2, 3]
    for key in ("train_loss", "val_loss", "mean_fg_dice", "lr"):
        assert [e[key] for e in split_epochs] == pytest.approx(
            [e[key] for e in whole_epochs], rel=1e-5
        ), key
    assert of_kind(events(folder), "finished")


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() < 2, reason="needs two CUDA GPUs")
def test_num_gpus_2_with_nccl(demo_preprocessed, tmp_path, procs) -> None:
    argv = trainer_args(demo_preprocessed, tmp_path / "r", "-num_gpus", "2", "--npz")
    argv[argv.index("-device") + 1] = "cuda"
    proc = procs.start([sys.executable, "-m", "trainer", *argv], "nccl")
    assert finish(proc) == 0, procs.log("nccl")
    folder = run_folder(tmp_path / "r")
    ranks = assert_clean_finish(folder, 2, "spawn")
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    assert len(list((folder / VALIDATION_DIR).glob("*.npz"))) == 2
