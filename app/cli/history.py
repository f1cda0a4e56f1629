"""`nnui export JOB` and `nnui forget JOB`: keeping the job list useful after weeks.

- export writes JOB_curves.csv (one row per epoch, every epoch_ended field) and
  JOB_curves.png (app.services.export.curves) into -o DIR (default: the current folder).
  Without matplotlib (the extra `plot`) the CSV is written and one line says how to get
  the PNG (exit 1).
- forget marks a job that ended, and the earlier jobs of its run folder, as forgotten in the
  registry (`forgotten_at`): `nnui status` and the TUI no longer list them (`status --all`
  does). Nothing in the results is deleted; `--undo` brings them back.
Exit codes as app/cli/common.py says: 0 ok, 1 refused, 2 usage, 3 nothing to do.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from app.cli import adopted as cli_adopted
from app.cli.common import error, looked_in
from app.services.export import curves as curve_export
from app.services.export import png as png_plot
from app.services.jobs.discovery import RUN_ID_PREFIX
from app.services.jobs.identity import roots_hint
from app.services.jobs.registry import Job, Registry
from app.services.jobs.views import JobTracker
from trainer.schema.exits import EXIT_NOTHING, EXIT_OK, EXIT_REFUSED, EXIT_USAGE
from trainer.schema.status import ENDED_STATES


def _resolve(registry: Registry, text: str) -> tuple[Job | None, int]:
    try:
        return registry.resolve(text), EXIT_OK
    except KeyError as problem:
        return None, error(str(problem.args[0]), EXIT_USAGE)


def cmd_export(options: argparse.Namespace, registry: Registry) -> int:
    if options.job.startswith(RUN_ID_PREFIX):  # an adopted run: found from /proc or its folder
        view = cli_adopted.find(options, registry, options.job)
        if view is None or not view.job.run_dir:
            roots = roots_hint(looked_in(options, registry.list(copies=False), registry.state_dir))
            return error(f"no run {options.job!r} with a readable run folder; {roots}", EXIT_USAGE)
        job: Job | None = view.job
        code = EXIT_OK
    else:
        job, code = _resolve(registry, options.job)
    if job is None:
        return code
    folder = Path(options.output or ".").expanduser()
    if folder.exists() and not folder.is_dir():
        return error(f"-o {folder} is not a folder", EXIT_USAGE)
    curves = curve_export.read_curves(job)
    if not curves.epochs:
        print(f"nothing to do: job {job.job_id} has no finished epoch yet")
        return EXIT_NOTHING
    try:
        paths, lines = curve_export.export(job, folder, curves)
    except OSError as problem:
        return error(f"cannot write into {folder}: {problem.strerror or problem}", EXIT_USAGE)
    except png_plot.PlotUnavailable as missing:
        print(curve_export.csv_path(job, folder))
        return error(str(missing), EXIT_REFUSED)
    for path in paths:
        print(path)
    print(f"{len(curves.epochs)} epochs; the PNG's panels, top to bottom:")
    for line in lines:
        print(f"  {line}")
    return EXIT_OK


def _row_jobs(registry: Registry, job: Job) -> list[Job]:
    """The job and the earlier jobs of its run folder (its row's history)."""
    jobs = registry.list()
    return [j for j in jobs if j.run_dir == job.run_dir and j.created_at <= job.created_at]


def cmd_forget(options: argparse.Namespace, registry: Registry) -> int:
    job, code = _resolve(registry, options.job)
    if job is None:
        return code
    states = {v.job.job_id: v.state for v in JobTracker(registry).refresh()}
    members = _row_jobs(registry, job)
    active = [j.job_id for j in members if states.get(j.job_id) not in ENDED_STATES]
    if active and not options.undo:
        return error(
            f"refused to forget {job.job_id}: job {active[0]} is {states.get(active[0])}; "
            "stop it first (nnui stop)",
            EXIT_REFUSED,
        )
    when = None if options.undo else time.time()
    changed = [j for j in members if (j.forgotten_at is None) != (when is None)]
    if not changed:
        state = "not forgotten" if options.undo else "already forgotten"
        print(f"nothing to do: job {job.job_id} is {state}")
        return EXIT_NOTHING
    for member in changed:
        registry.update(member.job_id, forgotten_at=when)
    ids = ", ".join(j.job_id for j in changed)
    if options.undo:
        print(f"listed again: {ids}")
    else:
        print(f"forgotten: {ids} (results kept in {job.run_dir}; nnui status --all lists them)")
    return EXIT_OK
