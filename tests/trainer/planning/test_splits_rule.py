"""Fresh folds are nnU-Net 2.8.1's folds for the same case ids (docs/fidelity.md)."""

from __future__ import annotations

import random

import pytest

from trainer.planning.splits import create_splits


@pytest.mark.parametrize("num_cases", [5, 6, 7, 9, 10, 21, 50, 64, 101, 200])
def test_folds_equal_nnunets_for_the_same_case_ids(num_cases):
    crossval = pytest.importorskip("nnunetv2.utilities.crossval_split")
    rng = random.Random(num_cases)
    ids = sorted({f"case_{rng.randrange(10**6):06d}" for _ in range(num_cases * 2)})[:num_cases]
    theirs = crossval.generate_crossval_split(ids, seed=12345, n_splits=5)
    theirs = [{"train": [str(c) for c in f["train"]], "val": [str(c) for c in f["val"]]}
              for f in theirs]  # fmt: skip
    # nnU-Net sorts the ids first; nnui sorts them itself, whatever order it is given.
    assert create_splits(list(reversed(ids))) == theirs


def test_fewer_cases_than_folds_give_one_fold_per_case():
    splits = create_splits(["b", "a", "c"])
    assert len(splits) == 3 and all(len(s["val"]) == 1 for s in splits)
    assert sorted(s["val"][0] for s in splits) == ["a", "b", "c"]
    assert all(sorted(s["train"] + s["val"]) == ["a", "b", "c"] for s in splits)
