"""`nnui cv [--json]`: the cross-validation view headless (cross_validation.py's rows)."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from app.cli.common import json_rows
from app.services.class_dice import class_dice_text, fold_dirs, mean_class_dice
from app.services.cross_validation import CvRow, cv_rows, queue_launches
from app.services.jobs.identity import roots_hint, watched_roots
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from app.services.jobs.words import human_duration
from trainer.schema.exits import EXIT_OK
from trainer.schema.status import State
from trainer.schema.tree import resolve_roots

DASH = "–"


def fold_text(cell: Any) -> str:
    """`0.8123` for a finished fold with its Dice, else its state (`missing`, `running`)."""
    if cell.state == State.FINISHED and cell.dice is not None:
        return f"{cell.dice:.4f}"
    return cell.state


def row_name(row: CvRow) -> str:
    """`Dataset004_Demo`, with its tree's short name for a row of another tree than the
    default one: `Dataset004_Demo [projB]`."""
    return f"{row.dataset} [{row.label}]" if row.label else row.dataset


def row_cells(row: CvRow) -> list[str]:
    """The cells of one row: dataset, config, trainer, plans, folds 0-4, mean±std, GPU-h, ETA."""
    spread = DASH
    if row.mean_dice is not None:
        spread = f"{row.mean_dice:.4f} ± {row.std_dice or 0.0:.4f}"
    return [row_name(row), row.configuration, row.trainer, row.plans,
            *(fold_text(c) for c in row.folds), spread, f"{row.gpu_hours:.2f}",
            (DASH if row.eta_s is None else human_duration(row.eta_s))]  # fmt: skip


HEADER = ["dataset", "config", "trainer", "plans", "fold 0", "fold 1", "fold 2", "fold 3",
          "fold 4", "Dice mean ± std", "GPU-h", "ETA"]  # fmt: skip

# The narrow layout (terminals under ~130 columns, 80x24 included): one short run column,
# folds as Dice or a short state, no GPU-hours; the watched Dice and ETA stay whole.
NARROW_HEADER = ["run", "0", "1", "2", "3", "4", "Dice ± sd", "ETA"]
SHORT_STATE = {
    "missing": DASH, "running": "run", "validating": "val", "waiting": "wait",
    "stopping": "stop…", "stopped": "stop", "failed": "FAIL", "unknown": "?",
}  # fmt: skip


def narrow_row_cells(row: CvRow) -> list[str]:
    """`004 3d_fullres` (+ trainer/plans when not nnui's defaults), folds, Dice, ETA."""
    run = f"{row.dataset.removeprefix('Dataset')[:3]} {row.configuration}"
    if (row.trainer, row.plans) != ("nnuiTrainer", "nnuiPlans"):
        run += f" {row.trainer}/{row.plans}"
    if row.label:
        run += f" [{row.label}]"
    folds = [f"{c.dice:.3f}" if c.state == State.FINISHED and c.dice is not None
             else SHORT_STATE.get(c.state, c.state) for c in row.folds]  # fmt: skip
    spread = DASH
    if row.mean_dice is not None:
        spread = f"{row.mean_dice:.2f}±{row.std_dice or 0.0:.2f}"
    eta = DASH if row.eta_s is None else human_duration(row.eta_s)
    return [run, *folds, spread, eta]


def table_width(header: list[str], rows: list[list[str]], padding: int = 2) -> int:
    """Cells a DataTable needs for these columns (one cell of padding each side)."""
    return sum(max(len(h), *(len(r[i]) for r in rows)) + padding for i, h in enumerate(header))


def cv_table(rows: list[CvRow]) -> str:
    table = [HEADER] + [row_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    )


def row_class_dice(row: CvRow) -> tuple[list, int]:
    """Final validation Dice per class or region (with its name), mean of finished folds."""
    finished = [c.fold for c in row.folds if c.state == State.FINISHED]
    return mean_class_dice(fold_dirs(row.template.run_dir, finished))


def row_dict(row: CvRow) -> dict[str, Any]:
    per_class, _ = row_class_dice(row)
    return {
        "results": row.results, "tree": row.label or None, "dataset": row.dataset,
        "configuration": row.configuration, "trainer": row.trainer,
        "plans": row.plans, "folds": [asdict(c) for c in row.folds],
        "mean_dice": row.mean_dice, "std_dice": row.std_dice, "gpu_hours": row.gpu_hours,
        "eta_s": row.eta_s, "gpus": list(row.gpus),
        "queue": [q.command() for q in queue_launches(row, list(row.gpus))],
        "dice_per_class": [{"name": n, "dice": d} for n, d in per_class],
    }  # fmt: skip


def cmd_cv(options: argparse.Namespace, registry: Registry) -> int:
    tracker = JobTracker(registry, include_forgotten=False)
    views = tracker.refresh()
    results = resolve_roots(options.raw, options.preprocessed, options.results).results
    # Runs started by hand count as launched ones (another user's stay out: watch-only).
    roots = watched_roots(results, [v.job for v in views], tracker.trees.trees())
    views += [v for v in tracker.refresh_watch_only(roots)
              if v.watch is None and v.job.run_dir]  # fmt: skip
    rows = cv_rows(views, default_results=results)
    if options.json:
        print(json_rows(row_dict(r) for r in rows))
        return EXIT_OK
    if not rows:
        print("no cross-validation folds yet (nnui launch DATASET CONFIG --folds all ...)")
        print(roots_hint(roots))
        return EXIT_OK
    print(cv_table(rows))
    for row in rows:
        per_class, num_folds = row_class_dice(row)
        if per_class:  # labels or regions by name (region-based training: the regions)
            print(f"  Dice per class ({row_name(row)} {row.configuration}, mean of {num_folds} "
                  f"fold(s)): {class_dice_text(per_class)}")  # fmt: skip
    for row in rows:
        for launch in queue_launches(row, list(row.gpus)):
            print(f"  to queue ({row_name(row)} {row.configuration}): {launch.text()}")
    return EXIT_OK
