"""The user's actions as flows: plan off the UI thread, confirm on screen, then act off the
UI thread again. Shared by the dashboard keys, the job detail screen and the palette.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.screens.confirm import KillConfirmScreen, LaunchConfirmScreen, StopConfirmScreen
from app.services import catalog, launcher, signals

NOTHING_TO_STOP = frozenset({"stopped", "finished", "failed", "lost"})
ACTIVE = frozenset({"starting", "running", "stopping", "queued"})


@dataclass(frozen=True)
class StopChoice:
    """One job in the stop dialog: its plan, or why nothing will be sent."""

    view: Any
    plan: Any | None  # signals.StopPlan
    note: str | None

    @property
    def sends(self) -> bool:
        return self.plan is not None and self.plan.ok

    @property
    def queues(self) -> bool:
        return self.plan is not None and not self.plan.ok and self.plan.queued


@dataclass(frozen=True)
class KillChoice:
    view: Any
    processes: tuple[Any, ...]  # procs.ProcInfo


def plan_stop_choice(view: Any) -> StopChoice:
    if view.state in NOTHING_TO_STOP:
        return StopChoice(view, None, f"job is {view.state}: nothing to stop, nothing is sent")
    if view.state == "queued" and not view.topology:
        return StopChoice(view, None, "job has not started yet (waiting for its turn)")
    plan = signals.plan_stop(view.job, view.topology, view.epoch)
    note = None
    if view.state == "stopping":
        note = "already stopping: sending SIGUSR1 again is harmless (the flag is already set)"
    elif view.job.queued_stop and plan.queued:
        note = "a stop is already queued: it is sent as soon as the ranks report"
    return StopChoice(view, plan, note)


def _views(app: Any, job_ids: Sequence[str]) -> list[Any]:
    views = [v for v in (app.view_of(j) for j in job_ids) if v is not None]
    if not views:
        app.notify("No job selected", severity="warning")
    return views


def _report_error(app: Any, result: Any) -> bool:
    if isinstance(result, Exception):
        app.notify(f"error: {result}", severity="error", timeout=10)
        return True
    return False


# ---- stop ---------------------------------------------------------------------------


def stop_jobs(app: Any, job_ids: Sequence[str]) -> None:
    views = _views(app, job_ids)
    if not views:
        return

    def confirmed(choices: list[StopChoice], ok: bool | None) -> None:
        if ok:
            app.run_in_thread(lambda: send_stops(app, choices), lambda r: stops_sent(app, r))

    def planned(result: Any) -> None:
        if not _report_error(app, result):
            app.push_screen(StopConfirmScreen(result), lambda ok: confirmed(result, ok))

    app.run_in_thread(lambda: [plan_stop_choice(v) for v in views], planned)


def send_stops(app: Any, choices: list[StopChoice]) -> list[str]:
    lines = []
    for choice in choices:
        job = choice.view.job
        if choice.sends:
            records = signals.send_stop(choice.plan, job, app.services.registry)
            sent = [r for r in records if r.result == "sent"]
            lines.append(f"{job.job_id}: SIGUSR1 to {', '.join(str(r.pid) for r in sent)}")
            lines += [f"{job.job_id}: pid {r.pid} {r.result}" for r in records if r not in sent]
        elif choice.queues:
            app.services.registry.update(job.job_id, queued_stop=True)
            lines.append(f"{job.job_id}: stop queued until the ranks report")
    return lines


def stops_sent(app: Any, result: Any) -> None:
    if not _report_error(app, result):
        app.notify("\n".join(result) or "nothing sent", title="stop", timeout=8)
        app.poll_jobs()


# ---- kill ---------------------------------------------------------------------------


def kill_jobs(app: Any, job_ids: Sequence[str]) -> None:
    views = [v for v in _views(app, job_ids) if v.state not in NOTHING_TO_STOP]
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
        return [KillChoice(v, tuple(signals.plan_kill(v.job))) for v in views]

    app.run_in_thread(plan, planned)


# ---- launch and resume --------------------------------------------------------------


def batch_size_of(roots: Any, dataset: str, configuration: str) -> int | None:
    for info in catalog.list_datasets(roots):
        if info.name == dataset:
            for conf in info.configurations:
                if conf.name == configuration:
                    return conf.batch_size
    return None


def start_plans(app: Any, plans: Sequence[Any]) -> None:
    def work() -> list[str]:
        return [launcher.start(plan, app.services.registry).job_id for plan in plans]

    def done(result: Any) -> None:
        if not _report_error(app, result):
            app.notify(f"started {len(result)} job(s): {', '.join(result)}", timeout=6)
            app.poll_jobs()

    app.run_in_thread(work, done)


def resume_jobs(app: Any, job_ids: Sequence[str]) -> None:
    views = _views(app, job_ids)
    if not views:
        return
    busy = [v.job.job_id for v in views if v.state in ACTIVE]
    if busy:
        app.notify(f"still running, not resumed: {', '.join(busy)}", severity="warning")
    views = [v for v in views if v.state not in ACTIVE]
    if not views:
        return

    def plan() -> tuple[list[Any], list[str]]:
        plans, problems = [], []
        for view in views:
            job = view.job
            request = launcher.resume_request(job)
            batch = batch_size_of(app.config.roots, job.dataset, job.configuration)
            got, why = launcher.plan_launch(
                request, app.config.roots, batch, app.snapshot, app.services.registry
            )
            plans += got
            problems += [f"{job.job_id}: {p}" for p in why]
        return plans, problems

    def planned(result: Any) -> None:
        if _report_error(app, result):
            return
        plans, problems = result
        previews = [launcher.preview(p) for p in plans]
        screen = LaunchConfirmScreen("Resume (--c, same GPUs)", previews, problems)
        app.push_screen(screen, lambda ok: start_plans(app, plans) if ok else None)

    app.run_in_thread(plan, planned)
