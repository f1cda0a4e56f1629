"""A job's CPU manners: its nice value and CPU thread count (`nnui launch --nice N --threads T`).

Threads: `OMP_NUM_THREADS=T` in the trainer's environment (torch takes its intra-op thread
count from it; the trainer then leaves its own per-rank choice alone; torchrun keeps a value
it is given). Nice: `NNUI_NICE=N` in the job's environment; the supervisor starts the
trainer with exactly that nice value (setpriority in the child before exec). Without
--nice the trainer runs at the nice value nnui's supervisor has — nnui's own, since children
inherit it. An unprivileged process can raise its nice value but never lower it, so a niced
nnui cannot start un-niced jobs: the launch checks say so instead of letting it pass unseen.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

NICE_ENV = "NNUI_NICE"
THREADS_ENV = "OMP_NUM_THREADS"
NICE_MIN, NICE_MAX = -20, 19


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, 0)


def nice_problems(nice: int | None, threads: int | None) -> list[str]:
    """Usage errors of --nice / --threads (exit 2)."""
    problems = []
    if threads is not None and threads < 1:
        problems.append(f"--threads {threads}: give at least 1 CPU thread per trainer")
    if nice is None:
        return problems
    if not NICE_MIN <= nice <= NICE_MAX:
        problems.append(f"--nice {nice}: give a value from {NICE_MIN} to {NICE_MAX}")
    elif nice < own_nice() and os.geteuid() != 0:
        problems.append(
            f"--nice {nice}: nnui itself runs at nice {own_nice()} and only root can lower "
            f"it; give --nice {own_nice()} or more, or start nnui without nice"
        )
    return problems


def inherited_warning(nice: int | None) -> str | None:
    """Said when the jobs would take nnui's own (raised) nice value without being asked."""
    mine = own_nice()
    if nice is not None or mine <= 0:
        return None
    return (
        f"nnui runs at nice {mine}, so its jobs would too (only root can lower it): give "
        f"--nice {mine} to mean it, or start nnui without nice"
    )


def job_env(nice: int | None, threads: int | None) -> dict[str, str]:
    env = {}
    if nice is not None:
        env[NICE_ENV] = str(nice)
    if threads is not None:
        env[THREADS_ENV] = str(threads)
    return env


def env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "")
    return int(value) if value.lstrip("-").isdigit() else None


def child_setup(env: Mapping[str, str] | None) -> Callable[[], None] | None:
    """The preexec function that gives the trainer its nice value (None: nothing to set)."""
    nice = env_int(os.environ if env is None else env, NICE_ENV)
    if nice is None:
        return None

    def set_nice() -> None:  # in the child, before exec: the trainer starts at that value
        os.setpriority(os.PRIO_PROCESS, 0, nice)

    return set_nice


def parse_field(text: str) -> tuple[int | None, int | None]:
    """The board's field: `nice 10 threads 4` (either, any order; `nice=10` too; empty:
    the defaults). ValueError with a one-line reason."""
    words = text.replace("=", " ").split()
    values: dict[str, int] = {}
    while words:
        name, *words = words
        if name not in ("nice", "threads") or not words or not words[0].lstrip("-").isdigit():
            raise ValueError(f"nice/threads field: {text!r}: write e.g. nice 10 threads 4")
        values[name], words = int(words[0]), words[1:]
    return values.get("nice"), values.get("threads")
