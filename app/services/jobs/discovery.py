"""Adopted runs: every `nnui-train` on the box that nnui did not launch, found from /proc.

One run is one job however it was started: a single `nnui-train`, a `-num_gpus N` spawn
parent with its ranks, a torchrun agent with its workers, or the tasks of an srun step.
Processes are found by argv (`nnui-train ...`, `python -m trainer ...`, torchrun or srun
running either), grouped under their topmost related ancestor, and groups writing the same
run folder are merged (srun's tasks are children of slurmstepd, not of srun). Every process
gets a role: agent (torchrun), step (srun), launcher (the -num_gpus parent), worker (a
rank: the only role a stop may reach) or helper (data loaders, resource tracker).

The run folder, in order of trust:
- our own processes: the open `events.jsonl` (rank 0 keeps it open) or `owner.lock` among
  the /proc/PID/fd links — exact, whatever results root or cwd the run uses;
- else from the argv as the trainer builds it: `--results`, else the process's
  `nnUNet_results`, else `./nnui_data/results` (relative to its cwd); another user's
  environ and cwd are unreadable, so then every watched root is tried.
Runs nnui launched carry NNUI_JOB_ID in their environment and are skipped (the job table
shows them), as are folders of nnui's own active jobs. Another user's run is listed
watch-only with the owner's name; nnui never signals it (targets.py checks the uid again).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.services.machine.procs import (
    ProcRow,
    descendants,
    held_folder,
    process_table,
    read_comm,
    user_name,
)
from app.services.nnunet.runs import TrainArgs
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER, EVENTS_FILE, JOB_ID_ENV, ROOT_ENVS

SCOPE_ENV = "NNUI_ADOPT_SCOPE"  # test hook: "roots" = only runs under the watched roots
RUN_ID_PREFIX = "run:"  # an adopted run's id: "run:<pid of its topmost process>"
ENTRY_NAMES = ("nnui-train",)
TRAINER_MODULES = ("trainer", "trainer.run")
AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launch")
LOCK_FILE = "owner.lock"  # held by the trainer that writes a fold folder (trainer side)
ROLES = ("agent", "step", "launcher", "worker", "helper")
_VALUE_OPTIONS = {"-tr", "-p", "-num_gpus", "-device", "-pretrained_weights", "--results",
                  "--preprocessed", "--raw", "--epochs", "--iterations-per-epoch",
                  "--val-iterations", "--save-every", "--seed", "--malloc",
                  "--recompute-norm", "--precision", "--num-workers"}  # fmt: skip
_PY_VALUE_OPTIONS = {"-X", "-W", "-Q"}
_KEPT_ENV = (*ROOT_ENVS.values(), "CUDA_VISIBLE_DEVICES")


def _is_python(arg: str) -> bool:
    return os.path.basename(arg).startswith("python")


def _after_interpreter(cmdline: Sequence[str]) -> tuple[str, int] | None:
    """("module" | "script", index of the module/script) of a python command line."""
    index = 1
    while index < len(cmdline):
        arg = cmdline[index]
        if arg == "-m":
            return ("module", index + 1) if index + 1 < len(cmdline) else None
        if arg == "-c":
            return None
        if arg in _PY_VALUE_OPTIONS:
            index += 2
            continue
        if arg.startswith("-"):
            index += 1
            continue
        return "script", index
    return None


def trainer_index(cmdline: Sequence[str]) -> int | None:
    """Index of the trainer's entry (its arguments follow), or None: not a trainer."""
    if not cmdline:
        return None
    if os.path.basename(cmdline[0]) in ENTRY_NAMES:
        return 0
    if not _is_python(cmdline[0]):
        return None
    found = _after_interpreter(cmdline)
    if found is None:
        return None
    kind, index = found
    if kind == "module":
        return index if cmdline[index] in TRAINER_MODULES else None
    return index if os.path.basename(cmdline[index]) in ENTRY_NAMES else None


def _runs_trainer(args: Sequence[str]) -> bool:
    """A launcher's own arguments name the trainer (`-m trainer` or an nnui-train path)."""
    for index, arg in enumerate(args):
        if os.path.basename(arg) in ENTRY_NAMES:
            return True
        if arg == "-m" and index + 1 < len(args) and args[index + 1] in TRAINER_MODULES:
            return True
    return False


def is_agent(cmdline: Sequence[str]) -> bool:
    """torchrun (the console script, a wrapper named torchrun, or `python -m
    torch.distributed.run`) running the trainer."""
    if not cmdline:
        return False
    head = 0
    if os.path.basename(cmdline[0]) != "torchrun":
        if not _is_python(cmdline[0]):
            return False
        found = _after_interpreter(cmdline)
        if found is None:
            return False
        kind, head = found
        name = cmdline[head] if kind == "module" else os.path.basename(cmdline[head])
        if name not in (*AGENT_MODULES, "torchrun"):
            return False
    return _runs_trainer(cmdline[head + 1 :])


def is_step(cmdline: Sequence[str]) -> bool:
    """An srun whose command runs the trainer (its tasks run under slurmstepd)."""
    return bool(cmdline) and os.path.basename(cmdline[0]) == "srun" and _runs_trainer(cmdline[1:])


def is_related(cmdline: Sequence[str]) -> bool:
    return trainer_index(cmdline) is not None or is_agent(cmdline) or is_step(cmdline)


def parse_args(args: Sequence[str]) -> TrainArgs | None:
    """nnui-train's arguments (after the entry), or None when they name no fold."""
    positional: list[str] = []
    values: dict[str, str] = {}
    flags: set[str] = set()
    rest, todo = [], list(args)
    while todo:
        arg = todo.pop(0)
        name, eq, inline = arg.partition("=")
        if name in _VALUE_OPTIONS:
            if not eq and not todo:
                return None
            value = inline if eq else todo.pop(0)
            values[name] = value
            rest += [arg] if eq else [arg, value]
        elif arg.startswith("-"):
            flags.add(arg)
            rest.append(arg)
        else:
            positional.append(arg)
    if len(positional) < 3:
        return None
    num_gpus = values.get("-num_gpus", "1")
    return TrainArgs(
        dataset=positional[0], configuration=positional[1], fold=positional[2],
        trainer=values.get("-tr", DEFAULT_TRAINER), plans=values.get("-p", DEFAULT_PLANS),
        num_gpus=int(num_gpus) if num_gpus.isdigit() else 1,
        device=values.get("-device", "cuda"), results=values.get("--results"),
        continue_training="--c" in flags, rest=tuple(rest),
    )  # fmt: skip


@dataclass(frozen=True)
class Member:
    """One process of an adopted run."""

    pid: int
    ppid: int
    uid: int
    start_ticks: int | None
    role: str  # one of ROLES
    cmdline: tuple[str, ...]
    rank: int | None = None  # from its environment (own processes), else the topology


@dataclass(frozen=True)
class AdoptedRun:
    """A live nnui-train run nnui did not launch."""

    run_id: str
    uid: int
    owner: str
    top_pid: int
    start_time: float | None  # wall clock, the topmost process's start
    members: tuple[Member, ...]
    launcher: str  # single | spawn | torchrun | srun
    args: TrainArgs
    argv: tuple[str, ...]  # the topmost process's command line
    run_dir: str | None  # None: not found (another user's run under an unwatched root)
    run_dir_source: str | None  # "fd" | "argv" | None
    env: dict[str, str] = field(default_factory=dict)  # nnUNet_* roots of the process
    cwd: str | None = None
    slurm_job: str | None = None  # SLURM_JOB_ID of its processes (own only)
    slurm_step: str | None = None
    host: str = field(default_factory=socket.gethostname)
    adopted: bool = True
    # Read by the watch-only summary of another user's run (its JobView has the figures).
    gpus: tuple[str, ...] = ()
    dice_per_class: tuple[float, ...] = ()
    ema_fg_dice: float | None = None
    eta_s: float | None = None
    median_epoch_time_s: float | None = None

    @property
    def own(self) -> bool:
        return self.uid == os.getuid()

    @property
    def workers(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members if m.role == "worker")

    @property
    def world_size(self) -> int:
        if self.args is not None and self.launcher == "spawn":
            return max(self.args.num_gpus, len(self.workers))
        return max(1, len(self.workers))

    @property
    def mode(self) -> str:
        """The registry's launch mode (single | spawn | torchrun)."""
        return {"spawn": "spawn", "torchrun": "torchrun"}.get(self.launcher, "single")

    # What the watch-only views (job table, summary, detail) read of another user's run.
    @property
    def pid(self) -> int:
        return self.top_pid

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(m.pid for m in self.members)

    @property
    def trainer(self) -> str:
        return self.args.trainer if self.args else "?"

    @property
    def plans(self) -> str:
        return self.args.plans if self.args else "?"

    @property
    def log_path(self) -> str:
        return os.path.join(self.run_dir, EVENTS_FILE) if self.run_dir else "n/a"

    def refusal_line(self, action: str = "stop") -> str:
        """Why nnui does not signal this run (another user's): one line."""
        return (
            f"refused to {action} {self.run_id}: it belongs to user {self.owner} (pid "
            f"{self.top_pid}); nnui never signals another user's processes; nothing sent"
        )


# ---- grouping ------------------------------------------------------------------------------


def _groups(rows: Sequence[ProcRow]) -> dict[int, list[ProcRow]]:
    """{top pid: rows of the top and its descendants}; the top is the topmost related process."""
    by_pid = {row.pid: row for row in rows}
    related = {row.pid for row in rows if is_related(row.cmdline)}
    tops: set[int] = set()
    for pid in related:
        top, seen = pid, 0
        while by_pid.get(top) is not None and by_pid[top].ppid in related and seen < 64:
            top, seen = by_pid[top].ppid, seen + 1
        tops.add(top)
    table = list(rows)
    return {top: [by_pid[top], *(by_pid[p] for p in descendants(table, top) if p in by_pid)]
            for top in sorted(tops)}  # fmt: skip


def _env_rank(row: ProcRow) -> int | None:
    value = (row.environ or {}).get("RANK") or (row.environ or {}).get("SLURM_PROCID")
    return int(value) if value and value.isdigit() else None


def _role(row: ProcRow, by_pid: dict[int, ProcRow], roles: dict[int, str]) -> str:
    if is_agent(row.cmdline):
        return "agent"
    if is_step(row.cmdline):
        return "step"
    parent = by_pid.get(row.ppid)
    index = trainer_index(row.cmdline)
    if index is not None:
        if parent is not None and parent.cmdline == row.cmdline:
            return "helper"  # a forked data loader of that trainer
        args = parse_args(row.cmdline[index + 1 :])
        launched = any(k in (row.environ or {}) for k in ("TORCHELASTIC_RUN_ID", "RANK"))
        if args is not None and args.num_gpus > 1 and not launched:
            return "launcher"
        return "worker"
    spawned = "--multiprocessing-fork" in row.cmdline and any(
        "spawn_main" in a for a in row.cmdline
    )
    if spawned and parent is not None and roles.get(parent.pid) == "launcher":
        return "worker"
    return "helper"


def _members(group: list[ProcRow]) -> tuple[Member, ...]:
    by_pid = {row.pid: row for row in group}
    roles: dict[int, str] = {}
    members = []
    for row in sorted(group, key=lambda r: (r.start_ticks or 0, r.pid)):  # parents first
        role = roles[row.pid] = _role(row, by_pid, roles)
        rank = _env_rank(row) if role == "worker" else None
        members.append(Member(row.pid, row.ppid, row.uid, row.start_ticks, role, row.cmdline,
                              rank))  # fmt: skip
    return tuple(members)


# ---- the run folder --------------------------------------------------------------------------


def _dataset_dirs(root: Path, dataset: str) -> list[Path]:
    try:
        if dataset.isdigit():
            return sorted(p for p in root.glob(f"Dataset{int(dataset):03d}_*") if p.is_dir())
    except OSError:
        return []
    return [root / dataset] if dataset.startswith("Dataset") else []


def _absolute(value: str, cwd: str | None) -> Path | None:
    path = Path(value).expanduser()
    if path.is_absolute():
        return path
    return Path(cwd) / path if cwd else None


def _candidate_roots(args: TrainArgs, row: ProcRow, watched: Sequence[Path]) -> list[Path]:
    if args.results:
        path = _absolute(args.results, row.cwd)
        return [path] if path is not None else list(watched)
    if row.environ is None:  # another user's: environ and cwd unreadable
        return list(watched)
    value = row.environ.get(ROOT_ENVS["results"]) or os.path.join("nnui_data", "results")
    path = _absolute(value, row.cwd)
    return [path] if path is not None else []


def argv_run_dir(args: TrainArgs, row: ProcRow, watched: Sequence[Path]) -> str | None:
    """The existing fold folder these arguments train in, or None."""
    for root in _candidate_roots(args, row, watched):
        for dataset_dir in _dataset_dirs(root, args.dataset):
            fold = dataset_dir / f"{args.trainer}__{args.plans}__{args.configuration}"
            fold = fold / f"fold_{args.fold}"
            if fold.is_dir():
                return str(fold)
    return None


def _trainer_row(group: list[ProcRow]) -> tuple[ProcRow, TrainArgs] | None:
    """The first process of the group whose argv is the trainer's (its args name the fold)."""
    for row in group:
        index = trainer_index(row.cmdline)
        args = None
        if index is not None:
            args = parse_args(row.cmdline[index + 1 :])
        elif is_agent(row.cmdline) or is_step(row.cmdline):
            args = launched_args(row.cmdline)
        if args is not None:
            return row, args
    return None


def launched_args(cmdline: Sequence[str]) -> TrainArgs | None:
    """The trainer arguments in a torchrun or srun command line."""
    for index, arg in enumerate(cmdline):
        if os.path.basename(arg) in ENTRY_NAMES:
            return parse_args(cmdline[index + 1 :])
        if arg == "-m" and index + 1 < len(cmdline) and cmdline[index + 1] in TRAINER_MODULES:
            return parse_args(cmdline[index + 2 :])
    return None


# A process's folder never changes: (pid, start ticks) -> folder, so the fd links of a
# training (hundreds of them per rank) are read until found, not at every refresh.
_HELD: dict[tuple[int, int | None], str] = {}
_HELD_MAX = 4096


def _held(member: Member) -> str | None:
    key = (member.pid, member.start_ticks)
    folder = _HELD.get(key)
    if folder is None:
        folder = held_folder(member.pid, (EVENTS_FILE, LOCK_FILE))
        if folder is not None:
            if len(_HELD) >= _HELD_MAX:
                _HELD.clear()
            folder = _HELD[key] = os.path.realpath(folder)
    return folder


def _run_dir(members: Sequence[Member], found: tuple[ProcRow, TrainArgs],
             watched: Sequence[Path]) -> tuple[str | None, str | None]:  # fmt: skip
    """The run folder: one a rank holds open (our own processes; root reads any), else
    the one its argv names."""
    me = os.getuid()
    for member in members:
        if member.role in ("worker", "launcher") and (member.uid == me or me == 0):
            held = _held(member)
            if held is not None:
                return held, "fd"
    folder = argv_run_dir(found[1], found[0], watched)
    if folder is not None:
        return os.path.realpath(folder), "argv"
    return None, None


# ---- discovery -------------------------------------------------------------------------------


def _launcher(members: Sequence[Member]) -> str:
    roles = {m.role for m in members}
    if "agent" in roles:
        return "torchrun"
    if "step" in roles or any(
        m.ppid and read_comm(m.ppid) == "slurmstepd" for m in members if m.role == "worker"
    ):
        return "srun"
    return "spawn" if "launcher" in roles else "single"


def _adopted(group: list[ProcRow], watched: Sequence[Path]) -> AdoptedRun | None:
    if any((row.environ or {}).get(JOB_ID_ENV) for row in group):
        return None  # launched by nnui: its job shows it
    found = _trainer_row(group)
    if found is None:
        return None  # no fold in its argv: the trainer refuses such a command at once
    members = _members(group)
    workers = [m for m in members if m.role == "worker"]
    if len(workers) == 1 and workers[0].rank is None:  # a single process is rank 0
        members = tuple(replace(m, rank=0) if m is workers[0] else m for m in members)
    run_dir, source = _run_dir(members, found, watched)
    top = group[0]
    env = next((row.environ for row in group if row.environ), None) or {}
    # SLURM's ids from a rank (an srun's own environment names no step of its tasks).
    ranks = {m.pid for m in members if m.role == "worker"}
    slurm = next((row.environ for row in group if row.pid in ranks and row.environ
                  and row.environ.get("SLURM_JOB_ID")), None) or {}  # fmt: skip
    return AdoptedRun(
        run_id=f"{RUN_ID_PREFIX}{top.pid}", uid=top.uid, owner=user_name(top.uid),
        top_pid=top.pid, start_time=top.start_time, members=members,
        launcher=_launcher(members), args=found[1], argv=top.cmdline,
        run_dir=run_dir, run_dir_source=source,
        env={k: v for k, v in env.items() if k in _KEPT_ENV}, cwd=top.cwd,
        slurm_job=slurm.get("SLURM_JOB_ID"), slurm_step=slurm.get("SLURM_STEP_ID"),
    )  # fmt: skip


def _merge(runs: list[AdoptedRun]) -> list[AdoptedRun]:
    """Groups writing the same folder are one run (srun tasks, torchrun nodes on one host)."""
    by_dir: dict[str, AdoptedRun] = {}
    out = []
    for run in sorted(runs, key=lambda r: r.top_pid):
        key = f"{run.uid}:{run.run_dir}" if run.run_dir else None
        held = by_dir.get(key) if key else None
        if held is None:
            if key:
                by_dir[key] = run
            out.append(run)
            continue
        launcher = run.launcher if held.launcher == "single" else held.launcher
        starts = [t for t in (held.start_time, run.start_time) if t is not None]
        merged = replace(held, members=held.members + run.members, launcher=launcher,
                         start_time=min(starts) if starts else None,
                         slurm_job=held.slurm_job or run.slurm_job,
                         slurm_step=held.slurm_step or run.slurm_step)  # fmt: skip
        out[out.index(held)] = by_dir[key] = merged  # type: ignore[index]
    return out


def discover(
    watched: Iterable[Path] = (),
    procs: Sequence[ProcRow] | None = None,
    exclude_dirs: Iterable[str | Path] = (),
) -> list[AdoptedRun]:
    """The live nnui-train runs nnui did not launch. `watched`: results roots tried for a run
    whose own root cannot be read; `exclude_dirs`: folders of nnui's own active jobs."""
    roots = [Path(r) for r in watched]
    rows = list(procs) if procs is not None else process_table(
        detail=lambda _: True, roots=is_related
    )  # fmt: skip
    excluded = {os.path.realpath(d) for d in exclude_dirs}
    within = [os.path.realpath(r) + os.sep for r in roots]
    scoped = os.environ.get(SCOPE_ENV) == "roots"
    runs = []
    for group in _groups(rows).values():
        run = _adopted(group, roots)
        # The folder of an active job of nnui's hides a run only when the run could be that
        # job's (its environment unreadable): one whose environment says it is no nnui job
        # is listed even if a (hand-edited) record claims the folder.
        unreadable = all(row.environ is None for row in group)
        if run is None or (run.run_dir in excluded and unreadable):
            continue
        if scoped and not (run.run_dir and any(run.run_dir.startswith(w) for w in within)):
            continue
        runs.append(run)
    # An srun whose tasks were not found (they run on other nodes) is no run of this box.
    return [r for r in _merge(runs) if any(m.role != "step" for m in r.members)]
