"""`python -m app.services.supervisor --job-id ID --state-dir DIR -- ARGV...`

The small parent of every training nnui starts: waits for an earlier job when asked (folds
queued on one GPU), starts the trainer as its child, records the trainer's pid and start
time (ticks since boot), then its exit code and end time, in the registry. It ignores SIGUSR1 and
SIGHUP: it is never a stop target and outlives an SSH hang-up. (The trainer inherits the
ignored SIGUSR1 until it installs its own handler, so an early stop cannot kill it.)
Its stdout/stderr are the job's console.log, which the trainer inherits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

from app.services.registry import Job, ProcessRecord, Registry
from app.services.signals import (
    job_alive,
    plan_stop,
    proc_info,
    process_identity,
    remember_workers,
    send_stop,
)
from app.services.tail import JsonlTail
from trainer.schema import EVENTS_FILE, Kind

log = logging.getLogger("nnui.supervisor")

POLL_S = 1.0
START_GRACE_S = 30.0  # an earlier job with no process recorded after this long never started


def _say(message: str) -> None:
    # One write per line: several processes share console.log.
    sys.stdout.write(f"[nnui] {message}\n")
    sys.stdout.flush()


def earlier_job_done(job: Job) -> bool:
    if job.exit_code is not None or job.ended_at is not None:
        return True
    if not job.processes:
        return time.time() - job.created_at > START_GRACE_S
    return not job_alive(job, proc_info)


def wait_for(registry: Registry, job_id: str, after: str) -> bool:
    """Wait until `after` has ended. False if this job was asked to stop meanwhile."""
    _say(f"waiting for job {after} to end")
    while True:
        try:
            me = registry.get(job_id)
        except KeyError:
            return False
        if me.queued_stop or any(s.result == "sent" for s in me.signals):
            return False
        try:
            if earlier_job_done(registry.get(after)):
                return True
        except KeyError:
            return True
        time.sleep(POLL_S)


def wait_delivering_queued_stop(
    registry: Registry, job_id: str, trainer: subprocess.Popen[bytes]
) -> int:
    """Wait for the trainer; meanwhile deliver a stop asked before the workers were up.

    (A running nnui does the same; this covers a headless `nnui stop` with no nnui open.)
    """
    events: JsonlTail | None = None
    topology = None
    mine = False
    while True:
        try:
            return trainer.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            job = registry.get(job_id)
        except KeyError:
            continue
        if not job.queued_stop:
            continue
        if events is None:
            events = JsonlTail(Path(job.run_dir) / EVENTS_FILE)
        for record in events.poll():
            kind = record.get("kind")
            if kind == Kind.RUN_STARTED and record.get("t", 0) >= job.created_at - 0.5:
                mine = True  # earlier runs in this folder (before a resume) do not count
            elif kind == Kind.TOPOLOGY and mine:
                topology = record
        if topology is not None:
            job = remember_workers(job, topology, registry)
            plan = plan_stop(job, topology, None)
            if plan.ok:
                send_stop(plan, job, registry)
                _say("delivered the queued stop (SIGUSR1 to the workers)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.services.supervisor")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        parser.error("no command after --")
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    registry = Registry(options.state_dir)
    job_id = options.job_id
    trainer: subprocess.Popen[bytes] | None = None

    def on_term(signum: int, frame: object) -> None:
        # While the trainer runs we stay to record its exit code (kill targets the trainer).
        if trainer is None:
            registry.update(
                job_id, exit_code=-signum, ended_at=time.time(), note="killed before start"
            )
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    job = registry.get(job_id)
    if job.after and not wait_for(registry, job_id, job.after):
        _say("stopped before it started")
        registry.update(job_id, exit_code=0, ended_at=time.time(), note="stopped before it started")
        return 0
    try:
        trainer = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as error:
        _say(f"could not start {command[0]}: {error}")
        registry.update(job_id, exit_code=127, ended_at=time.time(), note=f"start failed: {error}")
        return 127
    # /proc/PID/stat only: psutil may fail while the child is between fork and exec.
    ticks, create_time = process_identity(trainer.pid)
    record = ProcessRecord(trainer.pid, create_time or time.time(), "trainer", None, ticks)
    registry.add_process(job_id, record)
    code = wait_delivering_queued_stop(registry, job_id, trainer)
    _say(f"trainer exited with code {code}")
    registry.update(job_id, exit_code=code, ended_at=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
