"""Everything torch.distributed: launch modes, topology, batch split, collectives (DESIGN §4-§5).

The one module that imports torch.distributed or spawns ranks. Three ways to run, one code
path for the worker function:

- single: no launcher and `-num_gpus` None/1 -> `worker_fn` runs in this process, no group;
- spawn: `-num_gpus N` -> this process becomes a parent that starts N ranks (start method
  spawn), forwards SIGUSR1 to them and waits; it is never a worker itself;
- torchrun / external: a launcher started us -> join its group from the environment.
  srun or mpirun without torchrun work too, but then MASTER_ADDR and MASTER_PORT must be
  exported by the user or the job script (SLURM/MPI define ranks, not a rendezvous).

Object collectives exchange JSON over byte tensors (never pickle) on a gloo group, so they
work the same with nccl.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer import stop

log = logging.getLogger(__name__)

LAUNCHERS = ("single", "spawn", "torchrun", "external")
# How long the spawn parent lets the other ranks finish after one failed, and after it
# forwarded SIGTERM/SIGINT, before it kills what is left.
_FAILED_RANK_GRACE_S = 30.0
_TERMINATE_GRACE_S = 10.0
_INIT_TIMEOUT = timedelta(minutes=10)

# The gloo group used for JSON object collectives (None = the default group when it is
# gloo already). Set by _init_group, cleared by _destroy_group.
_object_group: Any = None


@dataclass(frozen=True)
class Topology:
    """Where this process sits. local_rank picks the device; global_rank gates writes."""

    global_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str
    launcher: str  # single | spawn | torchrun | external

    @property
    def is_main(self) -> bool:
        return self.global_rank == 0


@dataclass(frozen=True)
class RankBatch:
    """One rank's share of the global batch."""

    batch_size: int
    oversample_share: float  # fraction of this rank's samples forced to contain foreground


def _single_topology() -> Topology:
    return Topology(0, 1, 0, 1, socket.gethostname(), "single")


# ---- launcher detection and topology from the environment -------------------------------


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of `names` that is set to an integer (SLURM may write '2(x3)': take 2)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            head = value.split("(", 1)[0].split(",", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def detect_external_launcher(env: Mapping[str, str] = os.environ) -> str | None:
    """ "torchrun", "external" or None.

    torchrun: TORCHELASTIC_RUN_ID is set. external: RANK, WORLD_SIZE and LOCAL_RANK are all
    set (a stale RANK alone changes nothing), or an srun step / mpirun with more than one
    task (SLURM_STEP_ID with SLURM_NTASKS > 1, OMPI_COMM_WORLD_SIZE > 1, PMI_SIZE > 1) —
    without that, N copies started by srun would each train alone and all write.
    """
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if all(env.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return "external"
    if env.get("SLURM_STEP_ID") is not None and (_env_int(env, "SLURM_NTASKS") or 1) > 1:
        return "external"
    if (_env_int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE") or 1) > 1:
        return "external"
    return None


def _env_rank_and_size(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    # RANK/WORLD_SIZE only count as a pair: a stale RANK alone must not be used.
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    for rank_name, size_name in (
        ("SLURM_PROCID", "SLURM_NTASKS"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ):
        rank, size = _env_int(env, rank_name), _env_int(env, size_name)
        if rank is not None and size is not None:
            return rank, size
    return None, None


def _env_local(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _env_int(
        env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"
    )
    return local_rank, local_size


def local_from_hosts(hosts: list[str], global_rank: int) -> tuple[int, int]:
    """(local rank, local world size) from every rank's host name, indexed by global rank."""
    mine = hosts[global_rank]
    same = [rank for rank, host in enumerate(hosts) if host == mine]
    return same.index(global_rank), len(same)


# ---- global batch split ------------------------------------------------------------------


def split_global_batch(
    global_batch: int, world_size: int, oversample: float = 0.33
) -> list[RankBatch]:
    """Split the plans batch size G over W ranks, keeping foreground oversampling exact.

    Sizes: G // W each, the first G mod W ranks one more. Global slot i is forced to hold
    foreground iff i >= round(G * (1 - p)); a rank's share is the forced fraction of its
    slots, so the whole batch has exactly as many forced samples as on one GPU.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if global_batch < world_size:
        raise ValueError(
            f"global batch size {global_batch} < world size {world_size}: every rank needs at "
            f"least one sample; use at most {global_batch} processes (-num_gpus / "
            "--nproc_per_node) or a plans file with a larger batch size"
        )
    if not 0.0 <= oversample <= 1.0:
        raise ValueError(f"oversample must lie in [0, 1], got {oversample}")
    first_forced = round(global_batch * (1 - oversample))
    base, extra = divmod(global_batch, world_size)
    out, low = [], 0
    for rank in range(world_size):
        size = base + (1 if rank < extra else 0)
        high = low + size
        forced = max(0, high - max(low, first_forced))
        out.append(RankBatch(batch_size=size, oversample_share=forced / size))
        low = high
    return out


# ---- entry point ---------------------------------------------------------------------------


def run_distributed(
    worker_fn: Callable[[Topology, Any], int],
    payload: Any,
    num_gpus: int | None,
    device_type: str,
) -> int:
    """Run `worker_fn(topology, payload)` once per rank; return the exit code.

    Raises ValueError for user mistakes (the CLI prints them as one `error:` line).
    """
    launcher = detect_external_launcher()
    if launcher is not None:
        # -num_gpus 1 is nnU-Net's default value, so only a real request is a conflict.
        if num_gpus is not None and num_gpus != 1:
            raise ValueError(
                f"-num_gpus {num_gpus} cannot be used under a launcher ({launcher}): the "
                "launcher decides the number of processes (e.g. torchrun --nproc_per_node); "
                "drop -num_gpus"
            )
        return _run_rank(worker_fn, payload, device_type, launcher, store=None)
    if num_gpus is not None and num_gpus < 1:
        raise ValueError(f"-num_gpus must be >= 1, got {num_gpus}")
    if num_gpus is None or num_gpus == 1:
        return int(worker_fn(_single_topology(), payload))
    if device_type == "cuda":
        available = torch.cuda.device_count()
        if num_gpus > available:
            raise ValueError(
                f"-num_gpus {num_gpus} but only {available} CUDA device(s) are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
    elif device_type == "mps":
        raise ValueError("-num_gpus > 1 is not supported with -device mps; use cuda or cpu")
    return _spawn_parent(worker_fn, payload, num_gpus, device_type)


def _run_rank(
    worker_fn: Callable[[Topology, Any], int],
    payload: Any,
    device_type: str,
    launcher: str,
    store: Any,
) -> int:
    try:
        topology = _init_group(device_type, launcher, store)
        _set_cpu_threads(topology)
        return int(worker_fn(topology, payload))
    finally:
        _destroy_group()


def _init_group(device_type: str, launcher: str, store: Any) -> Topology:
    global _object_group
    env = os.environ
    rank, world = _env_rank_and_size(env)
    local_rank, local_world = _env_local(env)
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": _INIT_TIMEOUT}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    else:
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            raise ValueError(
                "MASTER_ADDR and MASTER_PORT must be set when started by srun/mpirun without "
                "torchrun (e.g. export MASTER_ADDR=$(scontrol show hostnames "
                "$SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500)"
            )
        kwargs["init_method"] = "env://"
        if rank is not None and world is not None:
            kwargs.update(rank=rank, world_size=world)
    if backend == "nccl" and local_rank is not None:
        # Binding the device at init makes a wrong device fail now instead of hanging later.
        torch.cuda.set_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)
    _object_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    rank, world = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    if local_rank is None or local_world is None:
        hosts = _all_gather_json(host)
        local_rank, local_world = local_from_hosts(hosts, rank)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
    return Topology(rank, world, local_rank, local_world, host, launcher)


def _destroy_group() -> None:
    global _object_group
    _object_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _set_cpu_threads(topology: Topology) -> None:
    # Ranks sharing a node must share its cores: oversubscription is several times slower.
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // topology.local_world_size))


def device_for(topology: Topology, device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", topology.local_rank)
    if device_type in ("cpu", "mps"):
        return torch.device(device_type)
    raise ValueError(f"unknown device type {device_type!r}: use cuda, cpu or mps")


# ---- spawn mode ------------------------------------------------------------------------------


def _free_port_store(port: int) -> dist.TCPStore:
    """The rendezvous store, hosted by the spawn parent.

    Port 0 lets the store pick a free port itself, so no other process can take it between
    a probe and the bind (the failure seen with bind-to-0-then-close).
    """
    return dist.TCPStore(
        "localhost",
        port,
        world_size=None,
        is_master=True,
        timeout=_INIT_TIMEOUT,
        wait_for_workers=False,
    )


def _spawn_parent(
    worker_fn: Callable[[Topology, Any], int], payload: Any, num_procs: int, device_type: str
) -> int:
    import torch.multiprocessing as mp

    requested_port = _env_int(os.environ, "MASTER_PORT") or 0
    try:
        store = _free_port_store(requested_port)
    except (RuntimeError, OSError) as error:
        raise ValueError(f"cannot listen on MASTER_PORT={requested_port}: {error}") from error
    port = store.port
    # Children inherit the blocked mask across exec: a SIGUSR1 that arrives while they import
    # torch stays pending until _spawn_entry installed its flag handler, instead of killing
    # them. Ours stays pending too and is forwarded as soon as the rank pids are known.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    previous = {
        sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    }
    received: list[int] = []
    procs: list[Any] = []

    def forward(signum: int, _frame: Any) -> None:
        for proc in procs:
            if proc.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)
        if signum != signal.SIGUSR1:
            received.append(signum)

    try:
        context = mp.start_processes(
            _spawn_entry,
            args=(worker_fn, payload, num_procs, device_type, port),
            nprocs=num_procs,
            join=False,
            start_method="spawn",
        )
        procs.extend(context.processes)
        for sig in previous:
            signal.signal(sig, forward)
        if stop.requested():
            # The trainer's handler caught a SIGUSR1 before we took over: pass it on.
            forward(signal.SIGUSR1, None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        log.info("spawned %d ranks: pids %s", num_procs, [p.pid for p in procs])
        return _wait_ranks(procs, received)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store


def _wait_ranks(procs: list[Any], received: list[int]) -> int:
    """Wait for every rank; 0 iff all returned 0. SIGTERM/SIGINT: forwarded, exit 128+n."""
    deadline: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if (failed or received) and deadline is None:
            # One rank failed or we were told to stop: the others will error out of their
            # next collective; give them a moment, then end them.
            deadline = time.monotonic() + (_TERMINATE_GRACE_S if received else _FAILED_RANK_GRACE_S)
        if deadline is not None and time.monotonic() > deadline:
            for proc in alive:
                log.warning("rank pid %d still running, killing it", proc.pid)
                proc.kill()
            deadline = time.monotonic() + 5.0
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=0.5)
    for rank, proc in enumerate(procs):
        proc.join()
        if proc.exitcode != 0:
            log.error("rank %d (pid %d) exited with %s", rank, proc.pid, proc.exitcode)
    if received:
        return 128 + received[0]
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def _spawn_entry(
    local_rank: int,
    worker_fn: Callable[[Topology, Any], int],
    payload: Any,
    world_size: int,
    device_type: str,
    port: int,
) -> None:
    # The trainer's flag handler before anything else (trainer/stop.py is stdlib only).
    stop.install()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="localhost",
        MASTER_PORT=str(port),
    )
    try:
        store = dist.TCPStore("localhost", port, is_master=False, timeout=_INIT_TIMEOUT)
        code = _run_rank(worker_fn, payload, device_type, "spawn", store)
    except SystemExit:
        raise
    except BaseException:  # report every rank failure (KeyboardInterrupt too), then exit 1
        sys.stderr.write(f"[rank {local_rank}] {traceback.format_exc()}")
        sys.stderr.flush()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # The exit code is how the parent learns the rank's result (SystemExit passes through
    # torch's wrapper; a normal return means 0).
    if code:
        sys.exit(code)


# ---- collectives (all no-ops for one process) --------------------------------------------


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place SUM over ranks; returns `t`."""
    if _active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _AllReduceSum(torch.autograd.Function):
    # SUM forward and SUM backward: every rank's loss depends on every rank's inputs, so the
    # gradient of input r is the sum of all ranks' upstream gradients. Combined with DDP's
    # gradient mean this gives exactly the single-process gradient.
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def differentiable_all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    return _AllReduceSum.apply(t) if _active() else t


def stop_agreed(local_flag: bool, device: torch.device | str) -> bool:
    """True on every rank iff any rank's flag is set (all_reduce MAX)."""
    if not _active():
        return bool(local_flag)
    flag = torch.tensor([1 if local_flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _from_bytes_tensor(t: torch.Tensor) -> Any:
    return json.loads(t.numpy().tobytes().decode())


def _all_gather_json(obj: Any) -> list[Any]:
    """JSON-able objects of all ranks, on every rank, via byte tensors on the gloo group."""
    data = _to_bytes_tensor(obj)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=_object_group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(chunks, padded, group=_object_group)
    return [
        _from_bytes_tensor(chunk[: int(size.item())])
        for chunk, size in zip(chunks, sizes, strict=True)
    ]


def gather_objects(obj: Any) -> list[Any] | None:
    """Every rank's JSON-able `obj`, in rank order, on rank 0; None on the other ranks."""
    if not _active():
        return [obj]
    gathered = _all_gather_json(obj)
    return gathered if dist.get_rank() == 0 else None


def broadcast_object(obj: Any) -> Any:
    """Rank 0's JSON-able `obj` on every rank (the others' argument is ignored)."""
    if not _active():
        return obj
    is_source = dist.get_rank() == 0
    data = _to_bytes_tensor(obj) if is_source else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    dist.broadcast(size, src=0, group=_object_group)
    buffer = data if is_source else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=_object_group)
    return _from_bytes_tensor(buffer)


def barrier() -> None:
    if _active():
        dist.barrier(group=_object_group)
