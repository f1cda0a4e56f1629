"""A cascade fold's inputs (`nnui launch ... 3d_cascade_fullres --after-lowres`): which folds
of the previous stage (3d_lowres) still have to write their validation cases before the
fold can start. The job's supervisor waits on it; stdlib only (the trainer's twin is
trainer.cascade.check_inputs, which refuses a fold started too early).

Layout, as nnU-Net's: results/D/T__P__3d_lowres/predicted_next_stage/3d_cascade_fullres/
CASE.b2nd, one file per case, written by the lowres fold that validated the case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.schema import ROOT_ENVS, plans_file_name

NEXT_STAGE_DIR = "predicted_next_stage"  # trainer.cascade.NEXT_STAGE_DIR (numpy-free here)


def previous_stage(plans: dict, configuration: str) -> str | None:
    """The configuration's previous stage (its own block, else the one it inherits from)."""
    blocks = plans.get("configurations") or {}
    block = blocks.get(configuration)
    if not isinstance(block, dict):
        return None
    return block.get("previous_stage") or None


def missing_folds(job: Any) -> tuple[str | None, list[int]]:
    """(previous stage, its folds whose cases this fold still misses); (None, []) when the
    job is no cascade or its plans cannot be read (the trainer then says why)."""
    run_dir = Path(job.run_dir)  # results/D/T__P__C/fold_F
    trainer, plans_name, configuration = run_dir.parent.name.split("__", 2)
    preprocessed = job.env.get(ROOT_ENVS["preprocessed"])
    if not preprocessed:
        return None, []
    dataset_dir = Path(preprocessed) / job.dataset
    try:
        plans = json.loads((dataset_dir / plans_file_name(plans_name)).read_text())
        splits = json.loads((dataset_dir / "splits_final.json").read_text())
    except (OSError, ValueError):
        return None, []
    stage = previous_stage(plans, configuration)
    if stage is None or not isinstance(splits, list):
        return None, []
    if job.fold == "all":
        cases = sorted({c for s in splits for c in s.get("val", [])})
    else:
        split = splits[int(job.fold)]
        cases = [*split.get("train", []), *split.get("val", [])]
    folder = run_dir.parents[1] / f"{trainer}__{plans_name}__{stage}" / NEXT_STAGE_DIR
    folder = folder / configuration
    missing = {c for c in cases if not (folder / f"{c}.b2nd").is_file()}
    folds = sorted({i for i, s in enumerate(splits) if missing & set(s.get("val", []))})
    return stage, folds


def waiting_text(stage: str, folds: list[int]) -> str:
    return f"inputs: {stage} fold(s) {', '.join(str(f) for f in folds)} not done"
