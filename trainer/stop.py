"""Graceful stop (docs/contract.md): SIGUSR1 only sets a flag; the loop acts on it between epochs.

The one module that sets SIGUSR1's disposition and mask. Standard library only, so the
first statement of every entry point (trainer.run's top) installs the handler before any
other import: until then the default action kills the process (exit 138). Re-install at
the start of every epoch: torch.compile's Triton/LLVM start-up can replace handlers.
Processes we start while the handler cannot exist yet (spawned ranks, our own re-exec)
inherit SIGUSR1 blocked (hold), so one sent meanwhile stays pending and arrives at the
handler when their entry releases it.
"""

from __future__ import annotations

import signal

_requested = False


def _on_sigusr1(signum: int, frame: object) -> None:
    # No I/O here: the signal may interrupt a write or a lock holder. A second signal is a no-op.
    global _requested
    _requested = True


def install() -> None:
    """(Re-)install the SIGUSR1 handler. Idempotent; keeps an already raised flag."""
    signal.signal(signal.SIGUSR1, _on_sigusr1)


def install_at_start() -> None:
    """First thing of every entry point: the handler, then a SIGUSR1 that a parent or our
    own re-exec held pending is delivered to it (and sets the flag)."""
    install()
    release()


def ignore() -> None:
    """Helper processes (data loaders) ignore the stop: only the trainer process acts on it."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def installed() -> bool:
    """True iff our SIGUSR1 handler is the one in place (reported in `topology`)."""
    return signal.getsignal(signal.SIGUSR1) is _on_sigusr1


def hold() -> None:
    """Block SIGUSR1: one that arrives stays pending until release(). The mask is inherited
    by children and kept across exec, so they start with it held as well."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


def release() -> None:
    """Unblock SIGUSR1 (after install()): a pending one is delivered now."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})


def requested() -> bool:
    return _requested


def clear() -> None:
    """Forget a request (tests, or a process that handled it and starts over)."""
    global _requested
    _requested = False


class Terminated(BaseException):
    """SIGTERM turned into an exception, so the run records `failed` before it exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def _on_sigterm(signum: int, frame: object) -> None:
    raise Terminated(signum)


def install_termination() -> None:
    """SIGTERM raises Terminated (SIGINT already raises KeyboardInterrupt)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
