"""A cascade fold's inputs (`nnui launch ... 3d_cascade_fullres --after-lowres`): which folds
of the previous stage (3d_lowres) still have to write their validation cases before the
fold can start. The job's supervisor waits on it and `nnui launch` refuses a cascade fold
without it; stdlib only (the trainers' twins: trainer.data.cascade.check_inputs for nnui's,
trainer.nnunet_engine for nnU-Net's, each refusing a fold started too early).

Layout, as nnU-Net's: results/D/T__P__3d_lowres/predicted_next_stage/3d_cascade_fullres/
CASE.b2nd, one file per case, written by the lowres fold that validated the case (stock
nnU-Net with its numpy dataset class writes CASE.npz there instead).

Before any fold trained, splits_final.json may not exist yet (nnU-Net writes it when its
first fold starts): then every case of the preprocessed data is needed and the folds that
will validate them are not known, so all of them are named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from app.services.launch.engines import ENGINES, NNUI
from app.services.launch.engines import engine as engine_named
from trainer.schema.tree import ROOT_ENVS

NEXT_STAGE_DIR = "predicted_next_stage"  # trainer.data.cascade.NEXT_STAGE_DIR (numpy-free here)
NUM_FOLDS = 5  # nnU-Net's default cross-validation (trainer.planning.splits.NUM_FOLDS)
# What a lowres fold writes per case: nnui's and nnU-Net's blosc2 file, nnU-Net's numpy one.
SUFFIXES = {"nnui": (".b2nd",), "nnunet": (".b2nd", ".npz", ".npy")}
_DATA_SUFFIXES = (".b2nd", ".npz")  # a preprocessed case's data file (not its _seg)


def _block(plans: dict, configuration: str) -> dict | None:
    """The configuration's settings, its `inherits_from` chain resolved (as nnU-Net does)."""
    blocks = plans.get("configurations") or {}
    chain: list[dict] = []
    name: Any = configuration
    while isinstance(name, str) and len(chain) < 8:
        block = blocks.get(name)
        if not isinstance(block, dict):
            break
        chain.append(block)
        name = block.get("inherits_from")
    if not chain:
        return None
    merged: dict = {}
    for block in reversed(chain):
        merged.update(block)
    return merged


def previous_stage(plans: dict, configuration: str) -> str | None:
    """The configuration's previous stage (its own block, else the one it inherits from)."""
    block = _block(plans, configuration)
    return (block or {}).get("previous_stage") or None


def _case_ids(data_dir: Path) -> list[str]:
    """The preprocessed cases of a configuration's data folder (nnui's or nnU-Net's)."""
    try:
        names = os.listdir(data_dir)
    except OSError:
        return []
    ids = {
        name.rsplit(".", 1)[0]
        for name in names
        if name.endswith(_DATA_SUFFIXES) and not name.rsplit(".", 1)[0].endswith("_seg")
    }
    return sorted(ids)


def _needed(splits: list | None, fold: str, all_ids: list[str]) -> list[str]:
    """The cases a fold trains and validates on ('all': every case)."""
    if splits is None or fold == "all":
        return all_ids  # five folds together train and validate on every case
    try:
        split = splits[int(fold)]
    except (ValueError, IndexError):
        return []  # a fold the splits lack: the trainer says so
    return [*split.get("train", []), *split.get("val", [])]


def _validating(stage_dir: Path, splits: list | None, all_ids: list[str]) -> set[str]:
    """Cases of lowres folds still in stock nnU-Net's final validation (checkpoint_final.pth
    written, validation/summary.json not yet): their files may be half written."""
    busy: set[str] = set()
    for fold_dir in stage_dir.glob("fold_*"):
        if (fold_dir / "checkpoint_final.pth").is_file() and not (
            fold_dir / "validation" / "summary.json"
        ).is_file():
            fold = fold_dir.name.removeprefix("fold_")
            if fold == "all" or splits is None:
                busy.update(all_ids)
            elif fold.isdigit() and int(fold) < len(splits):
                busy.update(splits[int(fold)].get("val", []))
    return busy


def missing_at(
    run_dir: Path, preprocessed: Path, fold: str, engine: str = "nnui"
) -> tuple[str | None, list[int], Path | None]:
    """(previous stage, its folds whose cases this fold still misses, the folder they write
    to); (None, [], None) when the fold is no cascade or its plans cannot be read (the
    trainer then says why)."""
    run_dir = Path(run_dir)  # results/D/T__P__C/fold_F
    trainer, plans_name, configuration = run_dir.parent.name.split("__", 2)
    dataset_dir = Path(preprocessed) / run_dir.parents[1].name
    # nnU-Net's plans file is <plans>.json, nnui's nnuiPlans.json (0.1's nnUNetPlans: plans.json)
    plans_file = engine_named(engine if engine in ENGINES else NNUI).plans_file(plans_name)
    try:
        plans = json.loads((dataset_dir / plans_file).read_text())
    except (OSError, ValueError):
        return None, [], None
    block = _block(plans, configuration) if isinstance(plans, dict) else None
    stage = (block or {}).get("previous_stage")
    if block is None or not stage or not isinstance(stage, str):
        return None, [], None
    splits = _splits(dataset_dir)
    all_ids = _case_ids(dataset_dir / str(block.get("data_identifier", "")))
    if splits is not None:
        all_ids = sorted({c for s in splits for c in s.get("val", [])} | set(all_ids))
    stage_dir = run_dir.parents[1] / f"{trainer}__{plans_name}__{stage}"
    folder = stage_dir / NEXT_STAGE_DIR / configuration
    suffixes = SUFFIXES.get(engine, SUFFIXES["nnui"])
    cases = _needed(splits, str(fold), all_ids)
    missing = {c for c in cases if not any((folder / f"{c}{s}").is_file() for s in suffixes)}
    if engine == "nnunet":
        missing |= set(cases) & _validating(stage_dir, splits, all_ids)
    if not missing:
        return stage, [], folder
    if splits is None:
        return stage, list(range(min(NUM_FOLDS, max(1, len(all_ids))))), folder
    folds = sorted({i for i, s in enumerate(splits) if missing & set(s.get("val", []))})
    return stage, folds, folder


def _splits(dataset_dir: Path) -> list | None:
    try:
        splits = json.loads((dataset_dir / "splits_final.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(splits, list) and all(isinstance(s, dict) for s in splits)
    return splits if ok else None


def missing_folds(job: Any) -> tuple[str | None, list[int]]:
    """missing_at for a job of the registry (its own preprocessed root and engine)."""
    preprocessed = job.env.get(ROOT_ENVS["preprocessed"])
    if not preprocessed:
        return None, []
    stage, folds, _ = missing_at(
        Path(job.run_dir), Path(preprocessed), job.fold, getattr(job, "engine", "nnui")
    )
    return stage, folds


def waiting_text(stage: str, folds: list[int]) -> str:
    return f"inputs: {stage} fold(s) {', '.join(str(f) for f in folds)} not done"


def refusal(configuration: str, fold: str, stage: str, folds: list[int], folder: Path) -> str:
    """`nnui launch`'s one line for a cascade fold whose inputs are missing."""
    names = ", ".join(str(f) for f in folds)
    return (
        f"{configuration} fold {fold} needs {stage} fold(s) {names} first (their segmentations "
        f"of its cases are not in {folder}): train them, or add --after-lowres to queue it "
        "after them"
    )
