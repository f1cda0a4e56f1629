"""Per-case preprocessing operations: crop, normalisation rules, resampling geometry."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data.case_ops import (
    CT,
    ZSCORE,
    crop,
    nonzero_bbox,
    normalize,
    resample_image,
    resampled_shape,
)
from trainer.data.image_io import read_image, write_nifti


def test_nonzero_bbox_and_crop():
    image = np.zeros((2, 6, 7, 8), np.float32)
    image[0, 1:3, 2:5, 3] = 1.0
    image[1, 4, 6, 7] = -2.0  # any channel counts
    box = nonzero_bbox(image)
    assert box == [[1, 5], [2, 7], [3, 8]]
    assert crop(image, box).shape == (2, 4, 5, 5)
    assert nonzero_bbox(np.zeros((1, 3, 4, 5))) == [[0, 3], [0, 4], [0, 5]]


def test_zscore_with_mask_ignores_and_zeroes_the_outside():
    image = np.zeros((1, 4, 4, 4), np.float32)
    image[0, 1:3, 1:3, 1:3] = np.arange(8, dtype=np.float32).reshape(2, 2, 2) + 10
    out = normalize(image, (ZSCORE,), (True,), [{}])
    inside = out[0, 1:3, 1:3, 1:3]
    assert inside.mean() == pytest.approx(0, abs=1e-6) and inside.std() == pytest.approx(
        1, abs=1e-5
    )
    assert (out[0][image[0] == 0] == 0).all()
    plain = normalize(image, (ZSCORE,), (False,), [{}])
    assert plain.mean() == pytest.approx(0, abs=1e-6) and plain.std() == pytest.approx(1, abs=1e-5)


def test_ct_clips_to_foreground_percentiles_then_uses_foreground_stats():
    image = np.array([-2000, 0, 40, 3000], np.float32).reshape(1, 1, 1, 4)
    props = {"mean": 40.0, "std": 20.0, "percentile_00_5": -100.0, "percentile_99_5": 200.0}
    out = normalize(image, (CT,), (False,), [props])
    np.testing.assert_allclose(out.ravel(), [(-100 - 40) / 20, -2, 0, (200 - 40) / 20])


@pytest.mark.parametrize(
    ("shape", "spacing", "target", "expected"),
    [
        ((10, 20, 20), (2.0, 1.0, 1.0), (2.0, 1.0, 1.0), (10, 20, 20)),
        ((10, 20, 20), (3.0, 0.5, 0.5), (1.5, 1.0, 1.0), (20, 10, 10)),
        ((1, 5, 5), (1.0, 1.0, 1.0), (4.0, 4.0, 4.0), (1, 1, 1)),  # never below 1
    ],
)
def test_resampled_shape(shape, spacing, target, expected):
    assert resampled_shape(shape, spacing, target) == expected


def test_resampling_keeps_a_constant_image_and_the_geometry_centred():
    flat = np.full((1, 6, 8, 10), 3.5, np.float32)
    iso = ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    np.testing.assert_allclose(resample_image(flat, (12, 4, 5), *iso), 3.5, atol=1e-5)
    ramp = np.broadcast_to(np.arange(10, dtype=np.float32), (1, 4, 4, 10)).copy()
    up = resample_image(ramp, (4, 4, 20), *iso, order=1)
    # voxel centres: output i sits at input (i + 0.5) / 2 - 0.5
    np.testing.assert_allclose(up[0, 0, 0, 5:15], (np.arange(5, 15) + 0.5) / 2 - 0.5, atol=1e-5)


def test_nifti_round_trip_keeps_zyx_order_and_spacing(tmp_path):
    data = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    write_nifti(tmp_path / "a.nii.gz", data, (3.0, 0.5, 0.25))
    back, spacing = read_image(tmp_path / "a.nii.gz")
    np.testing.assert_array_equal(back, data)
    assert spacing == pytest.approx((3.0, 0.5, 0.25))


def test_write_array_fsyncs_the_data_before_the_rename(tmp_path, monkeypatch):
    import os

    from trainer.data import blosc_io

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    array = np.arange(2 * 5 * 6 * 7, dtype=np.float32).reshape(2, 5, 6, 7)
    path = tmp_path / "case.b2nd"
    blosc_io.write_array(path, array, (4, 4, 4))
    assert [kind for kind, _ in events] == ["fsync", "replace"]
    assert events[0][1] == events[1][1]  # the temporary file, flushed before it is renamed
    assert np.array_equal(blosc_io.open_array(path)[...], array)
    assert not list(tmp_path.glob(".*.tmp"))
