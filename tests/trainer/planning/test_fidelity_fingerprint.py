"""Fingerprint intensity samples and stored foreground locations against nnU-Net 2.8.1."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.planning.fingerprint import foreground_samples
from trainer.planning.preprocess import class_location_count, sample_class_locations

fingerprint = pytest.importorskip(
    "nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor"
)
preprocessor = pytest.importorskip("nnunetv2.preprocessing.preprocessors.default_preprocessor")


@pytest.mark.parametrize("num_foreground", [0, 7, 20_000])
def test_foreground_samples_are_nnunets_draw_with_replacement(num_foreground):
    rng = np.random.default_rng(0)
    image = rng.normal(size=(2, 40, 30, 30)).astype(np.float32)
    seg = np.zeros((40, 30, 30), np.uint8)
    seg.reshape(-1)[rng.choice(seg.size, num_foreground, replace=False)] = 1
    theirs, _ = fingerprint.DatasetFingerprintExtractor.collect_foreground_intensities(
        seg[None], image
    )
    ours = foreground_samples(image, seg)
    for c in range(2):
        # a small foreground weighs as much as a large one: 10,000 draws per case
        assert len(ours[c]) == (10_000 if num_foreground else 0)
        np.testing.assert_array_equal(np.asarray(ours[c]), np.asarray(theirs[c], np.float64))


@pytest.mark.parametrize("num_voxels", [5, 9_999, 10_000, 10_001, 600_000, 2_000_000])
def test_class_location_count_is_nnunets(num_voxels):
    seg = np.zeros(num_voxels + 1, np.int8)[None, :, None, None]
    seg[0, :num_voxels] = 1
    theirs = preprocessor.DefaultPreprocessor._sample_foreground_locations(seg, [1])
    assert class_location_count(num_voxels) == len(theirs[1])


def test_stored_locations_are_voxels_of_their_class():
    seg = np.zeros((20, 40, 40), np.uint8)
    seg[2:18, 5:35, 5:35] = 1
    locations = sample_class_locations(seg, [1, 2], seed=0)
    assert len(locations["1"]) == 10_000 and locations["2"] == []
    assert all(seg[tuple(p)] == 1 for p in locations["1"])
    assert len({tuple(p) for p in locations["1"]}) == 10_000  # without replacement
