"""Final validation Dice per class (a label, or a region of a region-based dataset) with its
name, per fold and averaged over the finished folds of a cross-validation.

Read from what the trainer records: the fold's last `validation_finished` event carries
`dice_per_class` and, since region-based training, `class_names` (dataset.json's names of
the labels or regions, in the order of the Dice). A fold without names (older runs, stock
nnU-Net) falls back to validation/summary.json's keys ("1", "(1, 2, 3)").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from trainer.schema.events import Kind
from trainer.schema.tree import EVENTS_FILE, SUMMARY_FILE, VALIDATION_DIR

ClassDice = list[tuple[str, float | None]]


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _from_events(run_dir: Path) -> ClassDice | None:
    try:
        lines = (run_dir / EVENTS_FILE).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("kind") != Kind.VALIDATION_FINISHED:
            continue
        names, dice = record.get("class_names"), record.get("dice_per_class")
        if isinstance(names, list) and isinstance(dice, list) and len(names) == len(dice):
            return [(str(n), _number(d)) for n, d in zip(names, dice, strict=True)]
        return None
    return None


def _from_summary(run_dir: Path) -> ClassDice | None:
    try:
        data = json.loads((run_dir / VALIDATION_DIR / SUMMARY_FILE).read_text())
        means = data["mean"]
        return [(str(k), _number(v.get("Dice"))) for k, v in means.items() if k != "0"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def fold_class_dice(run_dir: str | Path) -> ClassDice | None:
    """(name, Dice) per class of one fold's final validation; None before it exists."""
    run_dir = Path(run_dir)
    return _from_events(run_dir) or _from_summary(run_dir)


def mean_class_dice(run_dirs: Sequence[str | Path]) -> tuple[ClassDice, int]:
    """(name, mean Dice over the folds where defined) and the number of folds averaged."""
    found = [d for d in (fold_class_dice(r) for r in run_dirs) if d]
    if not found:
        return [], 0
    names = [name for name, _ in found[0]]
    out: ClassDice = []
    for index, name in enumerate(names):
        values = [v for f in found if index < len(f) and (v := f[index][1]) is not None]
        out.append((name, sum(values) / len(values) if values else None))
    return out, len(found)


def fold_dirs(any_fold_dir: str | Path, folds: list[str]) -> list[Path]:
    """The run folders of `folds` next to one fold's folder (results/D/T__P__C/fold_F)."""
    parent = Path(any_fold_dir).parent
    return [parent / f"fold_{fold}" for fold in folds]


def class_dice_text(dice: ClassDice) -> str:
    return ", ".join(f"{name} {'n/a' if d is None else f'{d:.4f}'}" for name, d in dice)
