"""Watch-only nnU-Net runs: `nnUNetv2_train` processes nnui did not start, and their logs.

A colleague's run, or one started by hand, shows in nnui with owner, GPU, epoch, losses,
pseudo Dice, epoch time and ETA, parsed from nnU-Net's text log (log.py). nnui never
signals these processes: a stop is refused with the reason (`stop_refusal`).

How a process is matched to its fold folder, and the limits of that:
- Processes: every live process whose argv runs nnU-Net's training entry (`nnUNetv2_train
  D C F ...`, `python -m nnunetv2.run.run_training ...` or `.../nnunetv2/run/run_training.py`)
  right after the interpreter. Forked data-augmentation workers carry their parent's argv:
  a process whose parent has the same argv is a worker, listed in `pids`, not a run.
- Skipped: processes whose environment carries NNUI_JOB_ID (nnui's own jobs, which the job
  table shows from events.jsonl) and fold folders of nnui jobs still running (exclude_dirs).
- The fold folder comes from the argv exactly as nnU-Net builds it: `<results>/<DatasetXXX_
  Name>/<tr>__<p>__<c>/fold_<f>` (a `<Name>_nnui` extension trainer trains in `<Name>`'s
  folder). The results root: when the process's environment is readable (our own uid)
  its `nnUNet_results` (relative to its cwd) must be one of the roots watched; another
  user's environment is not readable, so every watched root is tried.
- The run's log: the newest `training_log_*.txt` of that folder, written since the process
  started (mtime >= process start). nnU-Net creates it seconds after the start, so a run
  shows once its trainer is initialised. Two live processes training the same fold folder
  (a mistake nnU-Net does not prevent): the newer start gets the folder.
- Limits: a colleague's run writing to a results root other than the ones watched is not
  seen; nor processes hidden by `hidepid` or in another pid namespace (a container); an
  ambiguous dataset id (two `Dataset900_*` folders) gives one row per folder being written.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Protocol, cast

from app.services.machine.gpus import MachineSnapshot, parse_visible_devices
from app.services.machine.procs import (
    ProcRow,
    descendants,
    process_table,
    read_sigcgt_mask,
    user_name,
)
from app.services.nnunet.log import (
    STARTING_PHASE,
    DebugCache,
    EpochStats,
    TrainingLog,
    eta_s,
    median_epoch_s,
    merge_history,
    read_schedule,
    sorted_logs,
)
from trainer.schema.nnunet import (
    NNUI_NNUNET_TRAINER,
    NNUNET_EXT_DIR,
    NNUNET_EXT_ENV,
    NNUNET_WRAP_SUFFIX,
    nnunet_classes,
)
from trainer.schema.tree import JOB_ID_ENV

RUN_ID_PREFIX = "nnunet:"  # a watch-only run's id: "nnunet:<pid of its nnUNetv2_train>"
START_TOLERANCE_S = 2.0  # process start (boot clock) vs file mtime (wall clock)
RESULTS_ENV = "nnUNet_results"
STOCK_TRAINER = "nnUNetTrainer"
STOCK_PLANS = "nnUNetPlans"
_ENTRY_SCRIPTS = ("nnUNetv2_train", "run_training.py")
_ENTRY_MODULE = "nnunetv2.run.run_training"
_VALUE_OPTIONS = {"-tr", "-p", "-pretrained_weights", "-num_gpus", "-device"}


class RefusedRun(Protocol):
    """An adopted run (jobs.discovery.AdoptedRun, a layer above) as stop_refusal reads it."""

    def refusal_line(self, action: str = "stop") -> str: ...


@dataclass(frozen=True)
class TrainArgs:
    """The arguments of a training command line found running, as given: nnUNetv2_train's
    (nnunetv2/run/run_training.py; parse_train_argv here) or nnui-train's (an adopted run;
    trainer/training/train_args.py, parsed by jobs.discovery.parse_args)."""

    dataset: str  # id or DatasetXXX_Name, as typed
    configuration: str
    fold: str
    trainer: str = STOCK_TRAINER
    plans: str = STOCK_PLANS
    num_gpus: int = 1
    device: str = "cuda"
    npz: bool = False
    continue_training: bool = False
    results: str | None = None  # nnui-train's --results
    rest: tuple[str, ...] = ()  # nnui-train: everything after the three positionals, as given


def _entry_index(cmdline: Sequence[str]) -> int | None:
    """Index of the last argv element before nnU-Net's own arguments, or None."""
    if not cmdline:
        return None
    if os.path.basename(cmdline[0]) == "nnUNetv2_train":
        return 0
    if not os.path.basename(cmdline[0]).startswith("python"):
        return None  # srun, bash -c, timeout ...: their child is the training process
    for index in range(1, len(cmdline)):
        arg = cmdline[index]
        if arg == "-m" and index + 1 < len(cmdline):
            return index + 1 if cmdline[index + 1] == _ENTRY_MODULE else None
        if arg.startswith("-"):
            continue  # an interpreter option (-u, -X ...)
        name = os.path.basename(arg)
        if name == "nnUNetv2_train" or (name == "run_training.py" and "nnunetv2" in arg):
            return index
        return None
    return None


def is_train_cmdline(cmdline: Sequence[str]) -> bool:
    return _entry_index(cmdline) is not None


def parse_train_argv(cmdline: Sequence[str]) -> TrainArgs | None:
    """The training arguments of an nnUNetv2_train argv, or None when it is not one."""
    index = _entry_index(cmdline)
    if index is None:
        return None
    positional: list[str] = []
    values: dict[str, str] = {}
    flags: set[str] = set()
    rest = list(cmdline[index + 1 :])
    while rest:
        arg = rest.pop(0)
        name, eq, inline = arg.partition("=")
        if name in _VALUE_OPTIONS:
            if not eq and not rest:
                return None
            values[name] = inline if eq else rest.pop(0)
        elif arg.startswith("--"):
            flags.add(arg)
        else:
            positional.append(arg)
    if len(positional) < 3:
        return None
    try:
        num_gpus = int(values.get("-num_gpus", "1"))
    except ValueError:
        return None
    return TrainArgs(
        dataset=positional[0], configuration=positional[1], fold=positional[2],
        trainer=values.get("-tr", STOCK_TRAINER), plans=values.get("-p", STOCK_PLANS),
        num_gpus=num_gpus, device=values.get("-device", "cuda"), npz="--npz" in flags,
        continue_training="--c" in flags,
    )  # fmt: skip


@dataclass(frozen=True)
class TrainProcess:
    row: ProcRow
    args: TrainArgs
    pids: tuple[int, ...]  # the process and its descendants (augmentation workers, ranks)


def train_processes(rows: Sequence[ProcRow]) -> list[TrainProcess]:
    """The nnUNetv2_train processes of the table (workers folded into their parent's run)."""
    by_pid = {row.pid: row for row in rows}
    found = []
    for row in rows:
        args = parse_train_argv(row.cmdline)
        if args is None:
            continue
        parent = by_pid.get(row.ppid)
        if parent is not None and parent.pid != row.pid and parent.cmdline == row.cmdline:
            continue  # a forked worker of that run
        pids = (row.pid, *descendants(list(rows), row.pid))
        found.append(TrainProcess(row, args, pids))
    return found


def _dataset_dirs(root: Path, dataset: str) -> list[Path]:
    if dataset.isdigit():
        try:
            return sorted(p for p in root.glob(f"Dataset{int(dataset):03d}_*") if p.is_dir())
        except OSError:
            return []
    return [root / dataset] if dataset.startswith("Dataset") else []


def fold_dirs(args: TrainArgs, root: Path) -> list[Path]:
    """Where nnU-Net trains these arguments under `root` (existing folders only)."""
    trainers = [args.trainer]
    if args.trainer.endswith(NNUNET_WRAP_SUFFIX):  # nnui's wrap trains in its base's folder
        trainers.append(args.trainer.removesuffix(NNUNET_WRAP_SUFFIX))
    found = []
    for dataset_dir in _dataset_dirs(root, args.dataset):
        for trainer in trainers:
            folder = dataset_dir / f"{trainer}__{args.plans}__{args.configuration}"
            fold = folder / f"fold_{args.fold}"
            if fold.is_dir():
                found.append(fold)
    return found


@lru_cache(maxsize=256)  # the watched roots, asked for every process every 2 s
def _real_root(root: str) -> str:
    return os.path.realpath(root)


def candidate_roots(row: ProcRow, roots: Sequence[Path]) -> list[Path]:
    """The watched roots this process can be writing to (see the module docstring)."""
    if row.environ is None:
        return list(roots)
    value = row.environ.get(RESULTS_ENV)
    if not value:
        return []  # nnU-Net cannot train without it
    path = Path(value).expanduser()
    if not path.is_absolute() and row.cwd:
        path = Path(row.cwd) / path
    target = os.path.realpath(path)
    return [r for r in roots if _real_root(str(r)) == target]


def live_log(fold_dir: Path, start_time: float | None) -> Path | None:
    """The fold folder's newest training log if it was written since the process started."""
    logs = sorted_logs(fold_dir)
    if not logs or start_time is None:
        return None
    try:
        mtime = logs[-1].stat().st_mtime
    except OSError:
        return None
    return logs[-1] if mtime >= start_time - START_TOLERANCE_S else None


@dataclass(frozen=True)
class WatchOnlyRun:
    """A live nnU-Net training nnui did not start: what the jobs table shows (read-only)."""

    run_id: str  # RUN_ID_PREFIX + pid
    pid: int  # the nnUNetv2_train process
    pids: tuple[int, ...]  # it and its descendants (augmentation workers, -num_gpus ranks)
    uid: int
    owner: str
    start_time: float | None  # wall clock
    start_ticks: int | None  # the process identity (procs.py)
    cmdline: tuple[str, ...]
    environ_readable: bool  # False for another user's process (matched by argv + mtime)
    args: TrainArgs
    dataset: str  # the DatasetXXX_Name folder
    gpus: tuple[str, ...]  # () when unknown or on CPU
    gpu_source: str | None  # "nvml" | "CUDA_VISIBLE_DEVICES" | None
    fold_dir: str
    log_path: str
    log_mtime: float
    phase: str  # starting | training | validating | done (TrainingLog.phase)
    epoch: int | None  # epochs completed (last finished epoch + 1; 0 during the first)
    current_epoch: int | None  # the epoch being trained (0-based), None before the first
    num_epochs: int
    num_epochs_source: str  # "debug.json" | "trainer name" | "default"
    iterations_per_epoch: int | None
    train_loss: float | None
    val_loss: float | None
    dice_per_class: tuple[float, ...]
    mean_fg_dice: float | None
    ema_fg_dice: float | None
    lr: float | None
    epoch_time_s: float | None
    median_epoch_time_s: float | None
    eta_s: float | None
    final_dice: float | None
    sigusr1_handler: bool | None  # SigCgt of the nnUNetv2_train process (None: unreadable)
    history: tuple[EpochStats, ...]
    watch_only: bool = True
    class_names: tuple[str, ...] = ()  # of dice_per_class: the run folder's dataset.json

    @property
    def configuration(self) -> str:
        return self.args.configuration

    @property
    def fold(self) -> str:
        return self.args.fold

    @property
    def trainer(self) -> str:
        return self.args.trainer

    @property
    def plans(self) -> str:
        return self.args.plans


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _gpus(
    process: TrainProcess, snapshot: MachineSnapshot | None
) -> tuple[tuple[str, ...], str | None]:
    if process.args.device != "cuda":
        return (), None
    if snapshot is not None and not snapshot.simulated:
        pids = set(process.pids)
        used = [str(g.index) for g in snapshot.gpus if any(p.pid in pids for p in g.processes)]
        if used:
            return tuple(used), "nvml"
    environ = process.row.environ
    if environ is not None and "CUDA_VISIBLE_DEVICES" in environ:
        visible = parse_visible_devices(environ["CUDA_VISIBLE_DEVICES"]) or []
        return tuple(visible[: max(1, process.args.num_gpus)]), "CUDA_VISIBLE_DEVICES"
    return (), None


class NnunetRunWatcher:
    """Keeps one incremental reader per training log across refreshes (appended bytes only)."""

    def __init__(self) -> None:
        self._logs: dict[Path, TrainingLog] = {}
        self._debug: dict[Path, DebugCache] = {}

    def refresh(
        self,
        results_roots: Iterable[Path],
        procs: Sequence[ProcRow] | None = None,
        snapshot: MachineSnapshot | None = None,
        exclude_dirs: Iterable[str | Path] = (),
    ) -> list[WatchOnlyRun]:
        """The watch-only runs now. `procs`: a process table (default: read /proc)."""
        roots = [Path(r) for r in results_roots]
        if procs is None:
            rows = process_table(detail=is_train_cmdline, roots=is_train_cmdline)
        else:
            rows = list(procs)
        excluded = {os.path.realpath(d) for d in exclude_dirs}
        claims: dict[str, tuple[TrainProcess, Path, Path]] = {}
        for process in train_processes(rows):
            environ = process.row.environ
            if environ is not None and environ.get(JOB_ID_ENV):
                continue  # nnui's own job: the job table shows it from its events
            for root in candidate_roots(process.row, roots):
                for fold_dir in fold_dirs(process.args, root):
                    key = os.path.realpath(fold_dir)
                    log = live_log(fold_dir, process.row.start_time)
                    if log is None or key in excluded:
                        continue
                    held = claims.get(key)
                    if held is None or (held[0].row.start_ticks or 0) < (
                        process.row.start_ticks or 0
                    ):
                        claims[key] = (process, fold_dir, log)
        runs = [self._run(p, fold_dir, log, snapshot) for p, fold_dir, log in claims.values()]
        self._forget({Path(os.path.realpath(r.fold_dir)) for r in runs})
        return sorted(runs, key=lambda r: (r.dataset, r.configuration, r.fold, r.pid))

    def _forget(self, live_dirs: set[Path]) -> None:
        for path in [p for p in self._logs if Path(os.path.realpath(p.parent)) not in live_dirs]:
            del self._logs[path]
        for path in [p for p in self._debug if Path(os.path.realpath(p)) not in live_dirs]:
            del self._debug[path]

    def _parsed_logs(self, fold_dir: Path, newest: Path) -> list[TrainingLog]:
        """Every log of the folder up to the live one, oldest first (earlier starts are the
        history a `--c` continues; each is read once, then only the live one grows)."""
        logs = []
        for path in sorted_logs(fold_dir):
            log = self._logs.get(path)
            if log is None:
                log = self._logs[path] = TrainingLog(path)
            log.poll()
            logs.append(log)
            if path == newest:
                break
        return logs

    def _run(
        self,
        process: TrainProcess,
        fold_dir: Path,
        log_path: Path,
        snapshot: MachineSnapshot | None,
    ) -> WatchOnlyRun:
        logs = self._parsed_logs(fold_dir, log_path)
        stats = merge_history(logs)
        cache = self._debug.setdefault(fold_dir, DebugCache())
        schedule = read_schedule(fold_dir, log_path, process.args.trainer, cache)
        last = stats[-1] if stats else None
        started = logs[-1].epochs if logs else {}
        current = max(started) if started else None
        gpus, gpu_source = _gpus(process, snapshot)
        row = process.row
        try:
            mtime = log_path.stat().st_mtime
        except OSError:
            mtime = math.nan
        return WatchOnlyRun(
            run_id=f"{RUN_ID_PREFIX}{row.pid}", pid=row.pid, pids=process.pids, uid=row.uid,
            owner=user_name(row.uid), start_time=row.start_time, start_ticks=row.start_ticks,
            cmdline=row.cmdline, environ_readable=row.environ is not None, args=process.args,
            dataset=fold_dir.parent.parent.name, gpus=gpus, gpu_source=gpu_source,
            fold_dir=str(fold_dir), log_path=str(log_path), log_mtime=mtime,
            phase=logs[-1].phase if logs else STARTING_PHASE,
            epoch=last.epoch + 1 if last else (None if current is None else 0),
            current_epoch=current, num_epochs=schedule.num_epochs,
            num_epochs_source=schedule.source, iterations_per_epoch=schedule.iterations_per_epoch,
            train_loss=_finite(last.train_loss) if last else None,
            val_loss=_finite(last.val_loss) if last else None,
            dice_per_class=last.dice_per_class if last else (),
            mean_fg_dice=_finite(last.mean_fg_dice) if last else None,
            ema_fg_dice=_finite(last.ema_fg_dice) if last else None,
            lr=_finite(last.lr) if last else None,
            epoch_time_s=_finite(last.epoch_time_s) if last else None,
            median_epoch_time_s=median_epoch_s(stats), eta_s=eta_s(stats, schedule.num_epochs),
            final_dice=logs[-1].final_dice if logs else None, sigusr1_handler=row.sigcgt_usr1,
            history=tuple(stats), class_names=_class_names(fold_dir),
        )  # fmt: skip


def _class_names(fold_dir: Path) -> tuple[str, ...]:
    """Names of nnU-Net's per-class pseudo Dice, from the dataset.json nnU-Net copies beside
    its folds (regions by their names, in its order); () when unreadable."""
    try:
        labels = json.loads((fold_dir.parent / "dataset.json").read_text())["labels"]
    except (OSError, ValueError, KeyError, TypeError):
        return ()
    return tuple(name for name, _ in nnunet_classes(labels)) if isinstance(labels, dict) else ()


def watch_only_runs(
    roots: Iterable[Path],
    procs: Sequence[ProcRow] | None = None,
    snapshot: MachineSnapshot | None = None,
    exclude_dirs: Iterable[str | Path] = (),
) -> list[WatchOnlyRun]:
    """One look at the watch-only runs under the results `roots` (a fresh watcher)."""
    return NnunetRunWatcher().refresh(roots, procs, snapshot, exclude_dirs)


# ---- stop: refused, with the reason and the way to make the run stoppable ----------------


def extension_trainer(trainer: str) -> str:
    """nnui's extension trainer for a run of `trainer` (trainer/nnunet_ext)."""
    if trainer.endswith(NNUNET_WRAP_SUFFIX):
        return trainer
    return NNUI_NNUNET_TRAINER if trainer == STOCK_TRAINER else trainer + NNUNET_WRAP_SUFFIX


def restart_command(run: WatchOnlyRun) -> str:
    """The shell line that continues this run with nnui's stop protocol (`--c`)."""
    args = run.args
    argv = ["nnUNetv2_train", args.dataset, args.configuration, args.fold, "-tr",
            extension_trainer(args.trainer)]  # fmt: skip
    if args.plans != STOCK_PLANS:
        argv += ["-p", args.plans]
    if args.num_gpus > 1:
        argv += ["-num_gpus", str(args.num_gpus)]
    if args.device != "cuda":
        argv += ["-device", args.device]
    if args.npz:
        argv.append("--npz")
    argv.append("--c")
    return f"{NNUNET_EXT_ENV}={shlex.quote(str(NNUNET_EXT_DIR))} {shlex.join(argv)}"


def launch_command(run: WatchOnlyRun) -> str:
    """The same continuation started from nnui (the nnU-Net engine)."""
    args = run.args
    where = "--cpu" if args.device == "cpu" else f"--gpus {','.join(run.gpus) or '<gpus>'}"
    extra = f" -- -p {args.plans}" if args.plans != STOCK_PLANS else ""
    return (
        f"nnui launch {args.dataset} {args.configuration} --folds {args.fold} --engine nnunet "
        f"{where} --c{extra}"
    )


@dataclass(frozen=True)
class StopRefusal:
    reason: str  # one line, for `error: refused to stop ...: <reason>`
    hints: tuple[str, ...]


_USR1_BIT = 1 << (signal.SIGUSR1 - 1)


def stop_refusal(run: WatchOnlyRun | RefusedRun, sigcgt_mask: int | None = None) -> StopRefusal:
    """Why nnui does not stop this run (it is never signalled); SigCgt is read fresh.
    Another user's adopted nnui-train run (discovery.py) says whose it is, in one line."""
    if getattr(run, "adopted", False):
        line = cast("RefusedRun", run).refusal_line()
        return StopRefusal(line.removeprefix("refused to stop ").partition(": ")[2], ())
    run = cast(WatchOnlyRun, run)  # the other kind of watched run
    mask = read_sigcgt_mask(run.pid) if sigcgt_mask is None else sigcgt_mask
    handler = None if mask is None else bool(mask & _USR1_BIT)
    who = f"pid {run.pid} of user {run.owner}"
    status = f"/proc/{run.pid}/status"
    if handler is False:
        reason = (
            f"watch-only: nnui did not start this nnU-Net run ({who}); it has no SIGUSR1 "
            f"handler (SigCgt {mask:016x} in {status} lacks bit {_USR1_BIT:#x}), so stock "
            f"nnU-Net would die of the signal and lose the epochs since its last checkpoint; "
            f"nothing sent"
        )
        hints: tuple[str, ...] = (
            "to stop it gracefully in the future, end it and continue it with nnui's "
            "extension trainer and --c (stock nnU-Net writes checkpoint_latest.pth only every "
            "50 epochs; --c falls back to checkpoint_best.pth):",
            f"  {restart_command(run)}",
            f"  or from nnui: {launch_command(run)}",
        )
        return StopRefusal(reason, hints)
    if handler is True:
        reason = (
            f"watch-only: nnui did not start this nnU-Net run ({who}), so nnui never "
            f"signals it; nothing sent"
        )
        hints = (
            f"it catches SIGUSR1 (SigCgt in {status}): its owner can stop it gracefully "
            f"with `kill -USR1 {run.pid}` (it checkpoints and exits at the end of the epoch)",
        )
        return StopRefusal(reason, hints)
    reason = (
        f"watch-only: nnui did not start this nnU-Net run ({who}) and cannot read {status} "
        f"to check for a SIGUSR1 handler; nothing sent"
    )
    return StopRefusal(reason, (f"  {restart_command(run)}",))
