"""The exit codes of every nnui command, in one table: `nnui` and its subcommands, the
supervisor, and the trainer's command lines (nnui-train, -preprocess, -predict, -evaluate,
-ensemble, -find-best-configuration, -demo-data; docs/contract.md, "Exit codes").
Standard library only.
"""

from __future__ import annotations

import signal

EXIT_OK = 0
# A run that failed, or a safety check that refused (the reason is printed or recorded).
EXIT_FAILED = 1
EXIT_REFUSED = 1
# Bad input or usage (one `error: ...` line): a wrong flag, a missing dataset, an unknown job.
EXIT_USAGE = 2
# Nothing to do: the job had already stopped or finished.
EXIT_NOTHING = 3
# The command could not be started at all (the shell's convention).
EXIT_NOT_STARTED = 127
# Ended by a signal: 128 + its number (the shell's convention); Ctrl-C is 130.
EXIT_SIGNAL_BASE = 128
EXIT_INTERRUPTED = EXIT_SIGNAL_BASE + signal.SIGINT


def exit_for_signal(signum: int) -> int:
    """The exit code of a command that ended because it received `signum`."""
    return EXIT_SIGNAL_BASE + int(signum)
