"""The user's actions as flows: plan off the UI thread, confirm on screen, then act off the
UI thread again. Shared by the dashboard keys, the job detail screen and the palette.

Watch-only rows (nnU-Net runs nnui did not start) are never stopped, resumed or killed:
s/r/k on them show the refusal's reason and hints (nnunet_runs.stop_refusal) and nothing is
sent; the other selected jobs go on through their usual flow after it is closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.screens import cluster_actions
from app.screens.choices import KillChoice, StopChoice
from app.screens.confirm import (
    KillConfirmScreen,
    LaunchConfirmScreen,
    RefusalScreen,
    StopConfirmScreen,
)
from app.services.jobs import words as job_text
from app.services.jobs.liveness import between_attempts
from app.services.jobs.registry import PREDICT, Job
from app.services.launch import adopted_resume, catalog, launcher, prediction
from app.services.launch import request as launch_request
from app.services.nnunet import runs as nnunet_runs
from app.services.signals import send as signals
from app.services.signals import targets
from app.services.signals.targets import is_adopted
from trainer.schema.status import ACTIVE_STATES, ENDED_STATES, State
from trainer.schema.tree import DatasetNotFound, Roots, find_dataset

if TYPE_CHECKING:
    from app.screens.seam import AppSeam
    from app.services.jobs.views import JobView
    from app.services.launch.launcher import LaunchPlan
    from app.services.launch.request import LaunchRequest


def plan_stop_choice(view: JobView) -> StopChoice:
    if view.state in ENDED_STATES:
        return StopChoice(view, None, f"job is {view.state}: nothing to stop, nothing is sent")
    waits = view.state == State.QUEUED and between_attempts(view.job)
    if view.state == State.QUEUED and not view.topology and not waits:
        return StopChoice(view, None, "job has not started yet (waiting for its turn)")
    # Waiting for GPUs or to restart: no trainer runs, the queued stop cancels it.
    plan = targets.plan_stop(view.job, None if waits else view.topology, view.epoch)
    note = "waiting (for a free GPU or to restart): the stop cancels it" if waits else None
    if view.state == State.STOPPING:
        note = "already stopping: sending SIGUSR1 again is harmless (the flag is already set)"
    elif view.state == State.VALIDATING:
        note = ("the final validation is running: the trainer finishes it first, then ends "
                "as finished (every epoch is trained; nothing is left to resume)")  # fmt: skip
    elif view.job.queued_stop and plan.queued:
        note = "a stop is already queued: it is sent as soon as the ranks report"
    return StopChoice(view, plan, note)


def _views(app: AppSeam, job_ids: Sequence[str]) -> list[JobView]:
    views = [v for v in (app.view_of(j) for j in job_ids) if v is not None]
    if not views:
        app.notify("No job selected", severity="warning")
    return views


def _report_error(app: AppSeam, result: object) -> bool:
    if isinstance(result, Exception):
        app.notify(f"error: {result}", severity="error", timeout=10)
        return True
    return False


# ---- watch-only rows: refused with the reason, never signalled ------------------------


def refuse_watch_only(
    app: AppSeam, views: list[JobView], title: str, proceed: Callable[[list[JobView]], None]
) -> None:
    """Show why the watch-only views are left alone, then `proceed` with the others."""
    watched = [v for v in views if getattr(v, "watch_only", False)]
    rest = [v for v in views if v not in watched]
    if not watched:
        proceed(rest)
        return

    def closed(_: Any) -> None:
        if rest:
            proceed(rest)

    def planned(result: Any) -> None:
        if not _report_error(app, result):
            app.push_screen(RefusalScreen(title, result), closed)

    # stop_refusal reads the process's SigCgt from /proc: off the UI thread.
    def refusals() -> list[tuple[JobView, nnunet_runs.StopRefusal]]:  # watch-only: has a run
        return [(v, nnunet_runs.stop_refusal(v.watch)) for v in watched if v.watch is not None]

    app.run_in_thread(refusals, planned)


# ---- stop ---------------------------------------------------------------------------


def _on_slurm(app: AppSeam, views: list[JobView], action: str) -> list[JobView]:
    """Cluster folds go to SLURM's commands (cluster_actions.py); the rest is returned."""
    on_slurm, rest = cluster_actions.split(views, action)
    if on_slurm:
        cluster_actions.act(app, on_slurm, action)
    return rest


def stop_jobs(app: AppSeam, job_ids: Sequence[str]) -> None:
    views = _on_slurm(app, _views(app, job_ids), "stop")
    if views:
        refuse_watch_only(
            app, views, "Stop refused: watch-only nnU-Net run", lambda rest: _stop(app, rest)
        )


def _stop(app: AppSeam, views: list[JobView]) -> None:
    stopping = [v for v in views if v.state == State.STOPPING and not v.job.queued_stop]
    if stopping and len(stopping) == len(views):  # nothing to send: say since when
        lines = [job_text.already_stopping(v, time.time()) for v in stopping]
        app.notify("\n".join(lines), title="stop", timeout=8)
        return

    def confirmed(choices: list[StopChoice], ok: bool | None) -> None:
        if ok:
            app.run_in_thread(lambda: send_stops(app, choices), lambda r: stops_sent(app, r))

    def planned(result: Any) -> None:
        if not _report_error(app, result):
            app.push_screen(StopConfirmScreen(result), lambda ok: confirmed(result, ok))

    app.run_in_thread(lambda: [plan_stop_choice(v) for v in views], planned)


def send_stops(app: AppSeam, choices: list[StopChoice]) -> list[str]:
    lines = []
    for choice in choices:
        job = choice.view.job
        if choice.plan is not None and choice.sends:
            records = signals.send_stop(choice.plan, job, app.services.registry)
            sent = [r for r in records if r.result == "sent"]
            lines.append(f"{job.job_id}: SIGUSR1 to {', '.join(str(r.pid) for r in sent)}")
            lines += [f"{job.job_id}: pid {r.pid} {r.result}" for r in records if r not in sent]
        elif choice.queues:
            app.services.registry.update(job.job_id, queued_stop=True)
            lines.append(f"{job.job_id}: stop queued until the ranks report")
    return lines


def stops_sent(app: AppSeam, result: Any) -> None:
    if not _report_error(app, result):
        app.notify("\n".join(result) or "nothing sent", title="stop", timeout=8)
        app.poll_jobs()


# ---- kill ---------------------------------------------------------------------------


def kill_jobs(app: AppSeam, job_ids: Sequence[str]) -> None:
    views = _on_slurm(app, _views(app, job_ids), "kill")
    if views:
        refuse_watch_only(
            app, views, "Kill refused: watch-only nnU-Net run", lambda rest: _kill(app, rest)
        )


def _kill(app: AppSeam, views: list[JobView]) -> None:
    views = [v for v in views if v.state not in ENDED_STATES]
    if not views:
        app.notify("Nothing to kill: the selected jobs are not running", severity="warning")
        return

    def confirmed(choices: list[KillChoice], ok: bool | None) -> None:
        if not ok:
            return

        def work() -> list[str]:
            lines = []
            for choice in choices:
                records = signals.kill(choice.view.job, app.services.registry)
                lines.append(f"{choice.view.job.job_id}: {len(records)} signal(s)")
            return lines

        app.run_in_thread(work, lambda r: stops_sent(app, r))

    def planned(result: Any) -> None:
        if not _report_error(app, result):
            app.push_screen(KillConfirmScreen(result), lambda ok: confirmed(result, ok))

    def plan() -> list[KillChoice]:
        return [KillChoice(v, tuple(targets.plan_kill(v.job))) for v in views]

    app.run_in_thread(plan, planned)


# ---- launch and resume --------------------------------------------------------------


def batch_size_of(request: LaunchRequest, roots: Roots) -> int | None:
    """The global batch size in the plans file the request trains with (its engine's)."""
    used = launch_request.effective_roots(request, roots)
    who = launch_request.identity(request)
    try:
        dataset_name = find_dataset(used.preprocessed, request.dataset)
    except DatasetNotFound:
        return None  # the launch checks say so
    plans_file = who.engine.plans_file(who.plans)
    return catalog.plans_batch_size(used, dataset_name, request.configuration, plans_file)


def resume_plan(app: AppSeam, job: Job) -> tuple[list[LaunchPlan], list[str]]:
    """The launch plans that continue a job (`--c`, its engine, GPUs and roots), or why not;
    a prediction part continues with --continue_prediction."""
    if job.kind == PREDICT:
        return [prediction.resume_plan(job, app.services.registry)], []
    if is_adopted(job):  # started by hand: its own argv + --c, in its own roots
        plan = adopted_resume.resume_plan(job)
        return ([], [plan]) if isinstance(plan, str) else ([plan], [])
    request = launch_request.resume_request(job)
    planned = launch_request.request_run_dir(
        request, launch_request.effective_roots(request, app.config.roots), job.dataset, job.fold
    )
    if planned != Path(job.run_dir):
        return [], [f"it would train in {planned}, not in its own run folder {job.run_dir}"]
    batch = batch_size_of(request, app.config.roots)
    return launcher.plan_launch(
        request, app.config.roots, batch, app.snapshot, app.services.registry
    )


def busy_notes(app: AppSeam, job: Job) -> list[str]:
    """The GPUs of a resume that already run a process (the dialog names them)."""
    if job.kind == PREDICT or is_adopted(job):
        return []
    request = launch_request.resume_request(job)
    batch = batch_size_of(request, app.config.roots)
    checks = launch_request.check_request(
        request, app.config.roots, batch, app.snapshot, app.services.registry
    )
    return checks.confirmations


def start_plans(app: AppSeam, plans: Sequence[LaunchPlan]) -> None:
    def work() -> list[str]:
        registry = app.services.registry
        parts = [p for p in plans if p.kind == PREDICT]  # all at once, or none
        started = [job.job_id for job in prediction.start_prediction(parts, registry)]
        return started + [launcher.start(p, registry).job_id for p in plans if p not in parts]

    def done(result: Any) -> None:
        if not _report_error(app, result):
            app.notify(f"started {len(result)} job(s): {', '.join(result)}", timeout=6)
            app.poll_jobs()

    app.run_in_thread(work, done)


def resume_jobs(app: AppSeam, job_ids: Sequence[str]) -> None:
    views = _on_slurm(app, _views(app, job_ids), "resume")
    if views:
        refuse_watch_only(
            app, views, "Resume refused: watch-only nnU-Net run", lambda rest: _resume(app, rest)
        )


def _resume(app: AppSeam, views: list[JobView]) -> None:
    busy = [v.job.job_id for v in views if v.state in ACTIVE_STATES]
    if busy:
        app.notify(f"still running, not resumed: {', '.join(busy)}", severity="warning")
    views = [v for v in views if v.state not in ACTIVE_STATES]
    if not views:
        return

    def plan() -> tuple[list[Any], list[str], list[str]]:
        plans: list[LaunchPlan | tuple[LaunchPlan, str]] = []
        problems: list[str] = []
        notes: list[str] = []
        for view in views:
            got, why = resume_plan(app, view.job)
            if view.job.kind != PREDICT:  # say what --c continues from, or that it cannot
                plans += [(p, job_text.resume_from(view)) for p in got]
            else:
                plans += got
            problems += [f"{view.job.job_id}: {p}" for p in why]
            notes += [n for n in busy_notes(app, view.job) if n not in notes]
        return plans, problems, notes

    def planned(result: Any) -> None:
        if _report_error(app, result):
            return
        pairs, problems, notes = result
        plans = [p[0] if isinstance(p, tuple) else p for p in pairs]
        previews = [f"# {p[1]}\n{launcher.preview(p[0])}" if isinstance(p, tuple)
                    else launcher.preview(p) for p in pairs]  # fmt: skip
        screen = LaunchConfirmScreen("Resume (--c, same GPUs)", previews, problems, notes)
        app.push_screen(screen, lambda ok: start_plans(app, plans) if ok else None)

    app.run_in_thread(plan, planned)
