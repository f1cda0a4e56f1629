"""A generated anisotropic CT case preprocessed by nnU-Net 2.8.1's DefaultPreprocessor and
by nnui with the same plans (spacing, patch, CT normalisation, intensity properties) gives
the same stored arrays (issue 32 item 2: >= 99.5 % of label voxels equal, data correlation
>= 0.999; in practice they agree to float rounding)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data.blosc_io import open_array
from trainer.data.image_io import write_nifti
from trainer.data.raw import RawCase
from trainer.planning.fingerprint import foreground_samples, intensity_properties
from trainer.planning.preprocess import CaseJob, preprocess_case

preprocessors = pytest.importorskip("nnunetv2.preprocessing.preprocessors.default_preprocessor")
plans_handler = pytest.importorskip("nnunetv2.utilities.plans_handling.plans_handler")

SPACING = (5.0, 0.78, 0.78)  # z, y, x: thick slices
LABELS = {"background": 0, "organ": 1, "lesion": 2}


def _ct_case(tmp_path):
    """A body of soft tissue in air, an organ and a lesion, a zero frame around the field of
    view (cropped away), noise; written as NIfTI."""
    rng = np.random.default_rng(0)
    z, y, x = np.meshgrid(np.arange(22), np.arange(96), np.arange(88), indexing="ij")
    image = np.full(z.shape, -1000.0)
    body = ((y - 48) / 40) ** 2 + ((x - 44) / 34) ** 2 < 1
    organ = ((y - 40) / 14) ** 2 + ((x - 50) / 12) ** 2 + ((z - 11) / 6) ** 2 < 1
    lesion = ((y - 58) / 4) ** 2 + ((x - 30) / 4) ** 2 + ((z - 9) / 1.2) ** 2 < 1
    image[body] = 40.0
    image[organ] = 90.0
    image[lesion] = 160.0
    image += rng.normal(0, 15, image.shape)
    image[:, :4], image[:, :, -3:] = 0.0, 0.0  # outside the field of view
    seg = np.zeros(image.shape, np.uint8)
    seg[organ], seg[lesion] = 1, 2
    seg[:, :4], seg[:, :, -3:] = 0, 0
    image_file, label_file = tmp_path / "ct_0000.nii.gz", tmp_path / "ct.nii.gz"
    write_nifti(image_file, image.astype(np.float32), SPACING)
    write_nifti(label_file, seg, SPACING)
    props = intensity_properties(foreground_samples(image[None], seg, 10_000)[0])
    return RawCase("ct", (image_file,), label_file), props


def _mr_case(tmp_path):
    """Two MR-like channels of a head in zero background (z-scored over the body), a dark
    hole inside it that is zero in both channels (filled into the body), two labels."""
    rng = np.random.default_rng(1)
    z, y, x = np.meshgrid(np.arange(36), np.arange(44), np.arange(40), indexing="ij")
    head = ((z - 18) / 15) ** 2 + ((y - 22) / 19) ** 2 + ((x - 20) / 16) ** 2 < 1
    tumour = ((z - 14) / 4) ** 2 + ((y - 18) / 5) ** 2 + ((x - 24) / 4) ** 2 < 1
    edema = (((z - 14) / 7) ** 2 + ((y - 18) / 8) ** 2 + ((x - 24) / 7) ** 2 < 1) & ~tumour
    hole = ((z - 22) / 3) ** 2 + ((y - 28) / 3) ** 2 + ((x - 14) / 3) ** 2 < 1
    files = []
    for c, (body, lesion) in enumerate(((600.0, 900.0), (300.0, 150.0))):
        image = np.where(head, body + rng.normal(0, 40, head.shape), 0.0)
        image[tumour | edema] = lesion + rng.normal(0, 40, int((tumour | edema).sum()))
        image[hole] = 0.0
        files.append(tmp_path / f"mr_{c:04d}.nii.gz")
        write_nifti(files[-1], image.astype(np.float32), (1.0, 1.0, 1.0))
    seg = np.zeros(head.shape, np.uint8)
    seg[edema], seg[tumour] = 1, 2
    write_nifti(tmp_path / "mr.nii.gz", seg, (1.0, 1.0, 1.0))
    return RawCase("mr", tuple(files), tmp_path / "mr.nii.gz")


def _rgb_case(tmp_path):
    """An RGB photo as three one-slice channels (z spacing 999, as nnU-Net's natural
    images), vessel-like lines labelled 1."""
    rng = np.random.default_rng(2)
    y, x = np.meshgrid(np.arange(90), np.arange(110), indexing="ij")
    vessels = (np.abs(np.sin(x / 9.0) * 20 + 45 - y) < 2) | (np.abs(x - 0.8 * y - 20) < 1.5)
    files = []
    for c, (tissue, vessel) in enumerate(((200, 90), (120, 30), (90, 40))):
        image = np.where(vessels, vessel, tissue) + rng.normal(0, 10, vessels.shape)
        files.append(tmp_path / f"rgb_{c:04d}.nii.gz")
        write_nifti(files[-1], np.clip(image, 0, 255).astype(np.float32)[None], (999.0, 1, 1))
    write_nifti(tmp_path / "rgb.nii.gz", vessels.astype(np.uint8)[None], (999.0, 1.0, 1.0))
    return RawCase("rgb", tuple(files), tmp_path / "rgb.nii.gz")


def _nnunet_plans(
    target, patch, props, schemes=("CTNormalization",), use_mask=(False,), name="3d_fullres"
) -> dict:
    resampling = {"is_seg": False, "order": 3, "order_z": 0, "force_separate_z": None}
    config = {
        "data_identifier": "nnUNetPlans_3d_fullres",
        "preprocessor_name": "DefaultPreprocessor",
        "batch_size": 2,
        "patch_size": list(patch),
        "median_image_size_in_voxels": [22, 96, 88],
        "spacing": list(target[1:] if name == "2d" else target),
        "normalization_schemes": list(schemes),
        "use_mask_for_norm": list(use_mask),
        "resampling_fn_data": "resample_data_or_seg_to_shape",
        "resampling_fn_seg": "resample_data_or_seg_to_shape",
        "resampling_fn_data_kwargs": resampling,
        "resampling_fn_seg_kwargs": {**resampling, "is_seg": True, "order": 1},
        "resampling_fn_probabilities": "resample_data_or_seg_to_shape",
        "resampling_fn_probabilities_kwargs": {**resampling, "order": 1},
        "batch_dice": False,
        # the preprocessor never reads it; ConfigurationManager needs one
        "architecture": {
            "network_class_name": "unused",
            "arch_kwargs": {},
            "_kw_requires_import": [],
        },
    }
    return {
        "dataset_name": "Dataset990_CT",
        "plans_name": "nnUNetPlans",
        "original_median_spacing_after_transp": list(SPACING),
        "original_median_shape_after_transp": [22, 96, 88],
        "image_reader_writer": "SimpleITKIO",
        "transpose_forward": [0, 1, 2],
        "transpose_backward": [0, 1, 2],
        "configurations": {name: config},
        "experiment_planner_used": "by hand",
        "label_manager": "LabelManager",
        "foreground_intensity_properties_per_channel": {str(c): p for c, p in enumerate(props)},
    }


def _nnui_preprocess(
    case, target, patch, props, folder, schemes=("CTNormalization",), use_mask=(False,),
    name="3d_fullres",
):  # fmt: skip
    """nnui's preprocessing of one case for one configuration (the one place to switch)."""
    config = {
        "name": name,
        "folder": str(folder),
        "spacing": list(target),
        "patch_size": list(patch),
        "schemes": tuple(schemes),
        "use_mask": tuple(use_mask),
    }
    folder.mkdir()
    preprocess_case(CaseJob(case, LABELS, None, list(props), (config,)))
    data = open_array(folder / f"{case.case_id}.b2nd")[...]
    seg = open_array(folder / f"{case.case_id}_seg.b2nd")[0]
    return data, seg, json.loads((folder / f"{case.case_id}.json").read_text())


def _nnunet_preprocess(case, plans_dict, channel_names, name="3d_fullres"):
    plans = plans_handler.PlansManager(plans_dict)
    dataset_json = {"labels": LABELS, "channel_names": channel_names, "file_ending": ".nii.gz"}
    return preprocessors.DefaultPreprocessor(verbose=False).run_case(
        [str(p) for p in case.image_files],
        str(case.label_file),
        plans,
        plans.get_configuration(name),
        dataset_json,
    )


@pytest.mark.parametrize(
    "target",
    [(5.0, 1.0, 1.0), (4.0, 0.9, 0.9), (2.5, 0.78, 0.78)],
    ids=["in-plane", "z-nearest-down", "z-nearest-up"],
)
def test_anisotropic_ct_preprocessing_matches_nnunet(tmp_path, target):
    case, props = _ct_case(tmp_path)
    patch = (16, 64, 64)
    plans = _nnunet_plans(target, patch, [props])
    data_nn, seg_nn, props_nn = _nnunet_preprocess(case, plans, {"0": "CT"})
    data, seg, ours = _nnui_preprocess(case, target, patch, [props], tmp_path / "nnui")

    assert data.shape == data_nn.shape and seg.shape == seg_nn.shape[1:]
    assert ours["bbox_used_for_cropping"] == [list(b) for b in props_nn["bbox_used_for_cropping"]]
    labels_nn = np.maximum(seg_nn[0], 0)  # nnU-Net's -1 (outside the body) is background
    assert (seg == labels_nn).mean() >= 0.995
    assert np.corrcoef(data.ravel(), data_nn.ravel())[0, 1] >= 0.999
    # what this test measures in fact: equal up to float rounding
    np.testing.assert_array_equal(seg, labels_nn)
    np.testing.assert_allclose(data, data_nn, atol=1e-4)
    for label in ("1", "2"):
        assert len(ours["class_locations"][label]) == len(props_nn["class_locations"][int(label)])


@pytest.mark.parametrize("target", [(1.0, 1.0, 1.0), (1.3, 1.2, 0.9)], ids=["same", "resampled"])
def test_isotropic_two_channel_mr_preprocessing_matches_nnunet(tmp_path, target):
    """z-score over the hole-filled body, both channels, isotropic resampling."""
    case = _mr_case(tmp_path)
    schemes, use_mask, patch = ("ZScoreNormalization",) * 2, (True, True), (32, 32, 32)
    plans = _nnunet_plans(target, patch, [{}, {}], schemes, use_mask)
    data_nn, seg_nn, _ = _nnunet_preprocess(case, plans, {"0": "T1", "1": "T2"})
    folder = tmp_path / "nnui"
    data, seg, _ = _nnui_preprocess(case, target, patch, [{}, {}], folder, schemes, use_mask)
    assert data.shape == data_nn.shape
    np.testing.assert_array_equal(seg, np.maximum(seg_nn[0], 0))
    np.testing.assert_allclose(data, data_nn, atol=1e-4)


def test_rgb_photo_2d_preprocessing_matches_nnunet(tmp_path):
    """rgb_to_0_1 on three channels, the 2d configuration resampling in-plane only."""
    case = _rgb_case(tmp_path)
    schemes, use_mask, patch = ("RGBTo01Normalization",) * 3, (False,) * 3, (64, 64)
    target = (999.0, 0.8, 0.7)
    plans = _nnunet_plans(target, patch, [{}] * 3, schemes, use_mask, "2d")
    names = {"0": "R", "1": "G", "2": "B"}
    data_nn, seg_nn, _ = _nnunet_preprocess(case, plans, names, "2d")
    folder = tmp_path / "nnui"
    data, seg, _ = _nnui_preprocess(case, target, patch, [{}] * 3, folder, schemes, use_mask, "2d")
    assert data.shape == data_nn.shape == (3, 1, 112, 157)
    np.testing.assert_array_equal(seg, np.maximum(seg_nn[0], 0))
    np.testing.assert_allclose(data, data_nn, atol=1e-5)


@pytest.mark.parametrize("kind", ["ct", "mr"])
def test_prediction_preprocessing_matches_nnunet_without_labels(tmp_path, kind):
    """nnui-predict's preparation of a case (no label: the body is the hole-filled nonzero
    region) against nnU-Net's preprocessor given no segmentation."""
    from types import SimpleNamespace

    from trainer.inference.cases import InputCase
    from trainer.inference.prepare import prepare_case

    if kind == "ct":
        case, props = _ct_case(tmp_path)
        props, schemes, use_mask, names = [props], ("CTNormalization",), (False,), {"0": "CT"}
        target = (4.0, 0.9, 0.9)
    else:
        case = _mr_case(tmp_path)
        props, schemes, use_mask = [{}, {}], ("ZScoreNormalization",) * 2, (True, True)
        names, target = {"0": "T1", "1": "T2"}, (1.3, 1.2, 0.9)
    plans = plans_handler.PlansManager(
        _nnunet_plans(target, (16, 32, 32), props, schemes, use_mask)
    )
    data_nn, _, props_nn = preprocessors.DefaultPreprocessor(verbose=False).run_case(
        [str(p) for p in case.image_files],
        None,
        plans,
        plans.get_configuration("3d_fullres"),
        {"labels": LABELS, "channel_names": names, "file_ending": ".nii.gz"},
    )
    ours = prepare_case(
        InputCase(case.case_id, case.image_files, ".nii.gz"),
        SimpleNamespace(
            num_input_channels=len(props),
            foreground_intensity_properties={str(c): p for c, p in enumerate(props)},
            transpose=((0, 1, 2), (0, 1, 2)),  # nnU-Net's plans here keep the axis order
        ),
        SimpleNamespace(
            name="3d_fullres",
            spacing=target,
            normalization_schemes=schemes,
            use_mask_for_norm=use_mask,
        ),
    )
    assert ours.properties["bbox_used_for_cropping"] == [
        list(b) for b in props_nn["bbox_used_for_cropping"]
    ]
    np.testing.assert_allclose(ours.data, data_nn, atol=1e-4)
