"""Helpers shared by the bench scripts: process-tree sampling, timing, machine description.

A training run is a tree of processes (the trainer plus its data-loading workers), so
memory and CPU time are summed over the whole tree. Sampling every 0.2 s misses at most
0.2 s of CPU time of a process that exits between two samples; the last value seen for
every pid is kept after it exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

SAMPLE_PERIOD_S = 0.2
PSS_DUTY = 0.02  # the most of a core TreeSampler spends reading PSS


@dataclass
class TreeSample:
    """One sample of the whole tree at time t (unix seconds)."""

    t: float
    rss_bytes: int
    pss_bytes: int
    num_processes: int


@dataclass
class ProcSeries:
    """CPU seconds (user + system) of one process over time."""

    pid: int
    ppid: int
    name: str
    is_root: bool
    times: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def cpu_at(self, t: float) -> float:
        """CPU seconds used up to time t (0 before the first sample, last value after)."""
        value = 0.0
        for when, cpu in zip(self.times, self.cpu_s, strict=True):
            if when > t:
                break
            value = cpu
        return value


class TreeSampler:
    """Samples a process and all its descendants in a background thread.

    Cheap on purpose (it shares the 2 cores with what it measures): the list of
    descendants is refreshed every `scan_every` samples (a full /proc scan), PSS every
    `pss_every` samples at most, and no more often than keeps its reads under PSS_DUTY of
    a core (the kernel walks each process's page tables for it: 10 ms for one 3 GB torch
    process, so nnU-Net's predictor with six workers took 0.17 of a core at a 0.4 s period,
    CPU lost to the side measured and more to the side with more processes); RSS and CPU
    times (statm, stat) every sample.
    """

    def __init__(
        self,
        root_pid: int,
        period_s: float = SAMPLE_PERIOD_S,
        scan_every: int = 5,
        pss_every: int = 10,
        thread_name: str | None = None,
    ):
        self.root_pid = root_pid
        # CPU of the root's threads with this OS name (nnui's "nnui-loader"), per sample.
        self.thread_name = thread_name
        self.named_threads = ProcSeries(root_pid, 0, thread_name or "", True)
        self._named_tids: set[int] = set()
        self.period_s = period_s
        self.scan_every = scan_every
        self.pss_every = pss_every
        self.samples: list[TreeSample] = []
        self.procs: dict[tuple[int, float], ProcSeries] = {}
        self._members: list[tuple[psutil.Process, ProcSeries]] = []
        self._last_pss: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def start(self) -> TreeSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
        except psutil.NoSuchProcess:
            return
        count, next_pss = 0, 0.0
        while not self._stop.is_set():
            if count % self.scan_every == 0:
                self._scan(root)
            started = time.perf_counter()
            with_pss = count % self.pss_every == 0 and started >= next_pss
            self._sample(with_pss)
            if with_pss:
                next_pss = started + (time.perf_counter() - started) / PSS_DUTY
            count += 1
            self._stop.wait(self.period_s)

    def _scan(self, root: psutil.Process) -> None:
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            found = []
        members = []
        for proc in found:
            try:
                key = (proc.pid, proc.create_time())
                series = self.procs.get(key)
                if series is None:
                    series = ProcSeries(proc.pid, proc.ppid(), proc.name(), proc.pid == root.pid)
                    self.procs[key] = series
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            members.append((proc, series))
        self._members = members
        if self.thread_name is not None:
            self._named_tids = _threads_named(root.pid, self.thread_name)

    def _sample(self, with_pss: bool) -> None:
        now = time.time()
        rss = pss = count = 0
        for proc, series in self._members:
            try:
                cpu = proc.cpu_times()
                mem_rss = proc.memory_info().rss
                if with_pss:
                    self._last_pss[proc.pid] = getattr(proc.memory_full_info(), "pss", mem_rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            series.times.append(now)
            series.cpu_s.append(cpu.user + cpu.system)
            rss += mem_rss
            pss += self._last_pss.get(proc.pid, mem_rss)
            count += 1
        if count:
            self.samples.append(TreeSample(now, rss, pss, count))
        if self._named_tids:
            try:
                threads = psutil.Process(self.root_pid).threads()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                return
            named = [t for t in threads if t.id in self._named_tids]
            self.named_threads.times.append(now)
            self.named_threads.cpu_s.append(sum(t.user_time + t.system_time for t in named))

    def end_leftovers(self, timeout_s: float = 10.0) -> list[int]:
        """End processes of the tree that outlived its root (checked by pid + create_time)."""
        alive = []
        for pid, created in self.procs:
            try:
                proc = psutil.Process(pid)
                if abs(proc.create_time() - created) < 1e-3:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                continue
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, still = psutil.wait_procs(alive, timeout=timeout_s)
        for proc in still:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return [p.pid for p in alive]

    def dump(self, path: Path) -> None:
        """The raw samples as JSON, to recompute figures later."""
        data = {
            "samples": [[x.t, x.rss_bytes, x.pss_bytes, x.num_processes] for x in self.samples],
            "procs": [
                {
                    "pid": v.pid,
                    "ppid": v.ppid,
                    "name": v.name,
                    "is_root": v.is_root,
                    "times": v.times,
                    "cpu_s": v.cpu_s,
                }
                for v in self.procs.values()
            ],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))

    # ---- summaries -------------------------------------------------------------------

    def peak(self, until_t: float | None = None) -> TreeSample | None:
        """The sample with the largest summed RSS (optionally only samples before until_t)."""
        chosen = [s for s in self.samples if until_t is None or s.t <= until_t]
        return max(chosen, key=lambda s: s.rss_bytes, default=None)

    def peak_pss_bytes(self, until_t: float | None = None) -> int:
        chosen = [s.pss_bytes for s in self.samples if until_t is None or s.t <= until_t]
        return max(chosen, default=0)

    def children_cpu_s(self, t0: float, t1: float, pids: set[int] | None = None) -> float:
        """CPU seconds the non-root processes (or only `pids`) used between t0 and t1."""
        total = 0.0
        for series in self.procs.values():
            if series.is_root or (pids is not None and series.pid not in pids):
                continue
            total += series.cpu_at(t1) - series.cpu_at(t0)
        return total

    def tree_cpu_s(self, t0: float, t1: float) -> float:
        """CPU seconds of the whole tree (root and descendants) between t0 and t1."""
        return sum(s.cpu_at(t1) - s.cpu_at(t0) for s in self.procs.values())

    def named_threads_cpu_s(self, t0: float, t1: float) -> float:
        """CPU seconds of the root's named threads between t0 and t1 (0 if none seen)."""
        return self.named_threads.cpu_at(t1) - self.named_threads.cpu_at(t0)

    def root_cpu_s(self, t0: float, t1: float) -> float:
        return sum(s.cpu_at(t1) - s.cpu_at(t0) for s in self.procs.values() if s.is_root)


def _threads_named(pid: int, name: str) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().strip() == name:
                found.add(int(task.name))
    return found


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line() -> str:
    load = os.getloadavg()
    mem_gib = psutil.virtual_memory().total / 2**30
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, {mem_gib:.0f} GiB RAM, "
        f"load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at start"
    )


@contextlib.contextmanager
def _command_log(argv: list[str], log_path: Path):
    """log_path opened for appending, the command line written first."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log_file:
        log_file.write("$ " + " ".join(argv) + "\n")
        log_file.flush()
        yield log_file


def run_logged(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> int:
    """Run a command to completion with stdout+stderr appended to log_path; its exit code."""
    with _command_log(argv, log_path) as log_file:
        return subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env).returncode


def terminate_tree(pid: int, timeout_s: float = 10.0) -> None:
    """End a process we started and every descendant it left behind (by pid)."""
    try:
        root = psutil.Process(pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in members:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(members, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


GIB = 2**30


def side_ratio_lines(
    runs: list,
    rows: list[tuple[str, str, str | None]],
    sides: tuple[str, str] = ("nnui", "nnU-Net"),
) -> tuple[list[str], dict[str, float]]:
    """Per row (label, attribute, format or None for GiB): the median of each side over its
    successful runs (`side`, `exit_code` attributes) and the ratio sides[0]/sides[1]."""

    def med(side: str, key: str) -> float:
        return median_or_nan([getattr(r, key) for r in runs if r.side == side and r.exit_code == 0])

    lines, ratios = [], {}
    for label, key, fmt in rows:
        a, b = med(sides[0], key), med(sides[1], key)
        show = (lambda v: f"{v / GIB:.2f} GiB") if fmt is None else fmt.format
        ratios[label] = ratio(a, b)
        lines.append(f"{label}: {sides[0]} {show(a)}  {sides[1]} {show(b)}")
        lines.append(f"{label} ratio {sides[0]}/{sides[1]} = {ratios[label]:.2f}")
    return lines, ratios


@dataclass
class TreeRun:
    """A command run to completion under a TreeSampler; times in s, memory in bytes."""

    exit_code: int
    wall_s: float
    # user + system of the child and every descendant it reaped (wait4's rusage): exact,
    # unlike the sampled tree CPU, which can miss the last 0.2 s of a short-lived worker.
    cpu_s: float
    sampled_cpu_s: float
    peak_rss_bytes: int  # largest RSS sum over the tree
    peak_pss_bytes: int


def run_tree(
    argv: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[TreeRun, TreeSampler]:
    """Run argv to completion (output appended to log_path), sampling its process tree."""
    with _command_log(argv, log_path) as log_file:
        started = time.time()
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        # PSS every 2nd sample: these runs are short, a 2 s PSS period would miss the peak.
        sampler = TreeSampler(proc.pid, pss_every=2).start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            sampler.stop()
            sampler.end_leftovers()
    ended = time.time()
    peak = sampler.peak()
    return (
        TreeRun(
            proc.returncode,
            ended - started,
            usage.ru_utime + usage.ru_stime,
            sampler.tree_cpu_s(started, ended),
            peak.rss_bytes if peak else 0,
            sampler.peak_pss_bytes(),
        ),
        sampler,
    )


@dataclass
class SampledRun:
    """A command run to its end under a TreeSampler; times in seconds."""

    exit_code: int
    started_t: float  # unix time just before the start
    wall_s: float
    tree_cpu_s: float  # whole tree, start to end (processes shorter than a scan may be missed)
    sampler: TreeSampler


def run_sampled(
    argv: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    thread_name: str | None = None,
) -> SampledRun:
    """Run a command to its end (stdout+stderr to log_path) while sampling its tree; then
    end what it left behind (nnU-Net's augmentation workers can outlive it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        sampler = TreeSampler(proc.pid, thread_name=thread_name).start()
        try:
            rc = proc.wait()
        finally:
            sampler.stop()
            sampler.end_leftovers()
    wall_s = time.time() - started
    return SampledRun(rc, started, wall_s, sampler.tree_cpu_s(0.0, float("inf")), sampler)


HISTORY_MD = Path(__file__).resolve().parent / "history.md"  # dated runs; RESULTS.md: the latest


def append_history_md(lines: list[str]) -> None:
    """Append a dated section (lines joined by newlines) to bench/history.md."""
    with open(HISTORY_MD, "a") as handle:
        handle.write("\n".join(lines))


def parsed_or_exit_code(parse_args: Callable[[list[str]], Any], argv: list[str] | None) -> Any:
    """A bench's arguments (and its log format set), or the exit code argparse chose: 2 for a
    usage error, 0 for --help. One preamble for every bench's main()."""
    try:
        parsed = parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:
        return 2 if exit_.code else 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    return parsed
