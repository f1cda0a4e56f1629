"""Inference geometry without a network: the preprocessing of one raw case equals
training's, and predictions come back in the raw image's exact geometry."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from trainer.inference.cases import InputCase, InputError, list_input_cases, select_part
from trainer.inference.export import to_raw_geometry, write_prediction
from trainer.inference.prepare import prepare_case
from trainer.planning.plans import ConfigurationPlan, NetworkPlan, Plans

# Stored (x, y, z): odd sizes; read as (z, y, x) = (11, 19, 23).
RAW_XYZ = (23, 19, 11)
SPACING_XYZ = (0.7, 0.9, 2.5)


def _affine() -> np.ndarray:
    """Rotated 30 degrees in-plane, axes flipped, anisotropic voxels, shifted origin."""
    angle = np.deg2rad(30)
    rotation = np.array(
        [[np.cos(angle), -np.sin(angle), 0], [np.sin(angle), np.cos(angle), 0], [0, 0, -1]]
    )
    affine = np.eye(4)
    affine[:3, :3] = rotation @ np.diag(SPACING_XYZ) @ np.diag([-1, 1, 1])
    affine[:3, 3] = (12.5, -40.0, 7.25)
    return affine


def _write_case(folder: Path) -> tuple[Path, np.ndarray]:
    """A body (non-zero) in a sub-box, a ball of label 1 in it; returns (image, label zyx)."""
    rng = np.random.default_rng(3)
    x, y, z = np.meshgrid(*[np.arange(n) for n in RAW_XYZ], indexing="ij")
    body = (x >= 3) & (x < 20) & (y >= 2) & (y < 17) & (z >= 1) & (z < 10)
    ball = ((x - 12) / 4.5) ** 2 + ((y - 8) / 4.0) ** 2 + ((z - 5) / 2.2) ** 2 <= 1
    image = np.where(body, 100 + rng.normal(0, 3, RAW_XYZ), 0).astype(np.float32)
    image[ball & body] = 300
    nifti = nib.Nifti1Image(image, _affine())
    nifti.set_qform(_affine(), 1)
    nifti.set_sform(_affine(), 2)
    path = folder / "geo_0000.nii.gz"
    nib.save(nifti, str(path))
    return path, (ball & body).astype(np.uint8).transpose(2, 1, 0)


def _plans() -> tuple[Plans, ConfigurationPlan]:
    network = NetworkPlan((4,), ((3, 3, 3),), ((1, 1, 1),), (1,), ())
    cplan = ConfigurationPlan(
        "3d_fullres", "nnuiPlans_3d_fullres", (8, 8, 8), 2, (1.4, 0.8, 0.8),
        ("ZScoreNormalization",), (False,), network,
    )  # fmt: skip
    plans = Plans("Dataset901_Geo", "nnuiPlans", {"3d_fullres": cplan}, 1,
                  {"background": 0, "ball": 1}, "")  # fmt: skip
    return plans, cplan


def _threshold_probabilities(data: np.ndarray, raw_image: np.ndarray, bbox) -> np.ndarray:
    """One-hot 'prediction' of the ball: normalised intensity above the body/ball midpoint."""
    cropped = raw_image[tuple(slice(lo, hi) for lo, hi in bbox)]
    midpoint = (200 - cropped.mean()) / cropped.std()
    ball = (data[0] > midpoint).astype(np.float32)
    return np.stack([1 - ball, ball])


def test_round_trip_keeps_shape_affine_and_label_position(tmp_path):
    image_path, label = _write_case(tmp_path)
    plans, cplan = _plans()
    case = InputCase("geo", (image_path,), ".nii.gz")
    prepared = prepare_case(case, plans, cplan)
    props = prepared.properties
    assert props["bbox_used_for_cropping"] == [[1, 10], [2, 17], [3, 20]]
    assert props["shape_after_resampling"] != props["shape_after_cropping_and_before_resampling"]
    raw = np.asarray(nib.load(str(image_path)).dataobj).transpose(2, 1, 0)
    probs = _threshold_probabilities(prepared.data, raw, props["bbox_used_for_cropping"])
    result = to_raw_geometry(probs, props, [0, 1], keep_probabilities=True)

    assert result.segmentation.shape == label.shape
    assert result.probabilities.shape == (2, *label.shape)
    assert result.probabilities.dtype == np.float32
    np.testing.assert_allclose(result.probabilities.sum(0), 1.0, atol=1e-5)
    np.testing.assert_array_equal(result.probabilities.argmax(0), result.segmentation)
    assert result.probabilities[0, 0].min() == 1.0  # z = 0 lies outside the crop
    seg = result.segmentation
    dice = 2 * np.sum((seg == 1) & (label == 1)) / (np.sum(seg == 1) + np.sum(label == 1))
    assert dice > 0.9
    centre = np.argwhere(label == 1).mean(0)
    np.testing.assert_allclose(np.argwhere(seg == 1).mean(0), centre, atol=0.5)

    out = tmp_path / "out"
    out.mkdir()
    write_prediction(out, "geo", result, image_path, ".nii.gz")
    written, source = nib.load(str(out / "geo.nii.gz")), nib.load(str(image_path))
    assert written.shape == source.shape == RAW_XYZ
    np.testing.assert_array_equal(written.affine, source.affine)
    for key in ("qform_code", "sform_code", "pixdim", "srow_x", "srow_y", "srow_z"):
        np.testing.assert_array_equal(written.header[key], source.header[key])
    assert nib.aff2axcodes(written.affine) == nib.aff2axcodes(source.affine)
    assert written.get_data_dtype() == np.uint8
    np.testing.assert_array_equal(np.asarray(written.dataobj).transpose(2, 1, 0), seg)
    with np.load(out / "geo.npz") as archive:
        np.testing.assert_array_equal(archive["probabilities"], result.probabilities)
    assert sorted(p.name for p in out.iterdir()) == ["geo.nii.gz", "geo.npz"]  # no tmp left


def test_prepare_case_equals_training_preprocessing(demo_preprocessed):
    """nnui-predict sees exactly the arrays training saw (same crop, norm and resampling)."""
    from trainer.data.blosc_io import open_array
    from trainer.planning.plans import load_plans

    dataset = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    plans = load_plans(dataset)
    images = demo_preprocessed.raw / demo_preprocessed.dataset_name / "imagesTr"
    case = list_input_cases(images, 1)[1]
    for name in ("3d_fullres", "2d"):
        cplan = plans.configuration(name)
        prepared = prepare_case(case, plans, cplan)
        folder = dataset / cplan.data_identifier
        stored = json.loads((folder / f"{case.case_id}.json").read_text())
        for key, value in prepared.properties.items():
            assert stored[key] == value, key
        np.testing.assert_array_equal(
            prepared.data, open_array(folder / f"{case.case_id}.b2nd")[...]
        )


def test_resampling_back_is_linear_in_log_space_as_nnunets_logits():
    """The argmax of nnU-Net's rule (logits resampled linearly; log p is the logits minus
    one term per voxel) on probabilities where resampling the probabilities themselves
    would give other labels; the probabilities still sum to 1."""
    from trainer.data.case_ops import resample_image

    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(3, 4, 9, 11)).astype(np.float32)
    probs = np.exp(logits - logits.max(0))
    probs /= probs.sum(0)
    cropped = (3, 6, 8)
    props = {
        "shape_after_cropping_and_before_resampling": list(cropped),
        "shape_before_cropping": [5, 8, 10],
        "bbox_used_for_cropping": [[1, 4], [1, 7], [2, 10]],
        "spacing": [4.0, 1.0, 1.0],
        "spacing_after_resampling": [3.0, 1.5, 1.375],
    }
    spacings = (props["spacing_after_resampling"], props["spacing"])
    nnunet_labels = resample_image(logits, cropped, *spacings, order=1).argmax(0)
    blurred_labels = resample_image(probs, cropped, *spacings, order=1).argmax(0)
    assert (nnunet_labels != blurred_labels).any()  # the two rules disagree on this input

    result = to_raw_geometry(probs, props, [0, 1, 2], keep_probabilities=True)
    region = (slice(1, 4), slice(1, 7), slice(2, 10))
    np.testing.assert_array_equal(result.segmentation[region], nnunet_labels)
    np.testing.assert_allclose(result.probabilities.sum(0), 1.0, atol=1e-5)
    assert (result.segmentation[0] == 0).all()  # outside the crop


@pytest.mark.parametrize("configuration", ["3d_fullres", "2d"])
def test_reference_labels_come_back_from_the_preprocessed_geometry(
    demo_preprocessed, configuration
):
    """to_raw_geometry with CASE.json (what final validation holds): the preprocessed
    label, one-hot, lands on the raw label file."""
    from trainer.data.blosc_io import open_array
    from trainer.data.image_io import read_image
    from trainer.planning.plans import load_plans

    dataset = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    folder = dataset / load_plans(dataset).configuration(configuration).data_identifier
    case_id = "demo_002"
    props = json.loads((folder / f"{case_id}.json").read_text())
    seg = np.maximum(open_array(folder / f"{case_id}_seg.b2nd")[0], 0)
    one_hot = np.stack([(seg == k).astype(np.float32) for k in range(3)])
    result = to_raw_geometry(one_hot, props, [0, 1, 2])
    labels = demo_preprocessed.raw / demo_preprocessed.dataset_name / "labelsTr"
    reference = read_image(labels / f"{case_id}.nii.gz")[0]
    assert result.segmentation.shape == reference.shape
    # Two resamplings blur small structures: the organ must match closely, the lesion
    # (some 20 voxels here) must sit where it was.
    for label, min_dice in ((1, 0.9), (2, 0.5)):
        pred, ref = result.segmentation == label, reference == label
        assert 2 * np.sum(pred & ref) / (pred.sum() + ref.sum()) > min_dice, label
        np.testing.assert_allclose(np.argwhere(pred).mean(0), np.argwhere(ref).mean(0), atol=1.0)


def test_input_listing_and_parts(tmp_path):
    for case in ("b", "a", "c"):
        for channel in (0, 1):
            (tmp_path / f"{case}_{channel:04d}.nii.gz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("ignored")
    cases = list_input_cases(tmp_path, 2)
    assert [c.case_id for c in cases] == ["a", "b", "c"]
    assert [p.name for p in cases[0].image_files] == ["a_0000.nii.gz", "a_0001.nii.gz"]
    with pytest.raises(InputError, match="extra: 0001"):
        list_input_cases(tmp_path, 1)
    with pytest.raises(InputError, match="a_0002 is missing"):
        list_input_cases(tmp_path, 3)


@pytest.mark.parametrize("num_cases", [1, 5, 7, 12])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
def test_parts_are_disjoint_and_complete(num_cases, num_parts):
    cases = [f"case_{i}" for i in range(num_cases)]
    parts = [select_part(cases, num_parts, k) for k in range(num_parts)]
    flat = [c for part in parts for c in part]
    assert sorted(flat) == sorted(cases) and len(flat) == len(set(flat))
    with pytest.raises(InputError):
        select_part(cases, num_parts, num_parts)
