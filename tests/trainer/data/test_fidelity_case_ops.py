"""Preprocessing array operations against nnU-Net 2.8.1's own functions on the same input."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data.case_ops import (
    CT,
    NO_NORM,
    RESCALE_0_1,
    RGB_0_1,
    ZSCORE,
    nonzero_mask,
    normalize,
    resample_image,
    resample_seg,
    separate_z_axis,
)

resampling = pytest.importorskip("nnunetv2.preprocessing.resampling.default_resampling")
cropping = pytest.importorskip("nnunetv2.preprocessing.cropping.cropping")
schemes = pytest.importorskip("nnunetv2.preprocessing.normalization.default_normalization_schemes")

SPACINGS = [
    ((5.0, 0.8, 0.8), (5.0, 0.8, 0.8), (5.0, 1.0, 1.0)),  # thick z, in-plane only
    ((5.0, 0.8, 0.8), (2.5, 1.0, 1.0)),  # thick z, z resampled (nearest)
    ((0.8, 4.0, 0.8), (1.0, 2.0, 1.0)),  # thick y
    ((1.0, 1.0, 1.0), (0.7, 1.3, 1.1)),  # isotropic: all axes alike
    ((1.0, 3.5, 3.5), (1.0, 1.0, 1.0)),  # two thick axes: all axes alike
    ((1.0, 1.0, 1.0), (4.0, 1.0, 1.0)),  # target anisotropic: its thick axis
]


def _nnunet_shape(shape, spacing, target):
    return tuple(int(n) for n in resampling.compute_new_shape(shape, spacing, target))


@pytest.mark.parametrize("case", SPACINGS)
def test_separate_z_rule_matches_nnunet(case):
    spacing, target = case[0], case[-1]
    do_sep, axis = resampling.determine_do_sep_z_and_axis(None, spacing, target)
    assert separate_z_axis(spacing, target) == (axis if do_sep else None)


@pytest.mark.parametrize("case", SPACINGS)
def test_image_resampling_matches_nnunet(case):
    spacing, target = case[0], case[-1]
    rng = np.random.default_rng(0)
    image = rng.normal(size=(2, 9, 14, 13)).astype(np.float32)
    shape = _nnunet_shape(image.shape[1:], spacing, target)
    ours = resample_image(image, shape, spacing, target)
    theirs = resampling.resample_data_or_seg_to_shape(
        image, shape, spacing, target, is_seg=False, order=3, order_z=0, force_separate_z=None
    )
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize("case", SPACINGS)
def test_label_resampling_matches_nnunet(case):
    spacing, target = case[0], case[-1]
    rng = np.random.default_rng(1)
    # blobs, not noise: ties at boundaries (even factors) and three-label corners occur
    seg = rng.choice(np.array([0, 1, 2, 4], np.int8), size=(5, 7, 6))
    seg = np.kron(seg, np.ones((2, 2, 2), np.int8))[:9, :13, :12]
    shape = _nnunet_shape(seg.shape, spacing, target)
    ours = resample_seg(seg, shape, spacing, target)
    theirs = resampling.resample_data_or_seg_to_shape(
        seg[None], shape, spacing, target, is_seg=True, order=1, order_z=0, force_separate_z=None
    )[0]
    np.testing.assert_array_equal(ours, theirs)


def test_export_resampling_matches_nnunet_order_1():
    """The export's rule (order 1, nearest along the thick axis), spacings swapped."""
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 6, 20, 22)).astype(np.float32)
    spacing, target = (5.0, 0.7, 0.7), (3.0, 0.9, 0.8)
    shape = _nnunet_shape(logits.shape[1:], spacing, target)
    ours = resample_image(logits, shape, spacing, target, order=1)
    theirs = resampling.resample_data_or_seg_to_shape(
        logits, shape, spacing, target, is_seg=False, order=1, order_z=0, force_separate_z=None
    )
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def _body_image():
    image = np.zeros((2, 8, 10, 10), np.float32)
    image[0, 1:7, 2:9, 1:9] = np.random.default_rng(3).normal(50, 10, size=(6, 7, 8))
    image[0, 3:5, 4:6, 4:6] = 0  # a hole inside the body
    image[1] = image[0] * 0.5 + 3 * (image[0] != 0)
    return image


def test_nonzero_mask_fills_holes_as_nnunet():
    image = _body_image()
    np.testing.assert_array_equal(nonzero_mask(image), cropping.create_nonzero_mask(image))


@pytest.mark.parametrize("use_mask", [True, False])
def test_zscore_matches_nnunet(use_mask):
    image = _body_image()
    image[:, 6, 9, 9] = 7.0  # the bounding box's corner, outside the body below
    seg = np.zeros(image.shape[1:], np.int16)
    seg[1, 9, 1] = 1  # a labelled voxel outside the nonzero region counts (seg >= 0)
    image, nn_seg, _ = cropping.crop_to_nonzero(image.copy(), seg[None].copy())
    assert (nn_seg == 1).sum() == 1 and (nn_seg < 0).any()
    ours = normalize(image, (ZSCORE, ZSCORE), (use_mask, use_mask), [{}, {}], nn_seg[0] > 0)
    for c in range(2):
        norm = schemes.ZScoreNormalization(use_mask_for_norm=use_mask, intensityproperties={})
        theirs = norm.run(image[c].copy(), nn_seg[0])
        np.testing.assert_allclose(ours[c], theirs, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        (NO_NORM, "NoNormalization"),
        (RESCALE_0_1, "RescaleTo01Normalization"),
        (RGB_0_1, "RGBTo01Normalization"),
        (CT, "CTNormalization"),
    ],
)
def test_other_schemes_match_nnunet(name, cls):
    image = np.random.default_rng(4).integers(0, 256, size=(1, 4, 6, 5)).astype(np.float32)
    props = {"mean": 100.0, "std": 40.0, "percentile_00_5": 10.0, "percentile_99_5": 240.0}
    ours = normalize(image, (name,), (False,), [props])
    theirs = getattr(schemes, cls)(use_mask_for_norm=False, intensityproperties=props).run(
        image[0].copy()
    )
    np.testing.assert_allclose(ours[0], theirs, atol=1e-6)


def test_rgb_scheme_rejects_values_outside_0_255():
    with pytest.raises(ValueError, match="RGBTo01Normalization"):
        normalize(np.full((1, 2, 2, 2), 300.0, np.float32), (RGB_0_1,), (False,), [{}])
