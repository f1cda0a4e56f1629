"""Every image format nnU-Net 2.8.1 reads (issue 25 item 3), chosen by dataset.json's
file_ending: a tiny NIfTI dataset converted to each other format (SimpleITK, Pillow,
tifffile) reads as nnU-Net's own readers read it, preprocesses to the same arrays and
spacing, and predicts the same labels with one seeded checkpoint; predictions, the final
validation and the ensemble are written in the input's format and geometry; bad input is
one `error:` line, exit 2, with nothing preprocessed overwritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainer.data.image_io import read_case, read_image, read_labels, write_nifti
from trainer.demo import DEMO_DATASET, make_case
from trainer.evaluation.evaluate import evaluate_folders
from trainer.inference.predict import main as predict_main
from trainer.planning.preprocess import main as preprocess_main
from trainer.schema.tree import DEFAULT_PLANS, VALIDATION_DIR, checkpoint_file, run_dir

NUM_CASES = 3
SPACING_3D = (2.5, 0.75, 0.75)  # one spacing for all cases: .npy/.npz take it from dataset.json
PATCH = {"3d_fullres": (8, 16, 16), "2d": (16, 16)}
BATCH = {"3d_fullres": 2, "2d": 2}
FORMATS_3D = (".nrrd", ".mha", ".mhd", ".gipl", ".tif", ".npy", ".npz")
FORMATS_2D = (".png", ".bmp", ".tif")
# A geometry NIfTI's diagonal affine cannot hold: the .mha carries it into its predictions.
MHA_ORIGIN = (12.5, -30.0, 7.25)
MHA_DIRECTION = (0.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0)


# ---- datasets ---------------------------------------------------------------------------


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=1) + "\n")


def _dataset_json(num_channels: int, ending: str, **extra) -> dict:
    return {"channel_names": {str(c): f"c{c}" for c in range(num_channels)},
            "labels": {"background": 0, "organ": 1, "lesion": 2}, "numTraining": NUM_CASES,
            "file_ending": ending, **extra}  # fmt: skip


def make_nifti_3d(root: Path) -> Path:
    folder = root / DEMO_DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
    for index in range(NUM_CASES):
        image, label, _ = make_case(7, index, shape_scale=0.22)
        write_nifti(folder / "imagesTr" / f"case{index}_0000.nii.gz", image, SPACING_3D)
        write_nifti(folder / "labelsTr" / f"case{index}.nii.gz", label, SPACING_3D)
    # "spacing" is for .npy/.npz only: the conversions' predictions read it from here.
    _write_json(folder / "dataset.json", _dataset_json(1, ".nii.gz", spacing=list(SPACING_3D)))
    return folder


def make_nifti_rgb(root: Path) -> Path:
    """2D photos as nnU-Net keeps them in NIfTI: (1, Y, X) slices at (999, 1, 1), one file
    per colour channel, uint8 values (so PNG/BMP hold them exactly)."""
    folder = root / DEMO_DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
    for index in range(NUM_CASES):
        image, label, _ = make_case(11, index, shape_scale=0.4)
        plane, seg = image[image.shape[0] // 2], label[label.shape[0] // 2]
        for channel, scale in enumerate((1.0, 0.7, 0.4)):
            rgb = np.clip(plane * scale, 0, 255).astype(np.uint8)[None]
            path = folder / "imagesTr" / f"case{index}_{channel:04d}.nii.gz"
            write_nifti(path, rgb, (999.0, 1.0, 1.0))
        write_nifti(folder / "labelsTr" / f"case{index}.nii.gz", seg[None], (999.0, 1.0, 1.0))
    _write_json(folder / "dataset.json", _dataset_json(3, ".nii.gz"))
    return folder


def _convert_volume(source: Path, target: Path, ending: str, channel_file: bool) -> None:
    import SimpleITK as sitk
    import tifffile

    data, spacing = read_image(source)
    stem = target.name
    if ending in (".nrrd", ".mha", ".mhd", ".gipl"):
        image = sitk.ReadImage(str(source))
        if ending == ".mha":
            image.SetOrigin(MHA_ORIGIN)
            image.SetDirection(MHA_DIRECTION)
        sitk.WriteImage(image, str(target.with_name(stem + ending)), True)
    elif ending == ".tif":
        tifffile.imwrite(target.with_name(stem + ending), data, photometric="minisblack")
        case = stem.rsplit("_", 1)[0] if channel_file else stem
        _write_json(target.with_name(f"{case}.json"), {"spacing": list(spacing)})
    elif ending == ".npy":
        np.save(target.with_name(stem + ending), data)
    else:
        np.savez_compressed(target.with_name(stem + ending), data=data)


def convert_3d(nifti: Path, root: Path, ending: str) -> Path:
    folder = root / DEMO_DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
        for source in sorted((nifti / sub).glob("*.nii.gz")):
            stem = source.name[: -len(".nii.gz")]
            _convert_volume(source, folder / sub / stem, ending, sub == "imagesTr")
    extra = {"spacing": list(SPACING_3D)} if ending in (".npy", ".npz") else {}
    _write_json(folder / "dataset.json", _dataset_json(1, ending, **extra))
    return folder


def convert_rgb(nifti: Path, root: Path, ending: str) -> Path:
    """One RGB file per case (natural-image layout) and a grey label file."""
    import tifffile
    from PIL import Image

    folder = root / DEMO_DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True)
    for index in range(NUM_CASES):
        image, _ = read_case([nifti / "imagesTr" / f"case{index}_{c:04d}.nii.gz" for c in range(3)])
        rgb = np.moveaxis(image[:, 0].astype(np.uint8), 0, -1)
        seg = read_labels(nifti / "labelsTr" / f"case{index}.nii.gz")[0]
        for array, path in ((rgb, folder / "imagesTr" / f"case{index}_0000{ending}"),
                            (seg, folder / "labelsTr" / f"case{index}{ending}")):  # fmt: skip
            if ending == ".tif":
                tifffile.imwrite(path, array)
            else:
                Image.fromarray(array).save(path)
    _write_json(folder / "dataset.json", _dataset_json(3, ending))
    return folder


def preprocess(raw_root: Path, pre_root: Path, config: str) -> int:
    """The one place this file preprocesses (a CPU-sized patch, a small batch)."""
    return preprocess_main(["900", "--raw", str(raw_root), "--preprocessed", str(pre_root),
                            "-pl", "nnuiCPUPlanner", "-overwrite_plans_name", "nnuiPlans",
                            "-np", "1", "-c", config, "--patch-size", *map(str, PATCH[config]),
                            "--batch-size", str(BATCH[config])])  # fmt: skip


def write_checkpoint(pre_root: Path, results: Path, configuration: str, fold: str) -> None:
    """checkpoint_final of a seeded (untrained) network, as training stores it."""
    import torch

    from trainer.checkpoint import store
    from trainer.network.build import build_network
    from trainer.planning.plans import load_plans

    plans = load_plans(pre_root / DEMO_DATASET)
    cplan = plans.configuration(configuration)
    torch.manual_seed(int(fold) + 3)
    model = build_network(cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim)
    run = run_dir(results, DEMO_DATASET, configuration, fold)
    run.mkdir(parents=True, exist_ok=True)
    identity = {"dataset_name": DEMO_DATASET, "configuration": configuration,
                "plans_name": DEFAULT_PLANS,
                "plans_identity": plans.identity_of(configuration), "fold": fold}  # fmt: skip
    metadata = {"kind": "final", "epoch_next": 1, "identity": identity}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    store.save(run / checkpoint_file("final"), model, optimizer, None, metadata)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The two NIfTI originals (3D volumes, RGB photos), each preprocessed, with seeded
    checkpoints (3D: 3d_fullres folds 0 and 1; photos: 2d fold 0)."""
    base = tmp_path_factory.mktemp("formats")
    out = {"base": base}
    for kind, make, config in (("3d", make_nifti_3d, "3d_fullres"),
                               ("rgb", make_nifti_rgb, "2d")):  # fmt: skip
        raw, pre, results = base / f"raw_{kind}", base / f"pre_{kind}", base / f"results_{kind}"
        folder = make(raw)
        assert preprocess(raw, pre, config) == 0
        for fold in ("0", "1") if kind == "3d" else ("0",):
            write_checkpoint(pre, results, config, fold)
        out[kind] = {"raw": raw, "folder": folder, "pre": pre, "results": results,
                     "config": config, "predicted": base / f"predicted_{kind}"}  # fmt: skip
        assert predict(out, kind, folder / "imagesTr", out[kind]["predicted"]) == 0
    return out


def converted(world, kind: str, ending: str) -> tuple[Path, Path]:
    """(raw root, dataset folder) of the original converted to `ending` (made once)."""
    raw = world["base"] / f"raw_{kind}{ending.replace('.', '_')}"
    if not raw.exists():
        convert = convert_3d if kind == "3d" else convert_rgb
        convert(world[kind]["folder"], raw, ending)
    return raw, raw / DEMO_DATASET


def predict(world, kind: str, images: Path, out: Path, *extra: str) -> int:
    side = world[kind]
    argv = ["-i", str(images), "-o", str(out), "-d", "900", "-c", side["config"], "-f", "0",
            "-device", "cpu", "--disable_tta", "--preprocessed", str(side["pre"]),
            "--results", str(side["results"]), *extra]  # fmt: skip
    return predict_main(argv)


def preprocessed_arrays(pre: Path, config: str) -> dict[str, np.ndarray]:
    from trainer.data.blosc_io import open_array

    folder = pre / DEMO_DATASET / f"{DEFAULT_PLANS}_{config}"
    arrays = {p.name: np.asarray(open_array(p)[...]) for p in sorted(folder.glob("*.b2nd"))}
    for path in sorted(folder.glob("*.json")):
        props = json.loads(path.read_text())
        arrays[path.name] = np.asarray(props["spacing"] + props["shape_before_cropping"])
    return arrays


# ---- the readers: what nnU-Net 2.8.1's own reader classes read ----------------------------


@pytest.mark.parametrize("ending", FORMATS_3D[:5])
def test_volumes_read_as_nnunet_reads_them(world, ending):
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO
    from nnunetv2.imageio.tif_reader_writer import Tiff3DIO

    _, folder = converted(world, "3d", ending)
    reader = Tiff3DIO() if ending == ".tif" else SimpleITKIO()
    for path in sorted((folder / "imagesTr").glob(f"*{ending}")):
        ours, spacing = read_case([path])
        theirs, props = reader.read_images([str(path)])
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_allclose(spacing, props["spacing"])


@pytest.mark.parametrize("ending", FORMATS_2D)
def test_photos_read_as_nnunet_reads_them(world, ending):
    from nnunetv2.imageio.natural_image_reader_writer import NaturalImage2DIO

    _, folder = converted(world, "rgb", ending)
    for path in [*(folder / "imagesTr").glob(f"*{ending}"), *(folder / "labelsTr").glob("*")]:
        ours, spacing = read_case([path])
        theirs, props = NaturalImage2DIO().read_images([str(path)])
        np.testing.assert_array_equal(ours, theirs)
        assert spacing == tuple(props["spacing"]) == (999.0, 1.0, 1.0)


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
@pytest.mark.parametrize("mode", ["L", "I;16", "1", "P", "PA-palette", "RGBA"])
def test_grey_palette_and_alpha_pngs_as_nnunet(tmp_path, mode):
    """Grey is one channel, a palette its palette's colours (with alpha: four), RGBA four."""
    from nnunetv2.imageio.natural_image_reader_writer import NaturalImage2DIO
    from PIL import Image

    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 255, (5, 7, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    if mode == "PA-palette":
        image = image.convert("RGBA").convert("P")
    elif mode == "I;16":
        image = Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)
    else:
        image = image.convert(mode)
    path = tmp_path / "x_0000.png"
    image.save(path)
    ours, spacing = read_case([path])
    theirs, _ = NaturalImage2DIO().read_images([str(path)])
    np.testing.assert_array_equal(ours, theirs)
    assert spacing == (999.0, 1.0, 1.0) and ours.shape[1:] == (1, 5, 7)
    assert ours.shape[0] == {"RGBA": 4, "P": 3}.get(mode, ours.shape[0])


def assert_inputs_geometry(image: Path, prediction: Path) -> None:
    """The prediction opens in SimpleITK / Pillow / tifffile with the input's size and
    geometry (spacing, origin, direction; the 3D TIFF's spacing file)."""
    import SimpleITK as sitk
    import tifffile
    from PIL import Image

    ending = prediction.suffix
    # (An 8-bit BMP is stored with a grey palette: SimpleITK reads it as RGB; Pillow as grey.)
    if ending in (".nrrd", ".mha", ".mhd", ".gipl", ".png"):
        source, written = sitk.ReadImage(str(image)), sitk.ReadImage(str(prediction))
        assert written.GetSize() == source.GetSize()
        assert written.GetNumberOfComponentsPerPixel() == 1
        for get in ("GetSpacing", "GetOrigin", "GetDirection"):
            np.testing.assert_allclose(getattr(written, get)(), getattr(source, get)(), err_msg=get)
        if ending == ".mha":
            np.testing.assert_allclose(written.GetOrigin(), MHA_ORIGIN)
            np.testing.assert_allclose(written.GetDirection(), MHA_DIRECTION)
    if ending in (".png", ".bmp"):
        with Image.open(image) as source, Image.open(prediction) as written:
            assert written.size == source.size and written.mode in ("L", "I;16", "P")
        assert read_labels(prediction).shape == (1, source.size[1], source.size[0])
    if ending == ".tif":
        source, written = tifffile.imread(image), tifffile.imread(prediction)
        is_rgb = source.ndim == 3 and source.shape[-1] == 3 and written.ndim == 2
        assert written.shape == (source.shape[:2] if is_rgb else source.shape)
        if not is_rgb:
            sidecar = prediction.with_suffix(".json")
            case_json = image.with_name(image.name.rsplit("_", 1)[0] + ".json")
            assert json.loads(sidecar.read_text()) == json.loads(case_json.read_text())


@pytest.mark.parametrize("ending", [".nii.gz", ".mha", ".nrrd"])
@pytest.mark.parametrize("shape_xyz", [(7, 5), (7, 5, 4), (7, 5, 4, 2)])
def test_2d_and_4d_files_as_nnunets_simpleitk_reader(tmp_path, ending, shape_xyz):
    """2D: one slice at 999 x the largest pixel spacing; 4D: one channel per volume. The
    segmentation written back has the reference's dimension (3D for a 4D reference) and
    geometry."""
    import SimpleITK as sitk
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from trainer.data.image_io import encode_like, image_header

    rng = np.random.default_rng(len(shape_xyz))
    array = rng.random(shape_xyz[::-1]).astype(np.float32)
    image = sitk.GetImageFromArray(array, isVector=False)
    image.SetSpacing((0.5, 0.7, 2.0, 1.0)[: len(shape_xyz)])
    image.SetOrigin((3.0, -4.0, 5.0, 0.0)[: len(shape_xyz)])
    path = tmp_path / f"x_0000{ending}"
    sitk.WriteImage(image, str(path))
    ours, spacing = read_case([path])
    theirs, props = SimpleITKIO().read_images([str(path)])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_allclose(spacing, props["spacing"])
    assert image_header(path) == (ours.shape[0], ours.shape[1:])
    seg = (ours[0] > 0.5).astype(np.uint8)
    for out, data in encode_like(seg, path, tmp_path / f"x{ending}"):
        out.write_bytes(data)
    np.testing.assert_array_equal(read_labels(tmp_path / f"x{ending}"), seg)
    written = sitk.ReadImage(str(tmp_path / f"x{ending}"))
    dim = min(len(shape_xyz), 3)
    assert written.GetDimension() == dim and written.GetSize() == shape_xyz[:dim]
    np.testing.assert_allclose(written.GetSpacing(), image.GetSpacing()[:dim], rtol=1e-6)
    np.testing.assert_allclose(written.GetOrigin(), image.GetOrigin()[:dim], rtol=1e-6)


# ---- the same arrays, the same labels --------------------------------------------------


def _same_preprocessing_and_labels(world, kind: str, ending: str, tmp_path: Path) -> None:
    side = world[kind]
    raw, folder = converted(world, kind, ending)
    pre = tmp_path / "pre"
    assert preprocess(raw, pre, side["config"]) == 0
    expected = preprocessed_arrays(side["pre"], side["config"])
    got = preprocessed_arrays(pre, side["config"])
    assert sorted(got) == sorted(expected) and len(got) == 3 * NUM_CASES
    for name, array in expected.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-6, atol=1e-6, err_msg=name)
    reference, out = side["predicted"], tmp_path / "out"
    assert predict(world, kind, folder / "imagesTr", out) == 0
    predicted = sorted(p.name for p in out.iterdir() if p.name.startswith("case"))
    sidecars = (
        [f"case{i}.json" for i in range(NUM_CASES)] if ending == ".tif" and kind == "3d" else []
    )
    data_files = [f"case{i}.zraw" for i in range(NUM_CASES)] if ending == ".mhd" else []
    assert predicted == sorted(
        [f"case{i}{ending}" for i in range(NUM_CASES)] + sidecars + data_files
    )
    num_foreground = 0
    for index in range(NUM_CASES):
        assert_inputs_geometry(folder / "imagesTr" / f"case{index}_0000{ending}",
                               out / f"case{index}{ending}")  # fmt: skip
        ours = read_labels(out / f"case{index}{ending}")
        np.testing.assert_array_equal(ours, read_labels(reference / f"case{index}.nii.gz"))
        num_foreground += int(np.count_nonzero(ours))
    assert num_foreground > 0  # the seeded network predicts something to compare


@pytest.mark.parametrize("ending", FORMATS_3D)
def test_volumes_preprocess_and_predict_as_their_nifti(world, tmp_path, ending):
    _same_preprocessing_and_labels(world, "3d", ending, tmp_path)


@pytest.mark.parametrize("ending", FORMATS_2D)
def test_rgb_photos_preprocess_and_predict_as_their_nifti(world, tmp_path, ending):
    _same_preprocessing_and_labels(world, "rgb", ending, tmp_path)


# ---- final validation, ensemble and evaluation in the input's format -------------------


def test_final_validation_ensemble_and_evaluate_in_the_mha_format(world, tmp_path, capsys):
    from trainer.evaluation.ensemble import main as ensemble_main
    from trainer.evaluation.evaluate import main as evaluate_main
    from trainer.run import main as train_main

    side = world["3d"]
    raw, folder = converted(world, "3d", ".mha")
    pre, results = tmp_path / "pre", tmp_path / "results"
    assert preprocess(raw, pre, side["config"]) == 0
    shutil.copytree(side["results"], results)  # the same plans: the checkpoints fit
    argv = ["900", side["config"], "0", "-device", "cpu", "--val", "--num-workers", "1",
            "--raw", str(raw), "--preprocessed", str(pre), "--results", str(results)]  # fmt: skip
    assert train_main(argv) == 0
    validation = run_dir(results, DEMO_DATASET, side["config"], "0") / VALIDATION_DIR
    written = sorted(validation.glob("case*"))
    assert written and all(p.suffix == ".mha" for p in written)
    for path in written:
        image = folder / "imagesTr" / f"{path.name[: -len('.mha')]}_0000.mha"
        assert_inputs_geometry(image, path)

    a, b, ensembled = tmp_path / "a", tmp_path / "b", tmp_path / "ensembled"
    images = folder / "imagesTr"
    assert predict(world, "3d", images, a, "--save_probabilities") == 0
    assert predict(world, "3d", images, b, "--save_probabilities", "-f", "1") == 0
    assert ensemble_main(["-i", str(a), str(b), "-o", str(ensembled)]) == 0
    for index in range(NUM_CASES):
        assert_inputs_geometry(images / f"case{index}_0000.mha", ensembled / f"case{index}.mha")

    capsys.readouterr()
    summary = tmp_path / "summary.json"
    assert evaluate_main([str(folder / "labelsTr"), str(a), "-o", str(summary)]) == 0
    nifti_summary = tmp_path / "nifti.json"
    argv = [str(side["folder"] / "labelsTr"), str(side["predicted"]), "-o", str(nifti_summary)]
    assert evaluate_main(argv) == 0
    ours, theirs = json.loads(summary.read_text()), json.loads(nifti_summary.read_text())
    assert ours["mean"] == theirs["mean"] and ours["foreground_mean"]["Dice"] is not None


@pytest.mark.parametrize(("kind", "ending"), [("3d", ".tif"), ("3d", ".mhd"), ("rgb", ".png")])
def test_evaluate_reads_the_formats(world, tmp_path, kind, ending):
    """Labels against themselves in each format: every Dice 1 (spacing files and .zraw data
    files beside them are not cases)."""
    _, folder = converted(world, kind, ending)
    summary = evaluate_folders(folder / "labelsTr", folder / "labelsTr")
    assert len(summary["metric_per_case"]) == NUM_CASES
    assert summary["foreground_mean"]["Dice"] == 1.0


# ---- bad input: one line, exit 2, nothing preprocessed overwritten ------------------------


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


def _break(folder: Path, how: str) -> None:
    from PIL import Image

    meta = json.loads((folder / "dataset.json").read_text())
    images = folder / "imagesTr"
    if how == "unknown file_ending":
        meta["file_ending"] = ".jpg"
    elif how == "reorienting reader":
        meta["overwrite_image_reader_writer"] = "SimpleITKIOWithReorient"
    elif how == "mixed endings":
        shutil.copy(next(images.glob("*_0000.*")), images / "case9_0000.nrrd")
    elif how == "grey+alpha png":
        Image.open(images / "case1_0000.png").convert("LA").save(images / "case1_0000.png")
    elif how == "RGBA png for RGB channels":
        Image.open(images / "case1_0000.png").convert("RGBA").save(images / "case1_0000.png")
    elif how == "RGB label png":
        label = folder / "labelsTr" / "case1.png"
        Image.open(label).convert("RGB").save(label)
    elif how == "3D TIFF without spacing file":
        (images / "case1.json").unlink()
    elif how == "truncated mha":
        image = images / "case1_0000.mha"
        image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])
    else:
        raise AssertionError(how)
    (folder / "dataset.json").write_text(json.dumps(meta))


BAD_DATASETS = {
    "unknown file_ending": ("3d", ".nrrd", "file_ending '.jpg' is not an image format"),
    "reorienting reader": (
        "3d",
        ".nrrd",
        "overwrite_image_reader_writer 'SimpleITKIOWithReorient'",
    ),
    "mixed endings": ("3d", ".mha", "case9_0000.nrrd is a .nrrd file but dataset.json"),
    "grey+alpha png": ("rgb", ".png", "case1_0000.png is a LA image (2 channels)"),
    "RGBA png for RGB channels": ("rgb", ".png", "hold 4 channel(s) but dataset.json declares 3"),
    "RGB label png": ("rgb", ".png", "case1.png holds 3 channels where one is expected"),
    "3D TIFF without spacing file": ("3d", ".tif", "case1_0000.tif has no spacing file"),
    # ITK's own message ends with a stale "No such file or directory"
    "truncated mha": ("3d", ".mha", "case1_0000.mha: the file is truncated or corrupt"),
}


@pytest.mark.parametrize("how", list(BAD_DATASETS))
def test_bad_datasets_are_one_line_and_overwrite_nothing(world, tmp_path, capsys, how):
    kind, ending, message = BAD_DATASETS[how]
    source, _ = converted(world, kind, ending)
    raw = tmp_path / "raw"
    shutil.copytree(source, raw)
    pre = tmp_path / "pre"
    assert preprocess(raw, pre, world[kind]["config"]) == 0
    before = _snapshot(pre)
    _break(raw / DEMO_DATASET, how)
    capsys.readouterr()
    assert preprocess(raw, pre, world[kind]["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert _snapshot(pre) == before


@pytest.mark.parametrize(
    ("how", "kind", "ending", "message"),
    [("grey+alpha png", "rgb", ".png", "is a LA image"),
     ("RGBA png for RGB channels", "rgb", ".png", "takes 3 channel(s); the files hold 4"),
     ("3D TIFF without spacing file", "3d", ".tif", "case1_0000.tif has no spacing file")],
)  # fmt: skip
def test_bad_images_to_predict_are_one_line_and_write_nothing(world, tmp_path, capsys, how,
                                                              kind, ending, message):  # fmt: skip
    source, _ = converted(world, kind, ending)
    raw = tmp_path / "raw"
    shutil.copytree(source, raw)
    _break(raw / DEMO_DATASET, how)
    capsys.readouterr()
    out = tmp_path / "out"
    assert predict(world, kind, raw / DEMO_DATASET / "imagesTr", out) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_one_module_owns_image_io():
    """Only image_io imports the per-format code, and only that code the format libraries."""
    import re

    root = Path(__file__).resolve().parents[3] / "trainer"
    libraries = re.compile(r"^\s*(import (nibabel|SimpleITK|tifffile)|from PIL)", re.M)
    for path in root.rglob("*.py"):
        text = path.read_text()
        if path.name != "image_formats.py":
            assert not libraries.search(text), path
        if path.name != "image_io.py":
            assert "image_formats" not in text, path
