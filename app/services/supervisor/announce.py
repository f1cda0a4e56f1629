"""How a supervisor tells about its job's events: the job event log (`nnui watch`), the
job's `--on-event` command and a desktop notification — every one optional, none of them
able to cost the job anything.

Commands are run as argv lists, never through a shell. The desktop notification is
`notify-send` where it is on PATH and a desktop session is reachable (DISPLAY,
WAYLAND_DISPLAY or a D-Bus session address in the environment); otherwise it is skipped
silently. NNUI_NO_DESKTOP_NOTIFY=1 turns it off.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from app.services.jobs.registry import Job
from app.services.supervisor import job_log
from app.services.supervisor.hooks import JobEvent, hook_env, log_record

HOOK_TIMEOUT_S = 60.0  # a hook still running then is left to itself
NOTIFY_TIMEOUT_S = 10.0
NOTIFY_EVENTS = frozenset(
    {JobEvent.FINISHED, JobEvent.FAILED, JobEvent.STALLED, JobEvent.RESTARTED, JobEvent.STARTED}
)
NO_NOTIFY_ENV = "NNUI_NO_DESKTOP_NOTIFY"
SESSION_ENV = ("DISPLAY", "WAYLAND_DISPLAY", "DBUS_SESSION_BUS_ADDRESS")
RunCommand = Callable[[list[str], Mapping[str, str], float], "str | None"]


def notify_argv(env: Mapping[str, str], environ: Mapping[str, str]) -> list[str] | None:
    """The notify-send command line for one event, or None: no desktop to tell."""
    if env["NNUI_EVENT"] not in NOTIFY_EVENTS or environ.get(NO_NOTIFY_ENV) == "1":
        return None
    if not any(environ.get(name) for name in SESSION_ENV):
        return None
    program = shutil.which("notify-send", path=environ.get("PATH"))
    if program is None:
        return None
    event = env["NNUI_EVENT"]
    title = f"nnui: {env['NNUI_DATASET']} fold {env['NNUI_FOLD']} {event}"
    details = [env["NNUI_CONFIGURATION"], f"job {env['NNUI_JOB_ID']}"]
    if env["NNUI_DICE"]:
        details.append(f"Dice {env['NNUI_DICE']}")
    if env["NNUI_REASON"]:
        details.append(env["NNUI_REASON"])
    urgency = "critical" if event in (JobEvent.FAILED, JobEvent.STALLED) else "normal"
    return [program, "--app-name=nnui", f"--urgency={urgency}", title, " · ".join(details)]


def announce(
    state_dir: Path,
    job: Job,
    event: JobEvent,
    say: Callable[[str], None],
    run: RunCommand,
    reason: str = "",
    code: int | None = None,
) -> None:
    """Log the job event, run the job's `--on-event` command (the event in its environment)
    and send the desktop notification. `run` (the supervisor's: it owns starting
    processes) runs a command without a shell and returns a one-line problem or None."""
    env = hook_env(job, event, reason, code)
    job_log.append(state_dir, log_record(job, env))
    if job.on_event:
        problem = run(job.on_event, {**os.environ, **env}, HOOK_TIMEOUT_S)
        if problem:
            say(f"the --on-event command {problem}")
    argv = notify_argv(env, os.environ)
    if argv is not None:
        run(argv, os.environ, NOTIFY_TIMEOUT_S)  # best effort: silently skipped on failure
