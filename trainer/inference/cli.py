"""What the inference CLIs share: one-line argument errors (exit 2), the CPU allocator.

Standard library only: it runs before torch is imported.
"""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + error
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def one_line(error: BaseException) -> str:
    """The message of an error on one line (nibabel's messages span several)."""
    return " ".join(str(error).split())


def use_caching_allocator(device_type: str) -> None:
    """On CPU, re-execute this process (same pid and argv) with tcmalloc/jemalloc preloaded
    when installed, as nnui-train does: glibc returns every freed activation (> 32 MiB) to
    the kernel and page-faults it in again at the next window. A SIGUSR1 held across the
    exec is released here (its default action, as before the exec)."""
    from trainer import allocator, stop

    allocator.reexec_with_caching_allocator(device_type, "auto")
    if allocator.preloaded():
        stop.release()
