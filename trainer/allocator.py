"""The C allocator under CPU training: the one module that touches malloc.

A CPU training step frees and reallocates gigabytes of large tensors. glibc hands every
large freed block back to the kernel and the next step faults in fresh zeroed pages (~30 %
of a 3D U-Net step here); told to keep them, its heap fragments (~0.6 GiB above the live
peak at 64x80x80, batch 2). A caching allocator does both well: tcmalloc ran the same step
as fast as the tuned glibc at the live peak (1.85 vs 2.5 GiB; jemalloc 1.94 GiB;
bench/history.md). So on CPU, `nnui-train` re-executes itself once, with the same pid,
argv and environment plus LD_PRELOAD, when one of them is installed (Debian:
libtcmalloc-minimal4 or libjemalloc2), and otherwise tunes glibc after the first step.
`--malloc glibc` keeps glibc. Intel's CPU launcher for PyTorch preloads them the same way.

Stdlib only: this runs before `import torch`, while a SIGUSR1 must stay harmless.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Mapping

from trainer import stop

# Preference order: what measured best first (bench/history.md).
CACHING_ALLOCATORS = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
MALLOC_CHOICES = ("auto", "glibc")


def preloaded(env: Mapping[str, str] | None = None) -> str | None:
    """The caching allocator already in LD_PRELOAD, if any."""
    preload = (os.environ if env is None else env).get("LD_PRELOAD", "")
    return next((name for name in CACHING_ALLOCATORS if f"lib{name}" in preload), None)


def installed_allocator() -> str | None:
    """The soname of the preferred caching allocator the dynamic linker can find."""
    for name in CACHING_ALLOCATORS:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_env(env: Mapping[str, str], library: str) -> dict[str, str]:
    before = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{library} {before}".strip()}


def reexec_with_caching_allocator(device_type: str, choice: str) -> None:
    """On CPU, replace this process image by the same command with a caching allocator
    preloaded (same pid: nnui's records and signals stay valid). Returns when nothing is
    to do; does not return otherwise.

    A SIGUSR1 that arrives meanwhile is kept: it is blocked across exec (the mask and
    pending signals survive it) and the new image unblocks it once its handler is back
    (stop.install_at_start, the first statement of trainer.run).
    """
    if (
        device_type != "cpu"
        or choice != "auto"
        or preloaded()
        or not sys.platform.startswith("linux")
    ):
        return
    library = installed_allocator()
    if library is None:
        return
    stop.hold()
    if stop.requested():  # already received: send it again, to be delivered after exec
        os.kill(os.getpid(), signal.SIGUSR1)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, sys.orig_argv, preload_env(os.environ, library))
    except OSError:  # keep running as we are (glibc, tuned after the first step)
        stop.release()


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed blocks in the process (resident memory then stays at its
    peak). The trainer calls this after its first step: the heap then grows in the steady
    pattern of later steps, not around the first step's one-time allocations (2.6 instead
    of 3.2 GiB peak at 64x80x80, batch 2, for the same speed). A no-op (False) when a
    caching allocator is preloaded or the libc is not glibc."""
    if preloaded():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)  # start the steady heap from the pages in use only
        no_mmap = libc.mallopt(-4, 0)  # M_MMAP_MAX: large blocks from the heap, not mmap
        no_trim = libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never shrink the heap
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): its defaults stay
    return no_mmap == 1 and no_trim == 1


def describe() -> str:
    """For the start-up log line."""
    name = preloaded()
    return f"lib{name} (preloaded)" if name else "glibc (keeps freed memory after the first step)"
