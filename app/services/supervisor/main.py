"""`python -m app.services.supervisor --job-id ID --state-dir DIR -- ARGV...`

The small parent of every training nnui starts: waits for an earlier job when asked (folds
queued on one GPU) or for free GPUs (`--when-free`: waiting.py, claims held by this process
so they die with it), starts the trainer as its child, restarts it with `--c` after an
abnormal end while `--retries` allow (retries.py), runs the `--on-event` hook (hooks.py),
records the trainer's pid and start time (ticks since boot), then its exit code and end
time, in the registry. While the trainer runs it watches the run's topology: it records
the workers and delivers a stop queued before they were up (RunWatch) — the only place
that does. It ignores SIGUSR1 and SIGHUP: it is never a stop target and outlives an SSH
hang-up. (The trainer inherits the ignored SIGUSR1 until it installs its own handler, so
an early stop cannot kill it.)
Its stdout/stderr are the job's console file, which the trainer inherits; a restart moves
both to the next attempt's file (consoles.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from app.services.jobs.consoles import next_attempt_path, redirect_output
from app.services.jobs.events import JobEvents
from app.services.jobs.liveness import job_alive
from app.services.jobs.registry import PREDICT, Job, ProcessRecord, Registry
from app.services.jobs.simulated_load import simulated_gpu_load
from app.services.launch import fold_claims as claims
from app.services.launch.fold_claims import ClaimRefused
from app.services.launch.niceness import child_setup
from app.services.machine.procs import ProcInfo, proc_info, process_identity
from app.services.signals.send import remember_workers, send_stop
from app.services.signals.targets import local_ranks, plan_stop
from app.services.supervisor.announce import announce
from app.services.supervisor.gpu_claims import GpuClaims
from app.services.supervisor.hooks import JobEvent, final_kind
from app.services.supervisor.retries import (
    AttemptEnd,
    attempt_nan_loss,
    backoff_s,
    restart_reason,
    with_continue,
)
from app.services.supervisor.stall_watch import StallWatch
from app.services.supervisor.waiting import machine_monitor, wait_for_gpus
from trainer.schema.events import Kind
from trainer.schema.exits import EXIT_NOT_STARTED, EXIT_OK, exit_for_signal

log = logging.getLogger("nnui.supervisor")

POLL_S = 1.0
START_GRACE_S = 30.0  # an earlier job with no process recorded after this long never started


def _say(message: str) -> None:
    # One write per line: the supervisor and the trainer share the console file.
    sys.stdout.write(f"[nnui] {message}\n")
    sys.stdout.flush()


def earlier_job_done(job: Job) -> bool:
    if job.exit_code is not None or job.ended_at is not None:
        return True
    if not job.processes:
        return time.time() - job.created_at > START_GRACE_S
    return not job_alive(job, proc_info)


def _me_unless_stopped(registry: Registry, job_id: str) -> Job | None:
    """The job's record while it waits, None once it was forgotten or asked to stop."""
    try:
        me = registry.get(job_id)
    except KeyError:
        return None
    if me.queued_stop or any(s.result == "sent" for s in me.signals):
        return None
    return me


def wait_for(registry: Registry, job_id: str, after: str) -> bool:
    """Wait until `after` has ended. False if this job was asked to stop meanwhile."""
    _say(f"waiting for job {after} to end")
    while True:
        if _me_unless_stopped(registry, job_id) is None:
            return False
        try:
            if earlier_job_done(registry.get(after)):
                return True
        except KeyError:
            return True
        time.sleep(POLL_S)


def wait_for_inputs(registry: Registry, job_id: str) -> bool:
    """A cascade fold (--after-lowres): wait until the previous stage's folds wrote the
    segmentations of its cases; the job's waiting_reason names the folds still missing.
    False if this job was asked to stop meanwhile."""
    from app.services.launch.stage_inputs import missing_folds, waiting_text

    said = None
    while True:
        me = _me_unless_stopped(registry, job_id)
        if me is None:
            return False
        stage, folds = missing_folds(me)
        if not folds:
            if said is not None:
                registry.update(job_id, waiting_reason=None)
            return True
        reason = waiting_text(stage or "?", folds)
        if reason != said:
            _say(f"waiting for {reason}")
            registry.update(job_id, waiting_reason=reason)
            said = reason
        time.sleep(POLL_S)


class RunWatch:
    """The supervisor's eye on its job's run, for the job's whole life (docs/contract.md).

    Each step reads what the trainer appended to events.jsonl (the validated reader, this
    job's events only). When a topology appears it records each local worker's pid with
    its identity (start ticks) in the registry, so later checks can tell a reused pid; and
    it delivers a stop that was queued before the workers were up. Nobody else does either:
    looking at a job (the TUI, `nnui status`) never writes or signals.
    """

    def __init__(
        self,
        registry: Registry,
        job_id: str,
        proc_lookup: Callable[[int], ProcInfo | None] = proc_info,
        stall: StallWatch | None = None,
    ) -> None:
        self.registry = registry
        self.job_id = job_id
        self.proc_lookup = proc_lookup
        self.events: JobEvents | None = None
        self.stall = stall  # the stall watchdog (stall_watch.py), fed the same events

    def step(self) -> None:
        try:
            job = self.registry.get(self.job_id)
        except KeyError:
            return
        if self.events is None:
            self.events = JobEvents(job.run_dir)
        batch = self.events.poll(job)
        topology = self.events.topology
        if self.stall is not None:
            self.stall.step(job, batch.records, topology)
        if topology is None:
            return
        job = self._remember_workers(job, topology)
        if job.queued_stop:
            self._deliver_queued_stop(job, topology)

    def _remember_workers(self, job: Job, topology: dict[str, Any]) -> Job:
        recorded = {p.pid for p in job.processes if p.role == "worker"}
        if {r["pid"] for r in local_ranks(topology)} <= recorded:
            return job
        return remember_workers(job, topology, self.registry, self.proc_lookup)

    def _deliver_queued_stop(self, job: Job, topology: dict[str, Any]) -> None:
        plan = plan_stop(job, topology, None, self.proc_lookup)
        if not plan.ok:
            return  # e.g. the handler is not installed yet: try again next step
        if plan.already_signalled:
            self.registry.update(self.job_id, queued_stop=False)
            return
        records = send_stop(plan, job, self.registry)
        if any(r.result == "sent" for r in records):
            _say("delivered the queued stop (SIGUSR1 to the workers)")


def wait_watching_run(
    registry: Registry, job_id: str, trainer: subprocess.Popen[bytes], started_at: float
) -> int:
    """Wait for the trainer's exit code; meanwhile watch its run (RunWatch, StallWatch)."""
    stall = StallWatch(registry, registry.get(job_id), started_at, _announcer(registry), _say)
    watch = RunWatch(registry, job_id, stall=stall)
    while True:
        try:
            return trainer.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        try:
            watch.step()
        except OSError as error:  # a full or vanished disk must not cost the exit code
            log.warning("watching the run failed: %s", error)


def _release_claim(job: Job) -> None:
    """Under the launcher's lock: a launcher still handing the claim over to us finishes
    first, so the claim is really gone afterwards."""
    if job.kind == PREDICT:
        return  # a prediction's folder is its own, in the state dir: never claimed
    run_dir = Path(job.run_dir)
    try:
        with claims.locked(run_dir.parents[2]):  # results/DatasetNNN_Name/T__P__C/fold_F
            claims.release(run_dir, job.job_id)
    except (OSError, ClaimRefused, IndexError) as error:
        log.warning("could not release the claim of %s: %s", run_dir, error)


def _announce(
    registry: Registry, job: Job, event: JobEvent, reason: str = "", code: int | None = None
) -> None:
    """The job event: its log (`nnui watch`), `--on-event` hook, desktop notification."""
    announce(registry.state_dir, job, event, _say, _run_command, reason, code)


def _run_command(argv: list[str], env: Mapping[str, str], timeout_s: float) -> str | None:
    """A hook or notify-send, as argv (never a shell); a one-line problem, or None."""
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=dict(env))
        process.wait(timeout=timeout_s)
    except OSError as error:
        return f"{argv[0]} could not start: {error}"
    except subprocess.TimeoutExpired:
        return f"{argv[0]} still runs after {timeout_s:.0f} s; left running"
    return None


def _announcer(registry: Registry) -> Callable[[Job, JobEvent, str], None]:
    return lambda job, event, reason: _announce(registry, job, event, reason)


def _wait_for_gpus(registry: Registry, job: Job, held: GpuClaims) -> dict[str, str] | None:
    """Wait for and claim free GPUs (waiting.py); the trainer's environment, None: cancelled."""
    monitor = machine_monitor(job, lambda: simulated_gpu_load(registry))
    try:
        chosen = wait_for_gpus(registry, job.job_id, held, monitor, _say)
    finally:
        monitor.close()
    if chosen is None:
        return None
    env = dict(job.env)
    if job.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
    job = registry.update(job.job_id, gpus=list(chosen), env=env, waiting_reason=None)
    _say(f"GPU {','.join(chosen)} free and claimed: starting")
    _announce(registry, job, JobEvent.STARTED)
    return {**os.environ, **env}


def _start_trainer(
    registry: Registry, job_id: str, command: list[str], env: dict | None, current: dict
) -> Any:
    try:
        trainer = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, env=env, preexec_fn=child_setup(env)
        )
    except OSError as error:
        _say(f"could not start {command[0]}: {error}")
        return error
    # Running from here on: a SIGTERM now waits for the trainer's exit code (the kill
    # plans again each round and reaches the trainer once it is recorded below).
    current["trainer"] = trainer
    # /proc/PID/stat only: psutil may fail while the child is between fork and exec.
    ticks, create_time = process_identity(trainer.pid)
    record = ProcessRecord(trainer.pid, create_time or time.time(), "trainer", None, ticks)
    registry.add_process(job_id, record)
    return trainer


def _run_attempts(
    registry: Registry, job_id: str, command: list[str], env: dict | None, current: dict
) -> int:
    """Run the trainer; after an abnormal end restart it with --c while retries allow."""
    while True:
        started_at = time.time()
        trainer = _start_trainer(registry, job_id, command, env, current)
        if isinstance(trainer, OSError):
            registry.update(job_id, note=f"start failed: {trainer}")
            return EXIT_NOT_STARTED
        code = wait_watching_run(registry, job_id, trainer, started_at)
        current["trainer"] = None
        _say(f"trainer exited with code {code}")
        job = registry.get(job_id)
        end = AttemptEnd(code, attempt_nan_loss(job, started_at), started_at)
        reason = restart_reason(job, end)
        if reason is None:
            return code
        delay_s = backoff_s(len(job.restarts))
        _say(f"restart {len(job.restarts) + 1}/{job.retries} with --c in {delay_s:.0f} s: {reason}")
        job = registry.modify(job_id, partial(_record_restart, reason=reason))
        _announce(registry, job, JobEvent.RESTARTED, reason, code)
        if not _back_off(registry, job_id, delay_s):
            return code
        command = with_continue(command)
        _next_console(registry, job_id, reason)


def _next_console(registry: Registry, job_id: str, reason: str) -> None:
    """A restart writes into its own console file, named in the registry for the readers."""
    job = registry.get(job_id)
    path = next_attempt_path(Path(job.console_path), job_id)
    if path is None:  # a legacy shared console.log: keep appending
        return
    try:
        redirect_output(path)
    except OSError as error:
        log.warning("could not open %s: %s; the console stays %s", path, error, job.console_path)
        return
    registry.update(job_id, console_path=str(path))
    _say(f"job {job_id} attempt {len(job.restarts) + 1} (restarted with --c: {reason})")


def _record_restart(job: Job, reason: str) -> None:
    job.restarts.append(reason)
    # The next attempt's processes are the job's: stops and kills go to them.
    job.processes = [p for p in job.processes if p.role not in ("trainer", "worker")]
    job.stalled_at = job.stall_reason = job.stall_acted_at = None  # the new attempt's own


def _back_off(registry: Registry, job_id: str, delay_s: float) -> bool:
    """Wait before a restart; False when the user stopped or killed the job meanwhile."""
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline:
        job = registry.get(job_id)
        if job.queued_stop or job.killed_at is not None:
            _say("stopped while waiting to restart: not restarted")
            return False
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    return True


def _end_event(job: Job, code: int) -> JobEvent:
    if code != 0:
        return JobEvent.FAILED
    last = final_kind(job)
    ends: dict[str | None, JobEvent] = {
        Kind.STOPPED: JobEvent.STOPPED,
        Kind.FAILED: JobEvent.FAILED,
    }
    return ends.get(last, JobEvent.FINISHED)


def _cancelled(registry: Registry, job: Job, held: GpuClaims) -> int:
    _say("stopped before it started")
    held.release()
    _release_claim(job)
    registry.update(
        job.job_id, exit_code=EXIT_OK, ended_at=time.time(), note="stopped before it started",
        waiting_reason=None,
    )  # fmt: skip
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.services.supervisor", allow_abbrev=False)
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
    current: dict[str, subprocess.Popen[bytes] | None] = {"trainer": None}

    def on_term(signum: int, frame: object) -> None:
        # While the trainer runs we stay to record its exit code (kill targets the trainer).
        if current["trainer"] is None:
            raise _Terminated(signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        return _supervise(registry, job_id, command, current)
    except _Terminated as stop:
        # Recorded here, not in the handler: the main thread may have held the registry's
        # lock when the signal came, and the handler taking it again waited on itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        registry.update(
            job_id, exit_code=-stop.signum, ended_at=time.time(), note="killed before start"
        )
        return exit_for_signal(stop.signum)  # a GPU claim dies with this process


class _Terminated(BaseException):
    """SIGTERM while no trainer runs: unwinds the main thread (releasing any registry lock
    it holds). A BaseException, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _supervise(registry: Registry, job_id: str, command: list[str], current: dict) -> int:
    job = registry.get(job_id)
    held = GpuClaims()
    env: dict[str, str] | None = None
    if job.after and not wait_for(registry, job_id, job.after):
        return _cancelled(registry, job, held)
    if job.after_previous_stage and not wait_for_inputs(registry, job_id):
        return _cancelled(registry, job, held)
    if job.when_free:
        env = _wait_for_gpus(registry, job, held)
        if env is None:
            return _cancelled(registry, job, held)
    elif all(g.isdigit() for g in job.gpus) and job.gpus:
        # Started at once: still claim its GPUs (best effort: folds the user put on one GPU
        # on purpose share it), so that jobs waiting for a free GPU never take them.
        held.try_claim(tuple(job.gpus), job_id)
    code = _run_attempts(registry, job_id, command, env, current)
    # The fold is free once its trainer is gone: drop the claim before the exit code is
    # recorded, so a resume that waits for the exit code never meets our claim still held.
    held.release()
    _release_claim(job)
    job = registry.update(job_id, exit_code=code, ended_at=time.time())
    _announce(registry, job, _end_event(job, code), "", code)
    return EXIT_OK
