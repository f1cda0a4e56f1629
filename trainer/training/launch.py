"""How this process was started and where it sits (docs/multi-gpu.md): launcher detection,
topology from the environment, and the `-num_gpus` spawn parent (the global batch split
is trainer.training.batch's).

Three ways to run, one code path for the worker function:

- single: no launcher and `-num_gpus` None/1 -> `worker_fn` runs in this process, no group;
- spawn: `-num_gpus N` -> this process becomes a parent that starts N ranks (start method
  spawn), forwards SIGUSR1 to them and waits; it is never a worker itself;
- torchrun / external: a launcher started us -> join its group from the environment.
  srun or mpirun without torchrun work too, but then MASTER_ADDR and MASTER_PORT must be
  exported by the user or the job script (SLURM/MPI define ranks, not a rendezvous).

The process group itself and the collectives live in trainer.training.distributed.
"""

from __future__ import annotations

import contextlib
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
from typing import Any

from trainer import stop
from trainer.schema.exits import EXIT_FAILED, EXIT_OK, exit_for_signal

log = logging.getLogger(__name__)

LAUNCHERS = ("single", "spawn", "torchrun", "external")
# What a launcher exports and a finished job can leave behind in a shell (named in errors).
RENDEZVOUS_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
)  # fmt: skip
# First contact of an external rendezvous (distributed.env_store) where the environment
# may be left over from a finished job (start_timeout_s): seconds, not 10 minutes.
LEFTOVER_START_TIMEOUT_S = 10.0
# After one rank failed the parent SIGTERMs the others (they record `failed`) and SIGKILLs
# what is left after this grace; after it forwarded SIGTERM/SIGINT it waits the shorter one.
FAILED_RANK_GRACE_S = 30.0
TERMINATE_GRACE_S = 10.0


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


def single_topology() -> Topology:
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


def env_rank_and_size(env: Mapping[str, str] = os.environ) -> tuple[int | None, int | None]:
    """(global rank, world size) a launcher defined, or (None, None)."""
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


def env_local(env: Mapping[str, str] = os.environ) -> tuple[int | None, int | None]:
    """(local rank, local world size) as far as the environment tells; None where unknown."""
    local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _env_int(
        env, "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"
    )
    return local_rank, local_size


def is_main_process(env: Mapping[str, str] = os.environ) -> bool:
    """False only for a launcher-started process whose global rank is known and not 0."""
    if detect_external_launcher(env) is None:
        return True
    rank, _ = env_rank_and_size(env)
    return rank is None or rank == 0


def local_from_hosts(hosts: list[str], global_rank: int) -> tuple[int, int]:
    """(local rank, local world size) from every rank's host name, indexed by global rank."""
    mine = hosts[global_rank]
    same = [rank for rank, host in enumerate(hosts) if host == mine]
    return same.index(global_rank), len(same)


def fill_local(
    known: tuple[int | None, int | None], hosts: list[str], global_rank: int
) -> tuple[int, int]:
    """The environment's local rank/size where known; the hostname answer only for the gaps."""
    from_hosts = local_from_hosts(hosts, global_rank)
    return (
        known[0] if known[0] is not None else from_hosts[0],
        known[1] if known[1] is not None else from_hosts[1],
    )


# ---- devices and threads -----------------------------------------------------------------


def device_for(topology: Topology, device_type: str) -> Any:
    import torch

    if device_type == "cuda":
        return torch.device("cuda", topology.local_rank)
    return torch.device(device_type)  # cpu or mps (TrainConfig validated the name)


def set_cpu_threads(local_world_size: int) -> None:
    """Ranks sharing a node share its cores: oversubscription is several times slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return  # torchrun (1) or the user decided
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(1, local_world_size)))


# ---- entry point ---------------------------------------------------------------------------


def check_num_gpus(num_gpus: int | None, launcher: str | None) -> None:
    """Under a launcher any -num_gpus is refused: the launcher decides the number of ranks."""
    if launcher is not None and num_gpus is not None:
        raise ValueError(
            f"-num_gpus {num_gpus} cannot be used under {launcher}: the launcher decides the "
            "number of processes (e.g. torchrun --nproc_per_node); drop -num_gpus"
        )


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
    check_num_gpus(num_gpus, launcher)
    if launcher is not None:
        return _run_rank(worker_fn, payload, device_type, launcher, store=None)
    if num_gpus is None or num_gpus == 1:
        set_cpu_threads(1)
        return int(worker_fn(single_topology(), payload))
    if device_type == "cuda":
        import torch

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
    from trainer.training import distributed

    rank, world = env_rank_and_size()
    local = env_local()
    try:
        if store is None and launcher == "external" and rank is not None and world is not None:
            store = _external_store(distributed, rank, world)
        rank, world = distributed.init_group(device_type, rank, world, local[0], store)
        local_rank, local_world = local
        if local_rank is None or local_world is None:
            local_rank, local_world = fill_local(local, distributed.all_hostnames(), rank)
            if device_type == "cuda" and local[0] is None:
                distributed.use_cuda_device(local_rank)
        topology = Topology(rank, world, local_rank, local_world, socket.gethostname(), launcher)
        set_cpu_threads(topology.local_world_size)
        return int(worker_fn(topology, payload))
    finally:
        distributed.destroy_group()


def start_timeout_s(env: Mapping[str, str] = os.environ) -> float | None:
    """How long the first contact of an external rendezvous may take (None: as long as
    any later wait, distributed.INIT_TIMEOUT).

    RANK/WORLD_SIZE/LOCAL_RANK with no srun step or mpirun around us is also what a shell
    left over from a finished job looks like: then seconds. A live step's ranks may start
    minutes apart (cold imports on a shared file system): then the normal timeout.
    """
    live_step = (
        env.get("SLURM_STEP_ID") is not None
        or (_env_int(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE") or 1) > 1
    )
    return None if live_step else LEFTOVER_START_TIMEOUT_S


def leftover_variables(env: Mapping[str, str] = os.environ) -> list[str]:
    """The launcher variables that are set here, in the order to name them."""
    return [name for name in RENDEZVOUS_VARIABLES if env.get(name) is not None]


def _external_store(distributed: Any, rank: int, world: int) -> Any:
    try:
        return distributed.env_store(rank, world, start_timeout_s())
    except distributed.NoRendezvous as error:
        names = leftover_variables()
        raise ValueError(
            f"{error}: {', '.join(names)} look left over from a finished job; unset them "
            f"(unset {' '.join(names)}) or start the other ranks"
        ) from None


# ---- spawn mode ------------------------------------------------------------------------------


def _spawn_parent(
    worker_fn: Callable[[Topology, Any], int], payload: Any, num_procs: int, device_type: str
) -> int:
    import torch.multiprocessing as mp

    from trainer.training import distributed

    requested_port = _env_int(os.environ, "MASTER_PORT") or 0
    try:
        store = distributed.host_store(requested_port)
    except (RuntimeError, OSError) as error:
        raise ValueError(f"cannot listen on MASTER_PORT={requested_port}: {error}") from error
    port = store.port
    # Children inherit the blocked mask across exec: a SIGUSR1 that arrives while they start
    # stays pending until their entry installed its flag handler, instead of killing them.
    # Ours stays pending too and is forwarded as soon as the rank pids are known.
    stop.hold()
    previous = {
        sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
    }
    received: list[int] = []
    procs: list[Any] = []

    def forward(signum: int, _frame: Any) -> None:
        _signal_alive(procs, signum)
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
        stop.release()
        log.info("spawned %d ranks: pids %s", num_procs, [p.pid for p in procs])
        return _wait_ranks(procs, received)
    finally:
        stop.release()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store


def _signal_alive(procs: list[Any], signum: int) -> None:
    for proc in procs:
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)


def _wait_ranks(
    procs: list[Any], received: list[int], failed_grace_s: float = FAILED_RANK_GRACE_S
) -> int:
    """Wait for every rank; 0 iff all returned 0. SIGTERM/SIGINT: forwarded, exit 128+n.

    When a rank fails, the survivors get SIGTERM at once (they record `failed` and exit)
    and SIGKILL only if they are still there after the grace period.
    """
    deadline: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if (failed or received) and deadline is None:
            if failed and not received:
                log.warning("a rank failed: sending SIGTERM to ranks %s", [p.pid for p in alive])
                _signal_alive(procs, signal.SIGTERM)
            deadline = time.monotonic() + (TERMINATE_GRACE_S if received else failed_grace_s)
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
        return exit_for_signal(received[0])
    return EXIT_OK if all(p.exitcode == 0 for p in procs) else EXIT_FAILED


def _spawn_entry(
    local_rank: int,
    worker_fn: Callable[[Topology, Any], int],
    payload: Any,
    world_size: int,
    device_type: str,
    port: int,
) -> None:
    # The parent held SIGUSR1 blocked when it started us (the mask survives fork and exec):
    # one sent since is pending and reaches the flag handler now, before torch is imported.
    stop.install_at_start()
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
        from trainer.training import distributed

        store = distributed.client_store(port)
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
