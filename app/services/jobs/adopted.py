"""Adopted runs as jobs: the in-memory Job of a run nnui did not launch, and runs that ended
while nnui was not looking (continuing one with `--c`: launch/adopted_resume.py).

An adopted run's Job is never written to the registry: it is rebuilt from /proc at every
refresh (discovery.py), so curves, ETA, alerts, the detail view and export read its run
folder through the same code as a launched job's. Its processes are recorded with their
start ticks as discovered; the stop checks (targets.py) accept only those very workers.

A run that ended unseen is found from its folder: the newest `run_started` of an
events.jsonl under a watched results root that no registry job and no live process
claims. Its state is the run's own last lifecycle event (finished, stopped, failed), or
lost when it has none (killed, or the machine went down).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.services.jobs.discovery import RUN_ID_PREFIX, AdoptedRun, parse_args
from app.services.jobs.events import CLOCK_SLACK_S
from app.services.jobs.registry import Job, ProcessRecord
from app.services.jobs.summaries import SummaryCache, folder_key
from app.services.machine.gpus import MachineSnapshot, parse_visible_devices
from app.services.machine.procs import ticks_to_wall_s
from app.services.nnunet.runs import TrainArgs
from app.services.tail import JsonlTail
from trainer.schema.events import Kind
from trainer.schema.tree import CONFIG_FILE, CONSOLE_FILE, EVENTS_FILE, ROOT_ENVS


def _trainer_args(args: TrainArgs | None) -> list[str]:
    """The arguments a `--c` continues with: all but the device, rank count and --c."""
    if args is None:
        return []
    out, rest = [], list(args.rest)
    while rest:
        arg = rest.pop(0)
        if arg in ("-device", "-num_gpus"):
            rest = rest[1:]
        elif arg != "--c" and not arg.startswith(("-device=", "-num_gpus=")):
            out.append(arg)
    return out


def run_gpus(run: AdoptedRun, snapshot: MachineSnapshot | None) -> list[str]:
    """The GPUs a CUDA run uses: NVML's process lists, else its CUDA_VISIBLE_DEVICES."""
    if run.args is None or run.args.device != "cuda":
        return []
    if snapshot is not None and not snapshot.simulated:
        pids = set(run.pids)
        used = [str(g.index) for g in snapshot.gpus if any(p.pid in pids for p in g.processes)]
        if used:
            return used
    visible = parse_visible_devices(run.env.get("CUDA_VISIBLE_DEVICES")) or []
    return visible[: run.world_size]


def adopted_job(run: AdoptedRun, snapshot: MachineSnapshot | None = None) -> Job:
    """The Job of a live adopted run (never stored): the topmost process is its `trainer`,
    each rank a `worker` (what a stop may reach), with start ticks as discovered."""
    created = run.start_time or 0.0
    processes = [ProcessRecord(run.top_pid, created, "trainer", None,
                               next((m.start_ticks for m in run.members
                                     if m.pid == run.top_pid), None))]  # fmt: skip
    for member in run.workers:
        wall = ticks_to_wall_s(member.start_ticks) if member.start_ticks is not None else created
        processes.append(ProcessRecord(member.pid, wall, "worker", member.rank,
                                       member.start_ticks))  # fmt: skip
    env = dict(run.env)
    if run.slurm_job:
        env["SLURM_JOB_ID"] = run.slurm_job
    if run.slurm_step:
        env["SLURM_STEP_ID"] = run.slurm_step
    args = run.args
    folder = run.run_dir or ""
    return Job(
        job_id=run.run_id, created_at=created,
        dataset=Path(folder).parent.parent.name if folder else (args.dataset if args else "?"),
        configuration=args.configuration if args else "?", fold=args.fold if args else "?",
        mode=run.mode, device="cpu" if args and args.device == "cpu" else "cuda",
        gpus=run_gpus(run, snapshot), simulated=False, argv=list(run.argv), env=env,
        run_dir=folder,
        console_path=os.path.join(folder, CONSOLE_FILE) if folder else os.devnull,
        processes=processes, trainer_args=_trainer_args(args),
        continue_training=bool(args and args.continue_training),
        note=f"adopted: started outside nnui by {run.owner} ({run.launcher})",
    )  # fmt: skip


# ---- runs that ended while nnui was not looking ----------------------------------------------


@dataclass(frozen=True)
class FolderRun:
    """The newest run of a run folder, from its events (what history needs)."""

    run_dir: str
    started_t: float
    ended_t: float
    rank0_pid: int | None
    world_size: int
    launcher: str
    argv: tuple[str, ...]
    dataset: str
    configuration: str
    fold: str


class FolderScan:
    """The newest run of a folder's events.jsonl, read incrementally (file order: a clock
    stepped back never makes an older run the newest). Invalid lines are skipped."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.tail = JsonlTail(Path(run_dir) / EVENTS_FILE, max_records=0)
        self.start: dict[str, Any] | None = None  # the newest run_started
        self.rank0: int | None = None
        self.ended_t = 0.0  # the latest t since that start (the run's end, whatever the clock)
        self._run: FolderRun | None = None  # run()'s answer until something new is read

    def poll(self) -> FolderScan:
        while True:
            records = self.tail.poll()
            if self.tail.reset:
                self.start, self.rank0, self.ended_t = None, None, 0.0
            if records or self.tail.reset:
                self._run = None
            for record in records:
                self._see(record)
            if not self.tail.more:
                return self

    def _see(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == Kind.RUN_STARTED:
            keys = ("t", "world_size", "launcher", "argv", "dataset", "configuration", "fold")
            self.start = {k: record[k] for k in keys if k in record}
            self.rank0, self.ended_t = None, record["t"]
        elif self.start is None:
            return
        self.ended_t = max(self.ended_t, record["t"])
        if kind == Kind.TOPOLOGY and self.rank0 is None:
            ranks = record["ranks"]
            self.rank0 = next((r["pid"] for r in ranks if r.get("global_rank", 0) == 0), None)

    def state(self) -> dict[str, Any] | None:
        position = self.tail.position()
        if position is None:
            return None
        return {**position, "start": self.start, "rank0": self.rank0, "ended_t": self.ended_t}

    def restore(self, state: dict[str, Any]) -> bool:
        start, rank0 = state.get("start"), state.get("rank0")
        if not isinstance(start, (dict, type(None))) or not isinstance(rank0, (int, type(None))):
            return False
        try:
            self.tail.resume(state)
            self.ended_t = float(state["ended_t"])
        except (KeyError, TypeError, ValueError):
            return False
        self.start, self.rank0, self._run = start, rank0, None
        return True

    def run(self) -> FolderRun | None:
        start, run_dir = self.start, self.run_dir
        if start is None:
            return None
        if self._run is not None:
            return self._run
        argv = start.get("argv")
        self._run = FolderRun(
            run_dir=run_dir, started_t=start["t"], ended_t=self.ended_t, rank0_pid=self.rank0,
            world_size=int(start.get("world_size") or 1),
            launcher=str(start.get("launcher") or "?"),
            argv=tuple(argv) if isinstance(argv, list) else (),
            dataset=str(start.get("dataset") or Path(run_dir).parent.parent.name),
            configuration=str(start.get("configuration") or _named(run_dir)[0]),
            fold=str(start["fold"] if "fold" in start else _named(run_dir)[1]),
        )  # fmt: skip
        return self._run


def newest_run(run_dir: str) -> FolderRun | None:
    """The newest run_started of the folder's events.jsonl and what follows it; None when
    there is none or the file is unreadable."""
    return FolderScan(run_dir).poll().run()


def _named(run_dir: str) -> tuple[str, str]:
    """(configuration, fold) as the folder names them: `T__P__C/fold_F`."""
    folder = Path(run_dir)
    parts = folder.parent.name.split("__")
    return (parts[2] if len(parts) == 3 else "?"), folder.name.removeprefix("fold_")


def _claimed(run: FolderRun, jobs: Iterable[Job]) -> bool:
    """A registry job of the folder owns this run (it started at or after the job)."""
    for job in jobs:
        if run.started_t < job.created_at - CLOCK_SLACK_S:
            continue
        if job.ended_at is None or run.started_t <= job.ended_at + CLOCK_SLACK_S:
            return True
    return False


# A folder's real path, resolved once: each rescan resolved every run folder and job folder
# again (a quarter of a 500-run walk's 20 ms; building every FolderRun again, another
# quarter: FolderScan.run keeps its answer). A folder later replaced by a symlink keeps its
# old answer until nnui restarts; run folders do not live that way.
_real_path = lru_cache(maxsize=1 << 14)(os.path.realpath)


def run_folders(roots: Iterable[Path]) -> list[str]:
    """Every fold folder with an events.jsonl under the results roots."""
    found = []
    for root in roots:
        try:
            paths = sorted(
                str(p.parent) for p in Path(root).glob(f"Dataset*/*__*__*/fold_*/{EVENTS_FILE}")
            )
        except OSError:
            continue
        found += [_real_path(p) for p in paths]
    return list(dict.fromkeys(found))


def ended_job(run: FolderRun) -> Job:
    """The Job of a run that ended unseen: its own run is the newest in the folder."""
    key = run.rank0_pid or zlib.crc32(f"{run.run_dir}:{run.started_t}".encode())
    return Job(
        job_id=f"{RUN_ID_PREFIX}{key}", created_at=run.started_t - CLOCK_SLACK_S / 2,
        dataset=run.dataset, configuration=run.configuration, fold=run.fold,
        mode={"spawn": "spawn", "torchrun": "torchrun"}.get(run.launcher, "single"),
        device="cpu" if flag_in(run.argv, "-device") == "cpu" else "cuda", gpus=[],
        simulated=False, argv=list(run.argv), env=roots_env(run.run_dir), run_dir=run.run_dir,
        trainer_args=_rest_args(run.argv),
        console_path=os.path.join(run.run_dir, CONSOLE_FILE), ended_at=run.ended_t,
        note=f"adopted: started outside nnui ({run.launcher}), ended while nnui was not looking",
    )  # fmt: skip


def _rest_args(argv: Sequence[str]) -> list[str]:
    """The trainer arguments after dataset, configuration and fold, without the device, the
    rank count and --c (what a resume through nnui's launcher adds itself)."""
    return _trainer_args(parse_args(argv))


def flag_in(argv: Sequence[str], name: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(name + "="):
            return arg.partition("=")[2]
    return None


class EndedScan:
    """Runs that ended unseen; each folder's file read only from where it was left (kept
    across nnui's starts in the summary cache, when one is given). The trees are walked
    again at most every RESCAN_S while the jobs and live folders stay the same: a run that
    ends while nnui looks is followed live; these are the ones that ended before it looked
    (walking 500 run folders each second was most of the idle board's CPU)."""

    RESCAN_S = 15.0

    def __init__(self, cache: SummaryCache | None = None) -> None:
        self._cache = cache
        self._scans: dict[str, FolderScan] = {}
        self._jobs: dict[str, tuple[FolderRun, Job]] = {}  # the same Job while its run is
        self._last: tuple[float, tuple, list[Job]] | None = None  # (when, inputs, runs)

    def _scan(self, folder: str) -> FolderScan:
        scan = self._scans.get(folder)
        if scan is None:
            scan = FolderScan(folder)
            held = self._cache.get(folder_key(folder)) if self._cache is not None else None
            if held is not None and not scan.restore(held):
                scan = FolderScan(folder)
        scan.poll()
        if self._cache is not None:
            self._cache.put(folder_key(folder), scan.state())
        return scan

    def runs(self, roots: Iterable[Path], jobs: Sequence[Job], live: set[str]) -> list[Job]:
        roots = list(roots)
        inputs = (tuple(roots), tuple((j.job_id, j.ended_at) for j in jobs), frozenset(live))
        now = time.monotonic()
        last = self._last
        if last is not None and last[1] == inputs and now - last[0] < self.RESCAN_S:
            return list(last[2])
        out = self._walk(roots, jobs, live)
        self._last = (now, inputs, out)
        return list(out)

    def _walk(self, roots: list[Path], jobs: Sequence[Job], live: set[str]) -> list[Job]:
        by_folder: dict[str, list[Job]] = {}
        for known in jobs:  # one realpath per job, not one per job and folder
            by_folder.setdefault(_real_path(known.run_dir), []).append(known)
        live = {os.path.realpath(f) for f in live}
        out: list[Job] = []
        scans: dict[str, FolderScan] = {}
        for folder in run_folders(roots):
            scans[folder] = scan = self._scan(folder)
            run = scan.run()
            if run is None or folder in live or _claimed(run, by_folder.get(folder, ())):
                continue
            held = self._jobs.get(folder)
            if held is None or held[0] != run:
                held = self._jobs[folder] = (run, ended_job(run))
            out.append(held[1])
        self._scans = scans
        self._jobs = {f: held for f, held in self._jobs.items() if f in scans}
        return out


# ---- resume: the way it was started, with --c ------------------------------------------------


def roots_env(run_dir: str) -> dict[str, str]:
    """The roots the run used: its results root (the folder's grandparent's parent) and the
    preprocessed/raw roots its config.json names."""
    env = {ROOT_ENVS["results"]: str(Path(run_dir).parent.parent.parent)}
    try:
        config: Any = json.loads((Path(run_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        config = {}
    if isinstance(config, dict):
        for key, name in (("preprocessed_dataset_dir", "preprocessed"),
                          ("raw_dataset_dir", "raw")):  # fmt: skip
            value = config.get(key)
            if isinstance(value, str) and value:
                env[ROOT_ENVS[name]] = str(Path(value).parent)
    return env
