"""What nnui's command lines share (nnui-preprocess, -predict, -evaluate, -ensemble,
-find-best-configuration, -demo-data, nnui-train and the nnU-Net engine's): the one error
path (one `error: ...` line, exit code EXIT_USAGE of trainer.schema.exits), the CPU allocator.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from trainer.schema.exits import EXIT_USAGE
from trainer.schema.flags import with_close_flag


class OneLineParser(argparse.ArgumentParser):
    """Every trainer-side CLI's parser: flags spelled out in full, errors on one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line instead of usage + error
        known = [o for action in self._actions for o in action.option_strings]
        sys.stderr.write(f"error: {with_close_flag(message, known)} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_USAGE)


def one_line(error: BaseException) -> str:
    """The message of an error on one line (nibabel's messages span several)."""
    return " ".join(str(error).split())


def error_text(problem: str | BaseException) -> str:
    """What `error: ...` says: an OSError's reason and file, any other error on one line."""
    if isinstance(problem, OSError):
        return f"{problem.strerror or problem}: {problem.filename or ''}"
    return one_line(problem) if isinstance(problem, BaseException) else problem


def usage_error(problem: str | BaseException) -> int:
    """The one error path of every command line here: `error: PROBLEM` on one line on
    stderr, and the exit code for bad input (nothing was written)."""
    sys.stderr.write(f"error: {error_text(problem)}\n")
    return EXIT_USAGE


def use_caching_allocator(device_type: str) -> None:
    """On CPU, re-execute this process (same pid and argv) with tcmalloc/jemalloc preloaded
    when installed, as nnui-train does: glibc returns every freed activation (> 32 MiB) to
    the kernel and page-faults it in again at the next window. A SIGUSR1 held across the
    exec is released here (its default action, as before the exec). Sets OpenMP's wait
    policy first, so that the re-executed image (or torch, when not re-executed) sees it."""
    from trainer import allocator, stop

    if device_type == "cpu":
        # OpenMP threads that finish a parallel region first sleep instead of spinning for
        # their partner (libgomp reads this when torch loads it; the user's value wins).
        # On a shared box a spinning thread burns the core its partner waits for: -20 %
        # CPU and wall per window at 2 threads on 2 loaded cores (bench/history.md); torch
        # parallel regions are long (convs), so the wake-ups should cost little on an idle box
        # (not measured there).
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    allocator.reexec_with_caching_allocator(device_type, "auto")
    if allocator.preloaded():
        stop.release()
