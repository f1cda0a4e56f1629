"""dataset.json label rules equal nnU-Net 2.8.1's: what its LabelManager and its dataset
integrity check accept on the same files, nnui accepts (and trains the same heads); what
they refuse, nnui refuses in one line. BraTS's five-label layout, where labels 1 and 3
belong to the same regions, is accepted with one informational line at preprocessing.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.dummy
import re
from pathlib import Path

import numpy as np
import pytest

from trainer.data.labels import LabelError, parse_labels, region_note, written_back
from trainer.data.raw import DataError, open_raw_dataset

integrity = pytest.importorskip("nnunetv2.experiment_planning.verify_dataset_integrity")
label_handling = pytest.importorskip("nnunetv2.utilities.label_handling.label_handling")
nnunet_utils = pytest.importorskip("nnunetv2.utilities.utils")

BRATS5 = {"background": 0, "whole_tumour": [1, 2, 3, 4], "tumour_core": [1, 3, 4],
          "enhancing": [4]}  # fmt: skip
BRATS3 = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": [3]}

# (labels, regions_class_order, nnui's one-line reason or None where both accept)
CASES = [
    (BRATS5, [2, 1, 4], None),
    (BRATS3, [3, 2, 1], None),  # every label comes back as 3: nnU-Net does not mind
    ({"background": 0, "fg": 1, "fg2": 1}, None, None),
    ({"background": 0, "wt": [1], "tc": [1]}, None, None),
    ({"background": 0, "wt": [1, 2], "tc": [1, 2]}, [1, 2], None),
    ({"background": 0, "a": 1, "b": 2, "ignore": 3}, None, None),
    ({"background": 0, "a": 2}, None, "must be consecutive (0, 1, 2, ...): 1 missing"),
    ({"background": 0, "a": [1, 3], "b": [3]}, [1, 3], "2 missing from [0, 1, 3]"),
    ({"a": 1}, None, "background as 0"),
    ({"background": [0], "a": 1}, None, "background as 0"),
    ({"background": 0, "a": 1, "ignore": 5}, None, "ignore label (5) must be the highest"),
    ({"background": 0, "a": 1, "ignore": [2]}, None, "must be one int"),
    (BRATS5, None, "no regions_class_order"),
    (BRATS5, [2, 1], "has 2 entries for 3 regions"),
]  # fmt: skip


def _write_dataset(folder: Path, labels: dict, order: list[int] | None) -> None:
    from trainer.data.image_io import write_nifti

    (folder / "imagesTr").mkdir(parents=True)
    (folder / "labelsTr").mkdir()
    values = sorted({v for k, v in labels.items() for v in (v if isinstance(v, list) else [v])})
    rng = np.random.default_rng(0)
    for i in range(2):
        seg = rng.choice(np.asarray(values if len(values) > 1 else [0, 1]), (4, 6, 5))
        write_nifti(folder / "imagesTr" / f"c{i}_0000.nii.gz",
                    rng.random((4, 6, 5)).astype(np.float32), (1.0, 1.0, 1.0))  # fmt: skip
        write_nifti(folder / "labelsTr" / f"c{i}.nii.gz", seg.astype(np.uint8), (1.0, 1.0, 1.0))
    dataset_json = {"channel_names": {"0": "MR"}, "labels": labels, "numTraining": 2,
                    "file_ending": ".nii.gz"}  # fmt: skip
    if order is not None:
        dataset_json["regions_class_order"] = order
    (folder / "dataset.json").write_text(json.dumps(dataset_json))


class _Threads:
    """nnU-Net's worker pools as threads. A forked pool in this threaded test process (the
    xdist worker) can deadlock: a CI run hung here, one pool worker waiting forever on its
    queue's lock; spawned ones cost seconds each."""

    Pool = staticmethod(multiprocessing.dummy.Pool)


def _nnunet_accepts(folder: Path, monkeypatch) -> bool:
    real = multiprocessing.get_context

    def context(method: str | None = None) -> object:  # nnU-Net asks for "spawn"; the pools
        return _Threads if method == "spawn" else real(method)  # themselves ask for None

    monkeypatch.setattr(integrity.multiprocessing, "get_context", context)
    monkeypatch.setattr(nnunet_utils, "Pool", multiprocessing.dummy.Pool)  # its own import
    try:
        integrity.verify_dataset_integrity(str(folder), num_processes=1)
    except (AssertionError, RuntimeError, TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize(("labels", "order", "reason"), CASES)
def test_nnui_accepts_and_refuses_what_nnunet_does(tmp_path, monkeypatch, labels, order, reason):
    folder = tmp_path / "Dataset990_Labels"
    _write_dataset(folder, labels, order)
    assert _nnunet_accepts(folder, monkeypatch) == (reason is None)
    if reason is not None:
        with pytest.raises(DataError, match=re.escape(reason)) as caught:
            open_raw_dataset(folder)
        assert "\n" not in str(caught.value)
        return
    open_raw_dataset(folder)
    spec = parse_labels(labels, order)
    manager = label_handling.LabelManager(labels, order)
    assert spec.has_regions == manager.has_regions
    assert spec.num_heads == manager.num_segmentation_heads
    assert list(spec.all_labels) == [int(v) for v in manager.all_labels]
    expected = manager.foreground_regions if manager.has_regions else manager.foreground_labels
    assert spec.foreground_keys == [int(k) if np.isscalar(k) else k for k in expected]
    if spec.has_regions:  # the same label map from the same region probabilities
        probs = np.random.default_rng(1).random((spec.num_heads, 5, 6)).astype(np.float32)
        theirs = manager.convert_probabilities_to_segmentation(probs)
        assert np.array_equal(spec.to_segmentation(probs), np.asarray(theirs))


def test_brats_labels_sharing_regions_get_one_note_naming_them():
    spec = parse_labels(BRATS5, [2, 1, 4])
    assert written_back(spec, 3) == written_back(spec, 1) == 1
    note = region_note(spec)
    assert note is not None and "\n" not in note
    assert note.startswith("note: labels 1 and 3 belong to the same regions "
                           "(whole_tumour, tumour_core): predictions write 1")  # fmt: skip
    assert "[2, 1, 4]" in note
    assert spec.output_values == (0, 1, 2, 4)
    # Nothing shared, nothing said; plain labels never.
    assert region_note(parse_labels(BRATS3, [1, 2, 3])) is None
    assert region_note(parse_labels({"background": 0, "fg": 1, "fg2": 1})) is None


def test_duplicate_values_train_one_class_as_nnunet():
    spec = parse_labels({"background": 0, "fg": 1, "fg2": 1})
    assert spec.num_heads == 2 and spec.foreground_keys == [1]
    single = parse_labels({"background": 0, "wt": [1], "tc": [1]})
    assert not single.has_regions and single.foreground_keys == [1]
    assert single.class_names() == ["tc"]
    with pytest.raises(LabelError):
        parse_labels({"background": 0, "a": "one"})
