"""A stand-in for `python -m trainer`: writes the run files, obeys the signals (docs/contract.md).

Stdlib only and fast, for the app's tests (launcher, stop safety, TUI Pilot tests):
    python tests/fake_trainer.py DATASET CONFIG FOLD [-device cpu] [--epochs N]
        [--epoch-time S] [-num_gpus N | --ranks N] [--c] [--nan-at E] [--fail-at E]
        [--handler-delay S] [--start-delay S] [--ignore-term] [--hang-at E [--hang-hard]]
        [--validation-time S]
Single process: it is the worker. `-num_gpus N` (alias `--ranks N`): a parent that starts N
child ranks, forwards SIGUSR1 to them and is not listed in the topology. Under torchrun
(TORCHELASTIC_RUN_ID set) each process is one rank. Rank 0 writes everything. SIGUSR1
sets a flag; at the next epoch boundary all ranks stop (one signalled rank is enough),
rank 0 writes stop_requested + stopped, all exit 0.
"""

from __future__ import annotations

import signal

_flag = {"stop": False}


def _on_usr1(signum: int, frame: object) -> None:
    _flag["stop"] = True


import argparse  # noqa: E402 - main() installs the handler before any slow work
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from trainer.schema.atomic import atomic_write_text  # noqa: E402
from trainer.schema.events import Kind, encode_event  # noqa: E402
from trainer.schema.status import State, Status, read_status  # noqa: E402
from trainer.schema.tree import EVENTS_FILE, find_dataset, resolve_roots, run_dir  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fake_trainer")
    parser.add_argument("dataset")
    parser.add_argument("configuration")
    parser.add_argument("fold")
    parser.add_argument("-device", default="cpu")
    parser.add_argument("-tr", default="nnuiTrainer")
    parser.add_argument("-p", default="nnuiPlans")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--iterations-per-epoch", type=int, default=250)
    parser.add_argument("--epoch-time", type=float, default=0.2)
    parser.add_argument("-num_gpus", "--ranks", dest="num_gpus", type=int, default=1)
    parser.add_argument("--c", action="store_true")
    parser.add_argument("--nan-at", type=int, default=None)
    parser.add_argument("--fail-at", type=int, default=None)
    parser.add_argument("--fail-code", type=int, default=3, help="exit code of --fail-at")
    parser.add_argument("--handler-delay", type=float, default=0.0)
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--hold-until", default=None, help="wait for this file before starting")
    parser.add_argument("--ignore-term", action="store_true", help="only SIGKILL ends it")
    parser.add_argument("--hang-at", type=int, default=None,
                        help="at this epoch: no event, no CPU, until SIGUSR1")  # fmt: skip
    parser.add_argument("--hang-hard", action="store_true",
                        help="--hang-at ignores SIGUSR1 too (only a kill ends it)")  # fmt: skip
    parser.add_argument("--validation-time", type=float, default=None,
                        help="a final validation (no event meanwhile) of this many s")  # fmt: skip
    parser.add_argument("--_rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_world", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_rank-dir", default=None, help=argparse.SUPPRESS)
    options, _unknown = parser.parse_known_args(argv)
    return options


class Recorder:
    def __init__(self, folder: Path, enabled: bool) -> None:
        self.folder = folder
        self.enabled = enabled
        self.status = Status(state=State.STARTING)
        if enabled:
            folder.mkdir(parents=True, exist_ok=True)
            self.handle = open(folder / EVENTS_FILE, "a")  # noqa: SIM115

    def event(self, kind: str, **fields: object) -> None:
        if self.enabled:
            self.handle.write(encode_event(kind, **fields))
            self.handle.flush()

    def state(self, state: str, **changes: object) -> None:
        if not self.enabled:
            return
        self.status.state = state
        for key, value in changes.items():
            setattr(self.status, key, value)
        self.status.updated_at = time.time()
        atomic_write_text(self.folder / "status.json", self.status.to_json())


def spawn_parent(options: argparse.Namespace, argv: list[str]) -> int:
    """The -num_gpus parent: starts the ranks, forwards SIGUSR1, never dies of it."""
    rank_dir = tempfile.mkdtemp(prefix="fake_ranks_")
    children = []
    for rank in range(options.num_gpus):
        child_argv = [a for a in argv]
        index = (
            child_argv.index("-num_gpus")
            if "-num_gpus" in child_argv
            else child_argv.index("--ranks")
        )
        del child_argv[index : index + 2]
        extra = ["--_rank", str(rank), "--_world", str(options.num_gpus), "--_rank-dir", rank_dir]
        children.append(subprocess.Popen([sys.executable, __file__, *child_argv, *extra]))

    def forward(signum: int, frame: object) -> None:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, forward)
    codes = [child.wait() for child in children]
    return 0 if all(c == 0 for c in codes) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options = parse(argv)
    if options.handler_delay:
        time.sleep(options.handler_delay)
    signal.signal(signal.SIGUSR1, _on_usr1)
    if options.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if options.num_gpus > 1 and options._rank is None and not torchrun:
        return spawn_parent(options, argv)
    if torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        rank_dir = Path(tempfile.gettempdir()) / f"fake_ranks_{os.environ['TORCHELASTIC_RUN_ID']}"
        launcher = "torchrun"
    elif options._rank is not None:
        rank, world, rank_dir = options._rank, options._world, Path(options._rank_dir)
        launcher = "spawn"
    else:
        rank, world, rank_dir, launcher = 0, 1, None, "single"
    roots = resolve_roots()
    dataset = find_dataset(roots.preprocessed, options.dataset)
    folder = run_dir(
        roots.results, dataset, options.configuration, options.fold, options.tr, options.p
    )
    recorder = Recorder(folder, enabled=rank == 0)
    start_epoch = 0
    if options.c:
        previous = read_status(folder)
        start_epoch = previous.epoch if previous else 0
    if options.start_delay:
        time.sleep(options.start_delay)
    while options.hold_until and not os.path.exists(options.hold_until):
        time.sleep(0.05)  # the test says when: no topology (no workers) until then
    host = socket.gethostname()
    me = {
        "global_rank": rank, "local_rank": rank, "host": host, "pid": os.getpid(),
        "device": options.device if options.device == "cpu" else f"cuda:{rank}",
        "batch_size": 2, "oversample_foreground_percent": 0.33, "sigusr1_handler": True,
    }  # fmt: skip
    ranks = [me]
    if rank_dir is not None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(rank_dir / f"rank_{rank}.json", json.dumps(me))
        deadline = time.time() + 120  # a hang guard: the other ranks are starting
        while (
            rank == 0 and len(list(rank_dir.glob("rank_*.json"))) < world and time.time() < deadline
        ):
            time.sleep(0.02)
        if rank == 0:
            ranks = sorted(
                (json.loads(p.read_text()) for p in rank_dir.glob("rank_*.json")),
                key=lambda r: r["global_rank"],
            )
    recorder.event(
        Kind.RUN_STARTED, dataset=dataset, configuration=options.configuration, fold=options.fold,
        num_epochs=options.epochs, iterations_per_epoch=options.iterations_per_epoch,
        world_size=world, launcher=launcher, host=host, argv=sys.argv,
    )  # fmt: skip
    recorder.event(Kind.TOPOLOGY, ranks=ranks)
    pids = [r["pid"] for r in ranks]
    recorder.state(State.RUNNING, epoch=start_epoch, num_epochs=options.epochs, pids=pids)
    stop_file = rank_dir / "stop" if rank_dir is not None else None
    ema = 0.0
    for epoch in range(start_epoch, options.epochs):
        if options.hang_at is not None and epoch == options.hang_at and not options.c:
            while options.hang_hard or not _flag["stop"]:
                time.sleep(0.1)  # a hung run: asleep, no event, no CPU
        if _flag["stop"] and stop_file is not None:
            stop_file.touch()
        if _flag["stop"] or (stop_file is not None and stop_file.exists()):
            recorder.event(Kind.STOP_REQUESTED, epoch=epoch, ranks=[rank])
            recorder.event(Kind.STOPPED, epoch=epoch, reason="SIGUSR1")
            recorder.state(State.STOPPED, epoch=epoch)
            return 0
        time.sleep(options.epoch_time)
        if options.fail_at is not None and epoch == options.fail_at:
            print(f"fake failure at epoch {epoch}", flush=True)
            recorder.event(Kind.FAILED, message="fake failure", traceback="")
            recorder.state(State.FAILED, epoch=epoch, message="fake failure")
            return options.fail_code
        loss = 1.0 / (1 + epoch)
        dice = 1 - loss
        ema = dice if epoch == 0 else 0.9 * ema + 0.1 * dice
        nan = options.nan_at is not None and epoch >= options.nan_at
        recorder.event(
            Kind.EPOCH_ENDED, epoch=epoch, train_loss=float("nan") if nan else loss,
            val_loss=loss * 1.1, dice_per_class=[dice], mean_fg_dice=dice, ema_fg_dice=ema,
            lr=0.01 * (1 - epoch / options.epochs) ** 0.9, epoch_time_s=options.epoch_time,
            iterations_per_s=options.iterations_per_epoch / options.epoch_time,
        )  # fmt: skip
        recorder.state(State.RUNNING, epoch=epoch + 1)
        if rank == 0:
            print(f"epoch {epoch} loss {loss:.4f}", flush=True)
    if options.validation_time is not None:
        validate(recorder, options)
    recorder.event(Kind.FINISHED)
    recorder.state(State.FINISHED, epoch=options.epochs)
    return 0


def validate(recorder: Recorder, options: argparse.Namespace) -> None:
    """A final validation that takes a while without writing events (as the real one)."""
    recorder.event(Kind.VALIDATION_STARTED, epoch=options.epochs - 1, num_cases=2)
    time.sleep(options.validation_time)
    dice = 1 - 1.0 / options.epochs
    recorder.event(Kind.VALIDATION_FINISHED, mean_fg_dice=dice, dice_per_class=[dice], num_cases=2)


if __name__ == "__main__":
    sys.exit(main())


# ---- helpers for tests that launch the fake trainer (imported as `fake_trainer`) ----------

FAKE_TRAINER = Path(__file__).resolve()
DEMO_DATASET = "Dataset004_Demo"


def make_preprocessed(root: Path, name: str = DEMO_DATASET, batch_size: int = 2) -> Path:
    """A preprocessed dataset folder with just the plans the app reads."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    plans = {
        "plans_name": "nnuiPlans",
        "configurations": {
            "3d_fullres": {"patch_size": [32, 64, 64], "batch_size": batch_size},
            "2d": {"patch_size": [64, 64], "batch_size": 12},
        },
    }
    (folder / "nnuiPlans.json").write_text(json.dumps(plans))
    return folder


def fake_env(tmp: Path) -> dict[str, str]:
    """Environment for nnui + the fake trainer: private state dir and roots under `tmp`."""
    make_preprocessed(tmp / "preprocessed")
    return {
        "NNUI_STATE_DIR": str(tmp / "state"),
        "nnUNet_raw": str(tmp / "raw"),
        "nnUNet_preprocessed": str(tmp / "preprocessed"),
        "nnUNet_results": str(tmp / "results"),
        "NNUI_TRAINER_SCRIPT": str(FAKE_TRAINER),
    }


MIN_SAFETY_NET_S = 60.0


def wait_until(predicate, timeout_s: float = 120.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds; `timeout_s` is only a hang guard (generous: the
    suite runs on busy machines), never a statement about speed, so a shorter one is
    raised to MIN_SAFETY_NET_S."""
    deadline = time.monotonic() + max(timeout_s, MIN_SAFETY_NET_S)
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def cleanup_jobs(state_dir: Path) -> None:
    """SIGKILL every live process of every job in this (test) registry, by verified pid."""
    import psutil

    from app.services.jobs.liveness import record_alive
    from app.services.jobs.registry import Registry

    registry = Registry(Path(state_dir))
    for job in registry.list():
        pids: list[int] = []
        for record in job.processes:
            if record_alive(record):
                pids.append(record.pid)
                with contextlib.suppress(psutil.Error):
                    pids += [c.pid for c in psutil.Process(record.pid).children(recursive=True)]
        for pid in dict.fromkeys(pids):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
