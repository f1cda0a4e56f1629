"""Postprocessing against nnU-Net 2.8.1: the component filter equals nnU-Net's function,
and the choice follows its order (all foreground as one component first, kept only if no
label gets worse; then per label by its own Dice, only with more than one label)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.data.image_io import write_nifti
from trainer.data.labels import parse_labels
from trainer.evaluation.best_configuration import Inputs, choose_postprocessing
from trainer.inference.postprocess import keep_largest_component, read_postprocessing

components = pytest.importorskip("nnunetv2.postprocessing.remove_connected_components")


def _blobs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([0, 0, 0, 0, 1, 2, 3], np.uint8), size=(10, 12, 11))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("step", [1, 3, (1, 2), (1, 2, 3)])
def test_component_filter_is_nnunets(seed, step):
    seg = _blobs(seed)
    theirs = components.remove_all_but_largest_component_from_segmentation(
        seg, list(step) if isinstance(step, tuple) else step
    )
    np.testing.assert_array_equal(keep_largest_component(seg, [step]), theirs)


def test_components_tied_for_the_largest_all_stay():
    seg = np.zeros((9, 9, 9), np.uint8)
    seg[0:2, 0:2, 0:2] = 1
    seg[6:8, 6:8, 6:8] = 1
    seg[4, 0, 8] = 1
    theirs = components.remove_all_but_largest_component_from_segmentation(seg, 1)
    out = keep_largest_component(seg, [1])
    np.testing.assert_array_equal(out, theirs)
    assert out.sum() == 16


def _inputs(tmp_path: Path, reference: np.ndarray, prediction: np.ndarray, labels) -> Inputs:
    ref = tmp_path / "ref.nii.gz"
    write_nifti(ref, reference, (1.0, 1.0, 1.0))
    npz = tmp_path / "case.npz"
    values = sorted(labels.values())
    np.savez_compressed(
        npz, probabilities=np.stack([(prediction == v).astype(np.float32) for v in values])
    )
    return Inputs("D", parse_labels(labels), {"case": ref}, {"3d_fullres": {"case": npz}})


def test_one_label_uses_the_whole_foreground_step(tmp_path):
    reference = np.zeros((8, 8, 8), np.uint8)
    reference[1:4, 1:4, 1:4] = 1
    prediction = reference.copy()
    prediction[7, 7, 7] = 1  # a stray voxel
    inputs = _inputs(tmp_path, reference, prediction, {"background": 0, "a": 1})
    kept, dice = choose_postprocessing(inputs, ["3d_fullres"], lambda line: None)
    assert kept == [[1]] and dice == 1.0


def test_whole_foreground_step_first_then_labels_on_top(tmp_path):
    reference = np.zeros((10, 10, 10), np.uint8)
    reference[1:4, 1:4, 1:4] = 1
    reference[1:4, 1:4, 4:6] = 2  # touches label 1: one foreground component
    prediction = reference.copy()
    prediction[8, 8, 8] = 2  # a stray voxel: the whole-foreground step removes it
    inputs = _inputs(tmp_path, reference, prediction, {"background": 0, "a": 1, "b": 2})
    kept, dice = choose_postprocessing(inputs, ["3d_fullres"], lambda line: None)
    assert kept == [[1, 2]] and dice == 1.0
    pp = tmp_path / "pp.json"
    pp.write_text(json.dumps({"largest_component_labels": kept}))
    assert read_postprocessing(pp) == [(1, 2)]


def test_whole_foreground_step_refused_when_a_label_gets_worse(tmp_path):
    reference = np.zeros((10, 10, 10), np.uint8)
    reference[1:4, 1:4, 1:4] = 1
    reference[7:9, 7:9, 7:9] = 2  # its own component: the whole-foreground step drops it
    prediction = reference.copy()
    prediction[0, 9, 0] = 1
    inputs = _inputs(tmp_path, reference, prediction, {"background": 0, "a": 1, "b": 2})
    kept, dice = choose_postprocessing(inputs, ["3d_fullres"], lambda line: None)
    assert kept == [1] and dice == 1.0
