"""Demo data -> preprocessing -> one batch, and every integrity check of nnui-preprocess."""

from __future__ import annotations

import json
import shutil

import nibabel as nib
import numpy as np
import pytest
import torch

from trainer.data.case_ops import resample_seg
from trainer.data.dataset import PreprocessedCases
from trainer.data.image_io import read_image, write_nifti
from trainer.data.loader import PatchLoader
from trainer.demo import DEMO_DATASET, make_case, make_demo_dataset
from trainer.demo import main as demo_main
from trainer.planning import preprocess
from trainer.planning.plans import load_plans


def test_demo_is_deterministic_and_varied():
    a_img, a_seg, a_sp = make_case(0, 3)
    b_img, b_seg, b_sp = make_case(0, 3)
    assert np.array_equal(a_img, b_img) and np.array_equal(a_seg, b_seg) and a_sp == b_sp
    c_img, _, c_sp = make_case(1, 3)
    assert c_img.shape != a_img.shape or c_sp != a_sp
    assert 40 <= a_img.shape[0] <= 80 and all(60 <= n <= 110 for n in a_img.shape[1:])
    assert a_sp[0] > 2 * a_sp[1]  # anisotropic
    assert set(np.unique(a_seg)) == {0, 1, 2}
    assert (a_img[a_seg > 0] > 0).all() and (a_img == 0).any()  # zero background outside body


def test_demo_cli_writes_raw_layout(tmp_path, capsys):
    assert demo_main(["--cases", "2", "--out", str(tmp_path), "--shape-scale", "0.25"]) == 0
    folder = tmp_path / DEMO_DATASET
    meta = json.loads((folder / "dataset.json").read_text())
    assert meta["channel_names"] == {"0": "MRI"} and meta["numTraining"] == 2
    assert meta["labels"] == {"background": 0, "organ": 1, "lesion": 2}
    image, spacing = read_image(folder / "imagesTr" / "demo_001_0000.nii.gz")
    assert (folder / "labelsTr" / "demo_001.nii.gz").is_file()
    np.testing.assert_allclose(spacing, make_case(0, 1, 0.25)[2], rtol=1e-5)
    np.testing.assert_array_equal(image, make_case(0, 1, 0.25)[0])
    assert demo_main(["--cases", "0", "--out", str(tmp_path)]) == 2


def test_preprocessed_layout_and_contents(demo_preprocessed):
    folder = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    for name in ("nnuiPlans.json", "dataset.json", "nnui_fingerprint.json", "splits_final.json"):
        assert (folder / name).is_file(), name
    plans = load_plans(folder)
    assert plans.configuration("3d_fullres").patch_size == (16, 32, 32)
    assert plans.configuration("2d").batch_size == 4
    for config in plans.configurations.values():
        cases = PreprocessedCases(folder / config.data_identifier)
        assert cases.case_ids == [f"demo_{i:03d}" for i in range(6)]
        image, seg, props = cases.load_case(cases.case_ids[0])
        assert image.dtype == np.float32 and image.shape[0] == 1
        assert seg.shape == (1, *image.shape[1:]) == (1, *props["shape_after_resampling"])
        assert set(np.unique(seg)) <= {0, 1, 2}
        body = np.abs(image[0]) > 1e-3  # cubic resampling leaves ~1e-14 outside the body
        assert abs(image[0][body].mean()) < 0.2 and 0.7 < image[0][body].std() < 1.3
        for value, coords in props["class_locations"].items():
            coords = np.asarray(coords)
            num_voxels = int((seg[0] == int(value)).sum())
            assert len(coords) == preprocess.class_location_count(num_voxels)
            assert (seg[0][tuple(coords.T)] == int(value)).all()
        assert props["bbox_used_for_cropping"] and props["spacing_after_resampling"]


def test_one_batch_from_each_configuration(demo_preprocessed):
    folder = demo_preprocessed.preprocessed / demo_preprocessed.dataset_name
    plans = load_plans(folder)
    for config in plans.configurations.values():
        cases = PreprocessedCases(folder / config.data_identifier)
        with PatchLoader(
            cases,
            cases.case_ids,
            config.patch_size,
            config.batch_size,
            0.5,
            seed=1,
            rank=0,
            device=torch.device("cpu"),
            augment=True,
            num_workers=1,
        ) as loader:
            batch = next(loader)
        b = config.batch_size
        assert tuple(batch.data.shape) == (b, 1, *config.patch_size)
        assert tuple(batch.target.shape) == (b, 1, *config.patch_size)
        assert batch.data.dtype == torch.float32 and torch.isfinite(batch.data).all()


@pytest.mark.parametrize(
    ("shape_in", "shape_out"), [((9, 9, 9), (4, 5, 6)), ((4, 5, 6), (9, 11, 7))]
)
def test_resampling_never_invents_label_values(shape_in, shape_out):
    rng = np.random.default_rng(0)
    seg = rng.choice(np.array([0, 3, 7], np.uint8), size=shape_in)
    out = resample_seg(seg, shape_out, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    assert out.shape == shape_out and set(np.unique(out)) <= {0, 3, 7}


# ---- integrity checks -----------------------------------------------------------------


@pytest.fixture
def small_raw(tmp_path):
    root = tmp_path / "raw"
    make_demo_dataset(root, num_cases=2, seed=3, shape_scale=0.2)
    return root


def _break(folder, how):
    images, labels = folder / "imagesTr", folder / "labelsTr"
    image_path, label_path = images / "demo_001_0000.nii.gz", labels / "demo_001.nii.gz"
    image, spacing = read_image(image_path)
    seg, _ = read_image(label_path)
    meta = json.loads((folder / "dataset.json").read_text())
    if how == "missing_label":
        label_path.unlink()
    elif how == "missing_image":
        image_path.unlink()
    elif how == "shape":
        write_nifti(label_path, seg[:-1], spacing)
    elif how == "spacing":
        write_nifti(label_path, seg, (spacing[0] * 2, spacing[1], spacing[2]))
    elif how == "label_value":
        seg[0, 0, 0] = 5
        write_nifti(label_path, seg, spacing)
    elif how == "nan":
        image[1, 1, 1] = np.nan
        write_nifti(image_path, image, spacing)
    elif how == "channels":
        meta["channel_names"] = {"0": "MRI", "1": "T2"}
        (folder / "dataset.json").write_text(json.dumps(meta))
    elif how == "extra_channel":
        shutil.copy(image_path, images / "demo_001_0001.nii.gz")
    elif how == "unreadable":
        image_path.write_bytes(b"this is not a nifti file")
    elif how == "empty":
        shutil.rmtree(images)
        shutil.rmtree(labels)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing_label", "has no label"),
        ("missing_image", "has no image"),
        ("shape", "label shape"),
        ("spacing", "label spacing"),
        ("label_value", "label values [5] are not declared"),
        ("nan", "NaN or inf"),
        ("channels", "declares 2 channel"),
        ("extra_channel", "declares 1 channel"),
        ("unreadable", "cannot read"),
        ("empty", "is empty"),
    ],
)
@pytest.mark.parametrize("verify", [False, True])
def test_bad_input_is_one_error_line_and_exit_2(small_raw, tmp_path, capsys, how, message, verify):
    _break(small_raw / DEMO_DATASET, how)
    pre = tmp_path / "pre"
    argv = ["900", "--raw", str(small_raw), "--preprocessed", str(pre), "-np", "1"]
    assert preprocess.main(argv + (["--verify"] if verify else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (pre / DEMO_DATASET / "nnuiPlans.json").exists()


@pytest.mark.parametrize("dataset", ["901", "Dataset901_Nope", "abc"])
def test_unknown_dataset(small_raw, tmp_path, capsys, dataset):
    assert preprocess.main([dataset, "--raw", str(small_raw), "--preprocessed", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_npy_images_with_spacing_from_dataset_json(small_raw, tmp_path, capsys):
    folder = small_raw / DEMO_DATASET
    meta = json.loads((folder / "dataset.json").read_text())
    meta.update(file_ending=".npy", spacing=[2.0, 0.8, 0.8])
    for path in [*folder.glob("imagesTr/*.nii.gz"), *folder.glob("labelsTr/*.nii.gz")]:
        data = np.asarray(nib.load(str(path)).dataobj).transpose(2, 1, 0)
        np.save(path.with_name(path.name.replace(".nii.gz", ".npy")), data)
        path.unlink()
    (folder / "dataset.json").write_text(json.dumps(meta))
    assert preprocess.main(["900", "--raw", str(small_raw), "--verify", "-np", "1"]) == 0
    image, spacing = read_image(folder / "imagesTr" / "demo_000_0000.npy", (2.0, 0.8, 0.8))
    assert spacing == (2.0, 0.8, 0.8) and image.ndim == 3


def test_interrupted_run_never_looks_complete(small_raw, tmp_path, monkeypatch):
    pre = tmp_path / "pre"
    argv = ["900", "--raw", str(small_raw), "--preprocessed", str(pre), "-np", "1"]
    assert preprocess.main(argv) == 0
    assert (pre / DEMO_DATASET / "nnuiPlans.json").is_file()
    calls = []

    def crash_on_second(job):
        calls.append(job.case.case_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(job)

    real = preprocess.preprocess_case
    monkeypatch.setattr(preprocess, "preprocess_case", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        preprocess.main(argv)
    assert not (pre / DEMO_DATASET / "nnuiPlans.json").exists()
    assert not list((pre / DEMO_DATASET).rglob("*.tmp"))


def test_overrides_on_the_command_line(small_raw, tmp_path, capsys):
    pre = tmp_path / "pre"
    argv = [
        "900",
        "--raw",
        str(small_raw),
        "--preprocessed",
        str(pre),
        "-np",
        "1",
        "-c",
        "3d_fullres",
    ]
    assert preprocess.main([*argv, "--patch-size", "8", "16", "16", "--batch-size", "3"]) == 0
    config = load_plans(pre / DEMO_DATASET).configuration("3d_fullres")
    assert config.patch_size == (8, 16, 16) and config.batch_size == 3
    assert preprocess.main([*argv, "--patch-size", "9", "16", "16"]) == 2
    assert "not divisible" in capsys.readouterr().err


# ---- one configuration at a time -------------------------------------------------------


def _pre_argv(small_raw, pre, *extra):
    return ["900", "--raw", str(small_raw), "--preprocessed", str(pre), "-np", "1", *extra]


def test_preprocessing_one_configuration_keeps_the_others(small_raw, tmp_path, capsys):
    pre = tmp_path / "pre"
    plans_path = pre / DEMO_DATASET / "nnuiPlans.json"
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "3d_fullres")) == 0
    first = json.loads(plans_path.read_text())
    identity_3d = load_plans(pre / DEMO_DATASET).identity_of("3d_fullres")
    assert first["configurations"]["3d_fullres"]["case_ids"] == ["demo_000", "demo_001"]
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "2d", "--batch-size", "3")) == 0
    second = json.loads(plans_path.read_text())
    assert sorted(second["configurations"]) == ["2d", "3d_fullres"]
    assert second["configurations"]["3d_fullres"] == first["configurations"]["3d_fullres"]
    plans = load_plans(pre / DEMO_DATASET)
    assert plans.identity_of("3d_fullres") == identity_3d
    assert plans.configuration("2d").batch_size == 3
    for config in plans.configurations.values():  # both folders are complete
        cases = PreprocessedCases(pre / DEMO_DATASET / config.data_identifier)
        assert cases.case_ids == ["demo_000", "demo_001"] and cases.missing_case_ids() == []
    # Re-planning 2d again changes only 2d.
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "2d", "--batch-size", "2")) == 0
    third = load_plans(pre / DEMO_DATASET)
    assert third.identity_of("3d_fullres") == identity_3d
    assert third.identity_of("2d") != plans.identity_of("2d")


def test_changed_raw_data_drops_the_other_configurations(small_raw, tmp_path, capsys):
    pre = tmp_path / "pre"
    plans_path = pre / DEMO_DATASET / "nnuiPlans.json"
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "3d_fullres")) == 0
    data = json.loads(plans_path.read_text())  # as if the raw intensities had changed
    data["foreground_intensity_properties_per_channel"]["0"]["mean"] += 1.0
    plans_path.write_text(json.dumps(data))
    capsys.readouterr()
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "2d")) == 0
    assert "3d_fullres dropped from plans.json" in capsys.readouterr().out
    assert sorted(json.loads(plans_path.read_text())["configurations"]) == ["2d"]


def test_interrupted_run_of_one_configuration_keeps_the_others_listed(
    small_raw, tmp_path, monkeypatch
):
    pre = tmp_path / "pre"
    plans_path = pre / DEMO_DATASET / "nnuiPlans.json"
    assert preprocess.main(_pre_argv(small_raw, pre, "-c", "3d_fullres")) == 0

    def crash(job):
        raise KeyboardInterrupt

    monkeypatch.setattr(preprocess, "preprocess_case", crash)
    with pytest.raises(KeyboardInterrupt):
        preprocess.main(_pre_argv(small_raw, pre, "-c", "2d"))
    assert sorted(json.loads(plans_path.read_text())["configurations"]) == ["3d_fullres"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--patch-size", "0", "0", "0"], "every size must be >= 1"),
        (["--patch-size", "-8", "16", "16"], "every size must be >= 1"),
        (["--patch-size", "16", "0"], "every size must be >= 1"),
        (["--patch-size", "9", "16", "16"], "not divisible"),
        (["--batch-size", "0"], "N >= 1"),
        (["--batch-size", "-2"], "N >= 1"),
        (["--batch-size", "3d_fullres=0"], "N >= 1"),
        (["--batch-size", "x"], "N >= 1"),
    ],
)
def test_bad_sizes_are_one_error_line(small_raw, tmp_path, capsys, extra, message):
    pre = tmp_path / "pre"
    assert preprocess.main(_pre_argv(small_raw, pre, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (pre / DEMO_DATASET / "nnuiPlans.json").exists()
