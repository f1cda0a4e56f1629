"""The last steps of `nnui stop`, the same for nnui's own jobs and adopted runs: the verified
targets listed, the confirmation, the SIGUSR1 and its report."""

from __future__ import annotations

import argparse
import sys

from app.cli.common import confirm, error
from app.services.jobs.registry import Job, Registry
from app.services.signals.send import send_stop
from app.services.signals.targets import StopPlan
from trainer.schema.exits import EXIT_NOTHING, EXIT_REFUSED


def print_targets(plan: StopPlan) -> None:
    for target in plan.targets:
        print(f"  pid {target.pid}  rank {target.rank}  local rank {target.local_rank}  "
              f"device {target.device}  host {target.host}")  # fmt: skip


def not_confirmed(options: argparse.Namespace) -> int | None:
    """The exit code when the stop is not to be sent (no terminal to confirm it, or the user
    said no); None: send it."""
    if not options.yes and not sys.stdin.isatty():
        # A script that forgot --yes must not stop a training nobody confirmed.
        return error("no terminal to confirm the stop: add --yes to send it", EXIT_REFUSED)
    if not options.yes and not confirm("send the graceful stop?"):
        print("not sent")
        return EXIT_NOTHING
    return None


def send_and_report(plan: StopPlan, job: Job, registry: Registry) -> int | None:
    """Send the stop, each failure on stderr; EXIT_REFUSED when no worker received it."""
    records = send_stop(plan, job, registry)
    failed = [r for r in records if r.result != "sent"]
    for record in failed:
        print(f"  pid {record.pid}: {record.result}", file=sys.stderr)
    if failed and len(failed) == len(records):
        return error("no worker received the signal", EXIT_REFUSED)
    return None
