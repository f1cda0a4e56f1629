"""5-fold cross-validation splits (splits_final.json), nnU-Net layout: a list of
{"train": [...], "val": [...]} per fold. An existing file is kept as it is."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from trainer.schema.atomic import atomic_write_text

SPLITS_FILE = "splits_final.json"
NUM_FOLDS = 5


class SplitsError(ValueError):
    """A fold that does not exist or an unusable splits file (message is one line, with the
    fix). A ValueError, so the trainer CLI prints it as `error: ...` and exits 2."""


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def validate_splits(splits: object, path: Path) -> list[dict[str, list[str]]]:
    """The splits if they are a non-empty list of {"train": [ids], "val": [ids]} folds, each
    without duplicate ids and validating on no case it trains on."""
    if (
        not isinstance(splits, list)
        or not splits
        or not all(
            isinstance(s, dict) and _is_id_list(s.get("train")) and _is_id_list(s.get("val"))
            for s in splits
        )
    ):
        raise SplitsError(
            f"{path} is not a list of {{'train': [case ids], 'val': [case ids]}} folds; "
            "delete it to recreate it"
        )
    for fold, entry in enumerate(splits):
        _check_fold(fold, entry, path)
    return splits


def _check_fold(fold: int, entry: dict[str, list[str]], path: Path) -> None:
    for part in ("train", "val"):
        duplicates = sorted(c for c, n in Counter(entry[part]).items() if n > 1)
        if duplicates:
            raise SplitsError(
                f"fold {fold} of {path} lists {part} cases twice: {duplicates[:5]}; "
                "fix it or delete it to recreate it"
            )
    train, val = set(entry["train"]), set(entry["val"])
    # A one-case dataset trains and validates on its case: what create_splits writes.
    if train == val and len(train) == 1:
        return
    overlap = sorted(train & val)
    if overlap:
        raise SplitsError(
            f"fold {fold} of {path} validates on cases it trains on: {overlap[:5]}; "
            "fix it or delete it to recreate it"
        )


def create_splits(
    case_ids: list[str], seed: int = 12345, num_folds: int = NUM_FOLDS
) -> list[dict[str, list[str]]]:
    """nnU-Net 2.8's folds for the same case ids, so a fold of one tool is the fold of the
    other: scikit-learn's KFold(num_folds, shuffle=True, random_state=seed) over the sorted
    ids, reproduced with numpy (the same RandomState shuffle of 0..n-1, then consecutive
    chunks, the first n mod k one larger; ids of each side in sorted order).

    With fewer cases than folds (where nnU-Net stops with an error) each case is one fold
    (a single case trains and validates on itself), so tiny datasets still work.
    """
    ids = sorted(case_ids)
    if not ids:
        raise SplitsError("no cases to split")
    if len(ids) == 1:
        return [{"train": list(ids), "val": list(ids)}]
    num_folds = min(num_folds, len(ids))
    order = np.arange(len(ids))
    np.random.RandomState(seed).shuffle(order)
    sizes = np.full(num_folds, len(ids) // num_folds)
    sizes[: len(ids) % num_folds] += 1
    splits, start = [], 0
    for size in sizes:
        val_index = set(order[start : start + int(size)].tolist())
        start += int(size)
        splits.append(
            {
                "train": [c for i, c in enumerate(ids) if i not in val_index],
                "val": [c for i, c in enumerate(ids) if i in val_index],
            }
        )
    return splits


def load_or_create_splits(
    preprocessed_dataset_dir: Path, case_ids: list[str], seed: int = 12345, write: bool = True
) -> list[dict[str, list[str]]]:
    path = Path(preprocessed_dataset_dir) / SPLITS_FILE
    if path.is_file():
        try:
            splits = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise SplitsError(
                f"{path} is not valid JSON ({exc}); delete it to recreate it"
            ) from None
        return validate_splits(splits, path)
    splits = create_splits(case_ids, seed)
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(splits, indent=1) + "\n")
    return splits


def fold_cases(
    splits: list[dict[str, list[str]]], fold: str, all_case_ids: list[str]
) -> tuple[list[str], list[str]]:
    """(train, val) case ids of a fold; 'all' trains and validates on every case."""
    fold = str(fold)
    if fold == "all":
        ids = sorted(all_case_ids)
        return ids, list(ids)
    if not fold.isdigit() or int(fold) >= len(splits):
        few = (
            f" ({len(all_case_ids)} cases give {len(splits)} folds)"
            if len(splits) < NUM_FOLDS
            else ""
        )
        choices = "0" if len(splits) == 1 else f"0-{len(splits) - 1}"
        raise SplitsError(
            f"fold {fold} does not exist in {SPLITS_FILE}{few}; choose {choices} or 'all'"
        )
    entry = splits[int(fold)]
    known = set(all_case_ids)
    missing = sorted((set(entry["train"]) | set(entry["val"])) - known)
    if missing:
        raise SplitsError(
            f"splits_final.json names cases that were not preprocessed: {missing[:5]}; "
            "re-run nnui-preprocess or delete splits_final.json"
        )
    return sorted(entry["train"]), sorted(entry["val"])
