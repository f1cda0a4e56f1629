"""The process group and its collectives (docs/multi-gpu.md): the one module that calls
torch.distributed. Launch modes and topology live in trainer.training.launch.

Object collectives exchange JSON over byte tensors (never pickle) on a gloo group, so they
work the same with nccl. Two gloo groups: one with the default (fail-fast) timeout for the
start-up and epoch exchanges, one with a long timeout for final validation, where ranks
wait for each other's whole-case predictions. Every collective is a no-op in one process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INIT_TIMEOUT = timedelta(minutes=10)
# Final validation: a rank may predict a large case for a long time while the others
# already wait to hand over theirs.
SLOW_TIMEOUT = timedelta(hours=2)

# gloo groups for object/tensor exchanges: fast (None = the default group, when it is gloo)
# and slow (long timeout). Set by init_group, cleared by destroy_group.
_object_group: Any = None
_slow_group: Any = None


def host_store(port: int) -> dist.TCPStore:
    """The rendezvous store, hosted by the spawn parent.

    Port 0 lets the store pick a free port itself, so no other process can take it between
    a probe and the bind (the failure seen with bind-to-0-then-close).
    """
    return dist.TCPStore(
        "localhost", port, world_size=None, is_master=True, timeout=INIT_TIMEOUT,
        wait_for_workers=False,
    )  # fmt: skip


def client_store(port: int) -> dist.TCPStore:
    return dist.TCPStore("localhost", port, is_master=False, timeout=INIT_TIMEOUT)


class NoRendezvous(RuntimeError):
    """The first contact of an env rendezvous (MASTER_ADDR:MASTER_PORT) did not happen in
    time: nobody listens there, or nobody joined rank 0."""


# Set by every rank > 0 once connected: any one of them proves the job is live.
_PEER_KEY = "nnui/peer_joined"
_POLL_S = 0.05


def _master_address() -> tuple[str, int]:
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not (addr and port):
        raise ValueError(
            "MASTER_ADDR and MASTER_PORT must be set when started by srun/mpirun without "
            "torchrun (e.g. export MASTER_ADDR=$(scontrol show hostnames "
            "$SLURM_JOB_NODELIST | head -n1) MASTER_PORT=29500)"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return addr, int(port)


def _within(condition: Callable[[], bool], timeout_s: float) -> bool:
    # Polled in Python: c10d's own connect timeouts retry past their deadline and print
    # a C++ stack per try; this way a failed first contact is one line, in time.
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _listens(addr: str, port: int) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def env_store(rank: int, world: int, start_timeout_s: float | None) -> dist.TCPStore:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT (what init_method env:// builds),
    hosted by rank 0, with a separate timeout for the first contact (None: INIT_TIMEOUT):
    rank 0 waits that long for any other rank, the others that long for rank 0 to listen.
    Later waits (all ranks joining, collectives) keep INIT_TIMEOUT. Raises NoRendezvous
    or ValueError."""
    addr, port = _master_address()
    if start_timeout_s is None:
        start_timeout_s = INIT_TIMEOUT.total_seconds()
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    if rank == 0:
        try:
            store = dist.TCPStore(
                addr, port, world_size=world, is_master=True, timeout=INIT_TIMEOUT,
                wait_for_workers=False,
            )  # fmt: skip
        except RuntimeError as error:  # DistNetworkError: the port is taken, or not ours
            raise NoRendezvous(f"rank 0 cannot listen at {where}: {error}") from error
        if world > 1 and not _within(lambda: store.check([_PEER_KEY]), start_timeout_s):
            raise NoRendezvous(
                f"rank 0 of {world} listened at {where} for {start_timeout_s:.0f} s and no "
                "other rank joined"
            )
        return store
    if not _within(lambda: _listens(addr, port), start_timeout_s):
        raise NoRendezvous(
            f"rank {rank} of {world} found nobody listening at {where} (rank 0 hosts it) "
            f"within {start_timeout_s:.0f} s"
        )
    store = dist.TCPStore(addr, port, world_size=world, is_master=False, timeout=INIT_TIMEOUT)
    store.set(_PEER_KEY, str(rank))
    return store


def init_group(
    device_type: str, rank: int | None, world: int | None, local_rank: int | None, store: Any
) -> tuple[int, int]:
    """Join the group; returns (global rank, world size).

    With `store` (spawn ranks, env_store) rank and world must be known; without it torch's
    env:// rendezvous reads the launcher's variables (torchrun). nccl gets device_id
    whenever the local rank is known up front, so a wrong device fails here instead of
    hanging in the first collective.
    """
    global _object_group, _slow_group
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": INIT_TIMEOUT}
    if store is not None:
        kwargs.update(store=store, rank=rank, world_size=world)
    else:
        _master_address()
        kwargs["init_method"] = "env://"
        if rank is not None and world is not None:
            kwargs.update(rank=rank, world_size=world)
    if backend == "nccl" and local_rank is not None:
        use_cuda_device(local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)
    _object_group = dist.new_group(backend="gloo") if backend != "gloo" else None
    _slow_group = dist.new_group(backend="gloo", timeout=SLOW_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def use_cuda_device(local_rank: int) -> None:
    torch.cuda.set_device(local_rank)


def all_hostnames() -> list[str]:
    """Every rank's host name, indexed by global rank (the local-rank fallback)."""
    return _all_gather_json(socket.gethostname())


def destroy_group() -> None:
    global _object_group, _slow_group
    _object_group = _slow_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ---- collectives (all no-ops for one process) --------------------------------------------


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group(slow: bool) -> Any:
    return _slow_group if slow else _object_group


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


def _all_gather_json(obj: Any, slow: bool = False) -> list[Any]:
    """JSON-able objects of all ranks, on every rank, via byte tensors on a gloo group."""
    group = _group(slow)
    data = _to_bytes_tensor(obj)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(chunks, padded, group=group)
    return [
        _from_bytes_tensor(chunk[: int(size.item())])
        for chunk, size in zip(chunks, sizes, strict=True)
    ]


def gather_objects(obj: Any, slow: bool = False) -> list[Any] | None:
    """Every rank's JSON-able `obj`, in rank order, on rank 0; None on the other ranks."""
    if not _active():
        return [obj]
    gathered = _all_gather_json(obj, slow)
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


def broadcast_tensors(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's named CPU tensors on every rank (a checkpoint the other nodes lack)."""
    if not _active():
        assert tensors is not None
        return tensors
    is_source = dist.get_rank() == 0
    specs = broadcast_object(
        [[k, str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()]
        if is_source and tensors is not None
        else None
    )
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in specs:
        if is_source:
            assert tensors is not None
            t = tensors[name].contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
        dist.broadcast(t, src=0, group=_object_group)
        out[name] = t
    return out


_MAX_NDIM = 7


def send_to_main(t: torch.Tensor) -> None:
    """Send a CPU tensor to rank 0, which calls recv_from(this rank) in the same order."""
    t = t.detach().cpu().contiguous()
    assert t.ndim <= _MAX_NDIM, t.shape
    header = torch.zeros(1 + _MAX_NDIM, dtype=torch.int64)
    header[0] = t.ndim
    header[1 : 1 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst=0, group=_slow_group)
    dist.send(t, dst=0, group=_slow_group)


def recv_from(src: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank 0: the next tensor rank `src` sent with send_to_main (same dtype)."""
    header = torch.zeros(1 + _MAX_NDIM, dtype=torch.int64)
    dist.recv(header, src=src, group=_slow_group)
    ndim = int(header[0])
    t = torch.empty([int(n) for n in header[1 : 1 + ndim]], dtype=dtype)
    dist.recv(t, src=src, group=_slow_group)
    return t


def barrier(slow: bool = False) -> None:
    if _active():
        dist.barrier(group=_group(slow))
