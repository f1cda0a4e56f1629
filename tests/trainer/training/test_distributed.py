"""trainer/training/distributed.py: launcher detection, topology, batch split, collectives, spawn.

The spawn tests start real gloo ranks on the CPU (a few seconds each); worker functions
live at module level so the spawned children can import them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.training import distributed as dist_mod
from trainer.training import launch
from trainer.training.batch import RankBatch, loss_weight, split_global_batch
from trainer.training.launch import Topology

TESTS_DIR = Path(__file__).resolve().parent
REPO = Path(__file__).resolve().parents[3]
LAUNCH_ENVS = (
    "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "SLURM_STEP_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "PMI_RANK", "MASTER_PORT",
)  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCH_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ---- batch split ---------------------------------------------------------------------------

SPLITS = [
    # (G, W, sizes, shares) with p = 0.33: forced slots start at round(G * 0.67)
    (2, 1, [2], [0.5]),
    (2, 2, [1, 1], [0.0, 1.0]),
    (10, 4, [3, 3, 2, 2], [0.0, 0.0, 0.5, 1.0]),
    (5, 2, [3, 2], [0.0, 1.0]),
    (12, 4, [3, 3, 3, 3], [0.0, 0.0, 1 / 3, 1.0]),
    (40, 8, [5] * 8, [0.0] * 5 + [0.6, 1.0, 1.0]),
    (7, 7, [1] * 7, [0.0] * 5 + [1.0, 1.0]),
]


@pytest.mark.parametrize(("global_batch", "world", "sizes", "shares"), SPLITS)
def test_split_global_batch_table(
    global_batch: int, world: int, sizes: list[int], shares: list[float]
) -> None:
    split = split_global_batch(global_batch, world)
    assert [r.batch_size for r in split] == sizes
    assert [r.oversample_share for r in split] == pytest.approx(shares)


@pytest.mark.parametrize("oversample", [0.0, 0.33, 0.5, 1.0])
def test_split_keeps_forced_count_exact(oversample: float) -> None:
    for global_batch in range(1, 41):
        expected = global_batch - round(global_batch * (1 - oversample))
        for world in range(1, global_batch + 1):
            split = split_global_batch(global_batch, world, oversample)
            assert sum(r.batch_size for r in split) == global_batch
            forced = sum(r.batch_size * r.oversample_share for r in split)
            assert round(forced) == expected
            assert abs(forced - expected) < 1e-9


def test_split_rejects_batch_smaller_than_world() -> None:
    with pytest.raises(ValueError, match=r"^global batch size 1 < world size 2: "):
        split_global_batch(1, 2)
    with pytest.raises(ValueError, match="oversample"):
        split_global_batch(4, 2, 1.5)
    assert split_global_batch(3, 1, 0.0) == [RankBatch(3, 0.0)]


# ---- launcher detection and topology -----------------------------------------------------

LAUNCHERS = [
    ({}, None),
    ({"RANK": "1"}, None),  # a stale RANK alone changes nothing
    ({"RANK": "1", "WORLD_SIZE": "2"}, None),
    ({"LOCAL_RANK": "0"}, None),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "external"),
    ({"TORCHELASTIC_RUN_ID": "abc"}, "torchrun"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun"),
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, None),  # the batch shell, not a step
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, "external"),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "external"),
    ({"PMI_SIZE": "4", "PMI_RANK": "3"}, "external"),
]


@pytest.mark.parametrize(("env", "expected"), LAUNCHERS)
def test_detect_external_launcher(env: dict[str, str], expected: str | None) -> None:
    assert launch.detect_external_launcher(env) == expected


RANKS = [
    ({}, (None, None)),
    ({"RANK": "3"}, (None, None)),
    ({"RANK": "3", "WORLD_SIZE": "4"}, (3, 4)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "8"}, (2, 8)),
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, (1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6"}, (5, 6)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2)),
]


@pytest.mark.parametrize(("env", "expected"), RANKS)
def test_rank_and_size_from_env(env: dict[str, str], expected: tuple) -> None:
    assert launch.env_rank_and_size(env) == expected


LOCALS = [
    ({}, (None, None)),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2)),
    ({"SLURM_LOCALID": "3", "SLURM_NTASKS_PER_NODE": "4"}, (3, 4)),
    ({"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2(x3)"}, (0, 2)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, (1, 8)),
    ({"LOCAL_RANK": "0", "SLURM_LOCALID": "5"}, (0, None)),
]


@pytest.mark.parametrize(("env", "expected"), LOCALS)
def test_local_rank_from_env(env: dict[str, str], expected: tuple) -> None:
    assert launch.env_local(env) == expected


@pytest.mark.parametrize(
    ("hosts", "rank", "expected"),
    [
        (["a"], 0, (0, 1)),
        (["a", "a", "b", "b"], 1, (1, 2)),
        (["a", "a", "b", "b"], 2, (0, 2)),
        (["a", "b", "a", "b", "a"], 4, (2, 3)),
    ],
)
def test_local_rank_from_hosts(hosts: list[str], rank: int, expected: tuple) -> None:
    assert launch.local_from_hosts(hosts, rank) == expected


def test_topology_and_device() -> None:
    topo = Topology(1, 4, 1, 2, "h", "torchrun")
    assert not topo.is_main and Topology(0, 1, 0, 1, "h", "single").is_main
    assert launch.device_for(topo, "cuda") == torch.device("cuda", 1)
    assert launch.device_for(topo, "cpu") == torch.device("cpu")
    assert launch.device_for(topo, "mps") == torch.device("mps")


# ---- run_distributed: single process and user errors -----------------------------------


def _record_worker(topology: Topology, payload: list) -> int:
    payload.append(topology)
    return 7


@pytest.mark.parametrize("num_gpus", [None, 1])
def test_single_process_runs_in_process(
    clean_env: pytest.MonkeyPatch, num_gpus: int | None
) -> None:
    clean_env.setenv("RANK", "3")  # stale, ignored
    seen: list = []
    assert launch.run_distributed(_record_worker, seen, num_gpus, "cpu") == 7
    (topo,) = seen
    assert (topo.global_rank, topo.world_size, topo.local_rank, topo.launcher) == (
        0, 1, 0, "single",
    )  # fmt: skip


def test_num_gpus_under_launcher_is_an_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ValueError, match="launcher decides"):
        launch.run_distributed(_record_worker, [], 2, "cpu")


@pytest.mark.parametrize(
    ("num_gpus", "device", "match"),
    [(2, "mps", "mps"), (64, "cuda", "CUDA device")],
)
def test_bad_num_gpus(
    clean_env: pytest.MonkeyPatch, num_gpus: int, device: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        launch.run_distributed(_record_worker, [], num_gpus, device)


def test_collectives_are_no_ops_in_one_process() -> None:
    t = torch.arange(3.0, requires_grad=True)
    assert dist_mod.all_reduce_sum(t) is t
    assert dist_mod.differentiable_all_reduce_sum(t) is t
    assert dist_mod.stop_agreed(True, "cpu") is True
    assert dist_mod.stop_agreed(False, "cpu") is False
    assert dist_mod.gather_objects({"a": 1}) == [{"a": 1}]
    assert dist_mod.broadcast_object([1, "x"]) == [1, "x"]
    dist_mod.barrier()


# ---- real gloo ranks ---------------------------------------------------------------------


def _soft_dice_loss(probs: torch.Tensor, target: torch.Tensor, reduce) -> torch.Tensor:
    """Batch dice: tp/fp/fn summed over the batch (and, through `reduce`, over ranks)."""
    stats = torch.stack(
        [(probs * target).sum(), (probs * (1 - target)).sum(), ((1 - probs) * target).sum()]
    )
    tp, fp, fn = reduce(stats)
    return 1 - (2 * tp + 1e-5) / (2 * tp + fp + fn + 1e-5)


def _dice_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 1, 6, 6, generator=gen), (torch.rand(4, 1, 6, 6, generator=gen) > 0.5)


def _collectives_worker(topology: Topology, out_dir: str) -> int:
    rank, world = topology.global_rank, topology.world_size
    logits, target = _dice_inputs()
    per_rank = logits.shape[0] // world
    mine = logits[rank * per_rank : (rank + 1) * per_rank].clone().requires_grad_(True)
    loss = _soft_dice_loss(
        torch.sigmoid(mine),
        target[rank * per_rank : (rank + 1) * per_rank].float(),
        dist_mod.differentiable_all_reduce_sum,
    )
    loss.backward()
    result = {
        "topology": [rank, world, topology.local_rank, topology.local_world_size],
        "launcher": topology.launcher,
        "pid": os.getpid(),
        "env": [
            os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        ],
        "threads": torch.get_num_threads(),
        "loss": loss.item(),
        # DDP averages parameter gradients over ranks: emulate that here.
        "grad": (mine.grad / world).flatten().tolist(),
        "sum": dist_mod.all_reduce_sum(torch.tensor([rank + 1.0])).item(),
        "stop_none": dist_mod.stop_agreed(False, "cpu"),
        "stop_one": dist_mod.stop_agreed(rank == world - 1, "cpu"),
        "broadcast": dist_mod.broadcast_object({"from": rank, "text": "é" * rank}),
    }
    gathered = dist_mod.gather_objects({"rank": rank, "pid": os.getpid()})
    result["gathered"] = gathered
    shared = dist_mod.broadcast_tensors(
        {"w": torch.arange(6.0).reshape(2, 3), "i": torch.tensor([7], dtype=torch.int64)}
        if rank == 0
        else None
    )
    result["tensors"] = {k: [str(v.dtype), v.tolist()] for k, v in shared.items()}
    if rank == 0:  # the --npz path: other ranks send, rank 0 receives in a fixed order
        received = [dist_mod.recv_from(r, torch.float32) for r in range(1, world)]
        result["received"] = [t.tolist() for t in received]
    else:
        dist_mod.send_to_main(torch.full((2, 1, 3), float(rank)))
    dist_mod.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    return 0


def test_spawn_two_gloo_ranks(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.delenv("OMP_NUM_THREADS", raising=False)
    assert launch.run_distributed(_collectives_worker, str(tmp_path), 2, "cpu") == 0
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = len(os.sched_getaffinity(0))
    for rank, res in enumerate(results):
        assert res["topology"] == [rank, 2, rank, 2]
        assert res["launcher"] == "spawn"
        assert res["env"] == [str(rank), "2", str(rank), "2"]
        assert res["threads"] == max(1, cores // 2)
        assert res["sum"] == 3.0
        assert res["stop_none"] is False and res["stop_one"] is True
        assert res["broadcast"] == {"from": 0, "text": ""}
    assert results[0]["gathered"] == [{"rank": r, "pid": results[r]["pid"]} for r in range(2)]
    assert results[1]["gathered"] is None
    for res in results:
        assert res["tensors"] == {
            "w": ["torch.float32", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]],
            "i": ["torch.int64", [7]],
        }
    assert results[0]["received"] == [[[[1.0, 1.0, 1.0]], [[1.0, 1.0, 1.0]]]]
    assert os.getpid() not in {res["pid"] for res in results}
    # The gradient through the all-reduced batch dice equals the single-process one.
    logits, target = _dice_inputs()
    whole = logits.clone().requires_grad_(True)
    loss = _soft_dice_loss(torch.sigmoid(whole), target.float(), lambda s: s)
    loss.backward()
    assert results[0]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    split_grad = torch.tensor(results[0]["grad"] + results[1]["grad"])
    torch.testing.assert_close(split_grad, whole.grad.flatten(), rtol=1e-5, atol=1e-8)


def _failing_worker(topology: Topology, codes: list[int]) -> int:
    code = codes[topology.global_rank]
    if code < 0:
        raise RuntimeError("boom in rank")
    return code


@pytest.mark.slow
@pytest.mark.parametrize(("codes", "expected"), [([0, 3], 1), ([-1, 0], 1)])
def test_spawn_parent_fails_when_a_rank_fails(
    clean_env: pytest.MonkeyPatch, codes: list[int], expected: int
) -> None:
    assert launch.run_distributed(_failing_worker, codes, 2, "cpu") == expected


# ---- signals to the spawn parent (a real parent process) --------------------------------


def _stop_worker(topology: Topology, out_dir: str) -> int:
    """Train-like loop: reinstall the flag handler, agree on stopping at each 'epoch'."""
    from trainer import stop

    stop.install()  # keeps a flag raised before (the spawn entry installed it first)
    Path(out_dir, f"pid{topology.global_rank}").write_text(str(os.getpid()))
    epoch = 0
    while not dist_mod.stop_agreed(stop.requested(), "cpu"):
        time.sleep(0.1)
        epoch += 1
    Path(out_dir, f"done{topology.global_rank}").write_text(json.dumps({"epoch": epoch}))
    return 0


def _start_parent(out_dir: Path) -> subprocess.Popen:
    # Like trainer.run: the flag handler first, torch later.
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from trainer import stop; stop.install(); "
        "import logging; logging.basicConfig(level=logging.INFO); "
        f"sys.path.insert(0, {str(TESTS_DIR)!r}); "
        "import test_distributed as t; from trainer.training import launch as d; "
        f"sys.exit(d.run_distributed(t._stop_worker, {str(out_dir)!r}, 2, 'cpu'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENVS}
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True
    )


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("when", ["running", "parent starting", "ranks starting"])
def test_sigusr1_to_spawn_parent_stops_all_ranks(tmp_path: Path, when: str) -> None:
    parent = _start_parent(tmp_path)
    stderr = ""
    try:
        if when == "running":
            _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 60)
        elif when == "parent starting":
            time.sleep(0.3)  # the parent is still importing torch: its flag handler holds it
        else:
            # Right after the spawn: the ranks are importing torch, before any handler of
            # theirs exists; the blocked signal mask they inherit keeps it pending.
            for line in parent.stderr:
                stderr += line
                if "spawned 2 ranks" in line:
                    break
        parent.send_signal(signal.SIGUSR1)
        _, rest = parent.communicate(timeout=60)
        stderr += rest
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 0, stderr
    done = [json.loads((tmp_path / f"done{r}").read_text()) for r in range(2)]
    assert done[0] == done[1]  # both left at the same epoch


@pytest.mark.slow
def test_sigterm_to_spawn_parent_ends_ranks_non_zero(tmp_path: Path) -> None:
    parent = _start_parent(tmp_path)
    try:
        _wait_for([tmp_path / "pid0", tmp_path / "pid1"], 60)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        parent.send_signal(signal.SIGTERM)
        parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    assert parent.returncode == 128 + signal.SIGTERM
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "per_rank",
    [
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "{r}"},  # mpirun
        # RANK/WORLD_SIZE/LOCAL_RANK alone: the short first-contact timeout, live ranks
        {"RANK": "{r}", "WORLD_SIZE": "2", "LOCAL_RANK": "{r}"},
    ],
    ids=["mpirun", "rank-variables"],
)
def test_mpirun_like_launch_gathers_local_ranks_from_hostnames(
    tmp_path: Path, per_rank: dict[str, str]
) -> None:
    """Rank/size but no local world size: the hostname all_gather decides it."""
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS_DIR)!r}); sys.path.insert(0, {str(REPO)!r}); "
        "import test_distributed as t; from trainer.training import launch as d; "
        f"sys.exit(d.run_distributed(t._collectives_worker, {str(tmp_path)!r}, None, 'cpu'))"
    )
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENVS}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**base, **{k: v.format(r=r) for k, v in per_rank.items()}},
        )
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [res["topology"] for res in results] == [[0, 2, 0, 2], [1, 2, 1, 2]]
    assert {res["launcher"] for res in results} == {"external"}


def test_srun_without_master_addr_is_an_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.delenv("MASTER_ADDR", raising=False)
    clean_env.setenv("SLURM_STEP_ID", "0")
    clean_env.setenv("SLURM_NTASKS", "2")
    clean_env.setenv("SLURM_PROCID", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT must be set"):
        launch.run_distributed(_record_worker, [], None, "cpu")


# ---- review fixes: local-rank fallback, -num_gpus under launchers, loss weights ---------


@pytest.mark.parametrize(
    ("known", "hosts", "rank", "expected"),
    [
        ((None, None), ["a", "a", "b"], 1, (1, 2)),
        ((3, None), ["a", "a", "b"], 1, (3, 2)),  # a known SLURM_LOCALID is kept
        ((None, 8), ["a", "b"], 1, (0, 8)),
        ((2, 4), ["a"], 0, (2, 4)),
    ],
)
def test_hostname_fallback_fills_only_missing_values(known, hosts, rank, expected) -> None:
    assert launch.fill_local(known, hosts, rank) == expected


@pytest.mark.parametrize("num_gpus", [1, 2, 8])
@pytest.mark.parametrize("launcher", ["torchrun", "external"])
def test_every_num_gpus_is_refused_under_a_launcher(num_gpus: int, launcher: str) -> None:
    with pytest.raises(ValueError, match="launcher decides"):
        launch.check_num_gpus(num_gpus, launcher)
    launch.check_num_gpus(None, launcher)
    launch.check_num_gpus(num_gpus, None)


@pytest.mark.parametrize(
    ("sizes", "weights"),
    [
        ([2], [1.0]),
        ([1, 1], [1.0, 1.0]),
        ([3, 2], [1.2, 0.8]),
        ([3, 3, 2, 2], [1.2, 1.2, 0.8, 0.8]),
    ],
)
def test_loss_weight_is_share_times_world(sizes: list[int], weights: list[float]) -> None:
    assert [loss_weight(sizes, r) for r in range(len(sizes))] == pytest.approx(weights)


GRAD_BATCH = 5  # split [3, 2] over two ranks


def _grad_inputs() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(3)
    net = torch.nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(GRAD_BATCH, 2, 6, 6, generator=gen)
    y = torch.randint(0, 3, (GRAD_BATCH, 1, 6, 6), generator=gen)
    return net, x, y


def _grad_worker(topology: Topology, out_dir: str) -> int:
    from torch.nn.parallel import DistributedDataParallel

    from trainer.network.loss import DeepSupervisionLoss

    rank = topology.global_rank
    sizes = [b.batch_size for b in split_global_batch(GRAD_BATCH, topology.world_size)]
    low = sum(sizes[:rank])
    result = {}
    cases = [
        (f"{name}{'' if batch_dice else '_per_sample'}", weight_ce, batch_dice)
        for batch_dice in (True, False)
        for name, weight_ce in (("weighted", loss_weight(sizes, rank)), ("plain", 1.0))
    ]
    for name, weight_ce, batch_dice in cases:
        net, x, y = _grad_inputs()
        model = DistributedDataParallel(net)
        loss_fn = DeepSupervisionLoss(
            1, reduce_fn=dist_mod.differentiable_all_reduce_sum, weight_ce=weight_ce,
            batch_dice=batch_dice,
        )  # fmt: skip
        loss = loss_fn(model(x[low : low + sizes[rank]]), y[low : low + sizes[rank]])
        loss.backward()
        result[name] = torch.cat([p.grad.flatten() for p in net.parameters()]).tolist()
        result[name + "_loss"] = dist_mod.all_reduce_sum(loss.detach().clone()).item() / 2
    Path(out_dir, f"grad{rank}.json").write_text(json.dumps(result))
    return 0


def test_uneven_split_gradient_equals_single_process(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    """G=5 over 2 gloo ranks ([3, 2]): DDP's averaged gradient is the one-process gradient."""
    from trainer.network.loss import DeepSupervisionLoss

    assert launch.run_distributed(_grad_worker, str(tmp_path), 2, "cpu") == 0
    results = [json.loads((tmp_path / f"grad{r}.json").read_text()) for r in range(2)]
    for batch_dice, suffix in ((True, ""), (False, "_per_sample")):  # 2d and 3d Dice
        net, x, y = _grad_inputs()
        loss = DeepSupervisionLoss(1, batch_dice=batch_dice)(net(x), y)
        loss.backward()
        whole = torch.cat([p.grad.flatten() for p in net.parameters()])
        for res in results:  # DDP leaves the same averaged gradient on every rank
            weighted = torch.tensor(res["weighted" + suffix])
            torch.testing.assert_close(weighted, whole, rtol=1e-5, atol=1e-7)
            assert res[f"weighted{suffix}_loss"] == pytest.approx(loss.item(), rel=1e-6)
            # Unweighted per-rank means over-weight the 2-sample rank: the check has teeth.
            plain = torch.tensor(res["plain" + suffix])
            assert not torch.allclose(plain, whole, rtol=1e-4, atol=1e-6)


def _sleepy_worker(topology: Topology, out_dir: str) -> int:
    from trainer import stop

    ready = Path(out_dir, "rank1_ready")
    if topology.global_rank == 0:
        # Fail only once rank 1 is in its worker: failing while it still joins the group
        # makes it fail there (a connection closed by peer), not wait for the SIGTERM.
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 3
    stop.install_termination()
    ready.write_text("1")
    try:
        time.sleep(120)
    except stop.Terminated as terminated:
        Path(out_dir, "terminated").write_text(str(terminated.signum))
        return 128 + terminated.signum
    return 0


@pytest.mark.slow
def test_failed_rank_makes_the_parent_sigterm_the_others(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    started = time.monotonic()
    assert launch.run_distributed(_sleepy_worker, str(tmp_path), 2, "cpu") == 1
    # SIGTERM at once (the survivor records why), not a SIGKILL after the 30 s grace.
    assert time.monotonic() - started < launch.FAILED_RANK_GRACE_S
    assert (tmp_path / "terminated").read_text() == str(int(signal.SIGTERM))


def test_cpu_training_keeps_freed_memory_in_a_glibc_process() -> None:
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    code = "from trainer.allocator import keep_freed_memory; print(keep_freed_memory())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # glibc's own malloc
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == "True", result.stderr
