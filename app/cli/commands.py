"""The headless subcommands, the TUI's twin for scripts: which handler runs each one.

Same services, same safety checks, same registry as the TUI. Output on stdout, one-line
`error: ...` on stderr; exit codes in app/cli/common.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from app.cli.control import cmd_kill, cmd_resume, cmd_stop
from app.cli.cv import cmd_cv
from app.cli.history import cmd_export, cmd_forget
from app.cli.launch import cmd_launch
from app.cli.predict import cmd_predict
from app.cli.schedule import cmd_priority, cmd_watch
from app.cli.status import cmd_status
from app.services.jobs.registry import Registry

Handler = Callable[[argparse.Namespace, Registry], int]


def run(options: argparse.Namespace) -> int:
    """Run the subcommand's handler on the user's registry; its exit code."""
    registry = Registry()
    handlers = {
        "status": cmd_status,
        "stop": cmd_stop,
        "resume": cmd_resume,
        "kill": cmd_kill,
        "launch": cmd_launch,
        "export": cmd_export,
        "forget": cmd_forget,
        "watch": cmd_watch,
        "priority": cmd_priority,
        "cv": cmd_cv,
        "predict": cmd_predict,
    }
    code = handlers[options.command](options, registry)
    for problem in registry.problems:
        print(f"warning: {problem}", file=sys.stderr)
    return code
