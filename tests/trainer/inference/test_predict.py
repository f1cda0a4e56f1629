"""nnui-predict and nnui-ensemble end to end on the tiny demo (CPU), with checkpoints
written by trainer.checkpoint.store from seeded networks: files and geometry, fold averaging,
parts, --continue_prediction and the one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from fold_checkpoint import write_checkpoint

from trainer.evaluation.ensemble import main as ensemble_main
from trainer.inference.predict import PREDICTION_INFO_FILE
from trainer.inference.predict import main as predict_main

CASES = ("demo_000", "demo_004")


@pytest.fixture(scope="module")
def env(demo_preprocessed, tmp_path_factory):
    """Results with 2d folds 0, 1, a 3d fold 0, a fold 2 whose checkpoint is truncated and a
    fold 4 trained with other plans; an input folder with two demo images."""
    root = tmp_path_factory.mktemp("predict")
    results = root / "results"
    for fold in ("0", "1"):
        write_checkpoint(demo_preprocessed, results, "2d", fold, seed=int(fold))
    write_checkpoint(demo_preprocessed, results, "3d_fullres", "0", seed=0)
    broken = write_checkpoint(demo_preprocessed, results, "2d", "2", seed=2)
    broken.write_bytes(broken.read_bytes()[:-100])
    write_checkpoint(demo_preprocessed, results, "2d", "4", seed=4,
                     identity={"plans_identity": "0" * 64})  # fmt: skip
    images = root / "imagesTs"
    images.mkdir()
    raw = demo_preprocessed.raw / demo_preprocessed.dataset_name / "imagesTr"
    for case in CASES:
        shutil.copy(raw / f"{case}_0000.nii.gz", images)
    return {"demo": demo_preprocessed, "results": results, "images": images, "root": root}


def predict(env, out: Path, *extra: str, images: Path | None = None, config: str = "2d") -> int:
    argv = [
        "-i", str(images or env["images"]), "-o", str(out), "-d", "900", "-c", config,
        "-device", "cpu", "--preprocessed", str(env["demo"].preprocessed),
        "--results", str(env["results"]), *extra,
    ]  # fmt: skip
    return predict_main(argv)


def _probabilities(path: Path) -> np.ndarray:
    with np.load(path) as archive:
        return archive["probabilities"]


def test_segmentations_in_the_inputs_geometry_with_probabilities(env, tmp_path, capsys):
    out = tmp_path / "out"
    assert predict(env, out, "-f", "0", "--disable_tta", "--save_probabilities") == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[predict")]
    assert len(lines) == len(CASES)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [PREDICTION_INFO_FILE, *(f"{c}.nii.gz" for c in CASES), *(f"{c}.npz" for c in CASES)]
    )
    for case in CASES:
        source = nib.load(str(env["images"] / f"{case}_0000.nii.gz"))
        written = nib.load(str(out / f"{case}.nii.gz"))
        assert written.shape == source.shape
        np.testing.assert_array_equal(written.affine, source.affine)
        seg = np.asarray(written.dataobj).transpose(2, 1, 0)
        assert set(np.unique(seg).tolist()) <= {0, 1, 2}
        probs = _probabilities(out / f"{case}.npz")
        assert probs.dtype == np.float32 and probs.shape == (3, *seg.shape)
        np.testing.assert_allclose(probs.sum(0), 1.0, atol=1e-5)
        np.testing.assert_array_equal(probs.argmax(0), seg)
    info = json.loads((out / PREDICTION_INFO_FILE).read_text())
    assert info["folds"] == ["0"] and info["labels"] == {"background": 0, "organ": 1, "lesion": 2}


def test_folds_are_averaged_and_ensemble_is_the_mean(env, tmp_path):
    outs = {}
    for name, folds in (("f0", ["0"]), ("f1", ["1"]), ("f01", ["0", "1"])):
        outs[name] = tmp_path / name
        assert predict(env, outs[name], "-f", *folds, "--disable_tta", "--save_probabilities") == 0
    ensembled = tmp_path / "ensemble"
    argv = ["-i", str(outs["f0"]), str(outs["f1"]), "-o", str(ensembled), "--save_probabilities"]
    assert ensemble_main(argv) == 0
    for case in CASES:
        p0, p1 = (_probabilities(outs[k] / f"{case}.npz") for k in ("f0", "f1"))
        mean = (p0.astype(np.float64) + p1) / 2
        # Folds are averaged before the way back to the raw geometry, which is linear in
        # log space (export.py), so in raw space both folds' average is close, not equal.
        p01 = _probabilities(outs["f01"] / f"{case}.npz")
        np.testing.assert_allclose(p01.sum(0), 1.0, atol=1e-5)
        error = np.abs(p01 - mean).mean()
        assert error < 0.5 * min(np.abs(p01 - p0).mean(), np.abs(p01 - p1).mean())
        assert (p01.argmax(0) == mean.argmax(0)).mean() > 0.95  # near-ties of a tiny model
        pe = _probabilities(ensembled / f"{case}.npz")
        np.testing.assert_allclose(pe, mean, atol=1e-6)
        written = nib.load(str(ensembled / f"{case}.nii.gz"))
        np.testing.assert_array_equal(
            written.affine, nib.load(str(outs["f0"] / f"{case}.nii.gz")).affine
        )
        np.testing.assert_array_equal(np.asarray(written.dataobj).transpose(2, 1, 0), pe.argmax(0))


def test_parts_cover_every_case_once(env, tmp_path, capsys):
    outs = [tmp_path / f"part{k}" for k in range(2)]
    for k, out in enumerate(outs):
        assert predict(env, out, "-f", "0", "--disable_tta", "-num_parts", "2", "-part_id",
                       str(k)) == 0  # fmt: skip
    predicted = [sorted(p.name for p in out.glob("*.nii.gz")) for out in outs]
    assert all(len(names) == 1 for names in predicted)
    assert sorted(n for names in predicted for n in names) == [f"{c}.nii.gz" for c in CASES]


def test_continue_prediction_skips_finished_cases(env, tmp_path, capsys):
    out = tmp_path / "out"
    assert predict(env, out, "-f", "0", "--disable_tta") == 0
    kept = out / f"{CASES[0]}.nii.gz"
    before = kept.stat().st_mtime_ns
    (out / f"{CASES[1]}.nii.gz").unlink()
    capsys.readouterr()
    assert predict(env, out, "-f", "0", "--disable_tta", "--continue_prediction") == 0
    text = capsys.readouterr().out
    assert "1 case(s) already done" in text
    assert [line.split()[2] for line in text.splitlines() if line.startswith("[predict")] == [
        CASES[1]
    ]
    assert kept.stat().st_mtime_ns == before and (out / f"{CASES[1]}.nii.gz").is_file()


@pytest.mark.slow
def test_3d_with_mirroring(env, tmp_path):
    images = tmp_path / "one"
    images.mkdir()
    shutil.copy(env["images"] / f"{CASES[0]}_0000.nii.gz", images)
    out = tmp_path / "out"
    assert predict(env, out, "-f", "0", images=images, config="3d_fullres") == 0
    source = nib.load(str(images / f"{CASES[0]}_0000.nii.gz"))
    written = nib.load(str(out / f"{CASES[0]}.nii.gz"))
    assert written.shape == source.shape
    np.testing.assert_array_equal(written.affine, source.affine)
    assert json.loads((out / PREDICTION_INFO_FILE).read_text())["tta"] is True


def _bad_inputs(root: Path, env) -> dict[str, tuple[list[str], Path, str]]:
    """name -> (extra argv, input folder, expected message part)."""
    folders = {}
    for name, files in {
        "empty": {},
        "missing_channel": {"x_0001.nii.gz": None},
        "extra_channel": {"x_0000.nii.gz": None, "x_0001.nii.gz": None},
        "unreadable": {"x_0000.nii.gz": b"not an image"},
    }.items():
        folder = root / name
        folder.mkdir()
        for file_name, content in files.items():
            target = folder / file_name
            if content is None:
                shutil.copy(env["images"] / f"{CASES[0]}_0000.nii.gz", target)
            else:
                target.write_bytes(content)
        folders[name] = folder
    good = env["images"]
    return {
        "empty folder": (["-f", "0"], folders["empty"], "holds no images"),
        "missing channel": (["-f", "0"], folders["missing_channel"], "x_0000 is missing"),
        "wrong channel count": (["-f", "0"], folders["extra_channel"], "model takes 1"),
        "unreadable image": (["-f", "0"], folders["unreadable"], "cannot read"),
        "fold without checkpoint": (["-f", "0", "3"], good, "fold 3 has no checkpoint_final"),
        "other plans identity": (["-f", "4"], good, "trained with another plans_identity"),
        "truncated checkpoint": (["-f", "2"], good, "truncated"),
        "pickled checkpoint": (["-f", "0", "-chk", "checkpoint_final.pth"], good, "pickle"),
        "bad part id": (["-f", "0", "-num_parts", "2", "-part_id", "2"], good, "-part_id"),
        "bad step size": (["-f", "0", "-step_size", "0"], good, "-step_size"),
        "bad mirror axes": (["-f", "0", "--mirror_axes", "a"], good, "--mirror_axes"),
        "mirror axis off the patch": (["-f", "0", "--mirror_axes", "2"], good, "axes 0-1"),
        "unknown configuration": (["-f", "0", "-c", "3d_lowres"], good, "3d_lowres"),
        "bad postprocessing file": (["-f", "0", "--postprocess", str(root)], good, "--postprocess"),
    }


def test_bad_inputs_are_one_line_errors_and_write_nothing(env, tmp_path, capsys):
    table = _bad_inputs(tmp_path, env)
    for name, (extra, images, message) in table.items():
        out = tmp_path / f"out_{name.replace(' ', '_')}"
        capsys.readouterr()
        assert predict(env, out, *extra, images=images) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and message in err, (name, err)
        assert not out.exists(), name
    # The output folder equal to the input folder: refused before anything is written.
    before = sorted(p.name for p in env["images"].iterdir())
    assert predict(env, env["images"], "-f", "0") == 2
    assert "is the input folder" in capsys.readouterr().err
    assert sorted(p.name for p in env["images"].iterdir()) == before


def test_an_image_broken_after_its_header_leaves_only_whole_files(env, tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    shutil.copy(env["images"] / f"{CASES[0]}_0000.nii.gz", images / "a_0000.nii.gz")
    whole = nib.load(str(images / "a_0000.nii.gz"))
    nib.save(whole, str(images / "b_0000.nii"))
    data = (images / "b_0000.nii").read_bytes()
    (images / "b_0000.nii").write_bytes(data[: len(data) // 2])  # header fine, voxels cut
    out = tmp_path / "out"
    assert predict(env, out, "-f", "0", "--disable_tta", images=images) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "b_0000.nii" in err
    assert sorted(p.name for p in out.iterdir()) == ["a.nii.gz", PREDICTION_INFO_FILE]
    assert nib.load(str(out / "a.nii.gz")).shape == whole.shape


def test_postprocess_keeps_the_largest_component_of_the_chosen_labels(env, tmp_path):
    from trainer.inference.postprocess import keep_largest_component

    pp_file = tmp_path / "pp.json"
    pp_file.write_text(json.dumps({"largest_component_labels": [1, 2]}))
    plain, post = tmp_path / "plain", tmp_path / "post"
    assert predict(env, plain, "-f", "0", "--disable_tta") == 0
    assert predict(env, post, "-f", "0", "--disable_tta", "--postprocess", str(pp_file)) == 0
    for case in CASES:
        before = np.asarray(nib.load(str(plain / f"{case}.nii.gz")).dataobj)
        after = np.asarray(nib.load(str(post / f"{case}.nii.gz")).dataobj)
        np.testing.assert_array_equal(after, keep_largest_component(before, [1, 2]))


def test_ensemble_refuses_mismatching_folders(env, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert predict(env, a, "-f", "0", "--disable_tta", "--save_probabilities") == 0
    assert predict(env, b, "-f", "1", "--disable_tta") == 0  # no probabilities
    out = tmp_path / "ens"
    for argv, message in (
        (["-i", str(a), "-o", str(out)], "at least two"),
        (["-i", str(a), str(b), "-o", str(out)], "different cases"),
        (["-i", str(a), str(tmp_path), "-o", str(out)], PREDICTION_INFO_FILE),
        (["-i", str(a), str(a), "-o", str(a)], "one of the input folders"),
    ):
        capsys.readouterr()
        assert ensemble_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err, err
        assert not out.exists()


def test_demo_held_out_cases_predict_then_evaluate(env, tmp_path, capsys):
    """The README flow after training: nnui-demo-data's imagesTs -> nnui-predict ->
    nnui-evaluate against labelsTs (labels from the dataset's dataset.json)."""
    from trainer.data.raw import open_raw_dataset
    from trainer.demo import DEMO_DATASET, make_case
    from trainer.demo import main as demo_main
    from trainer.evaluation.evaluate import main as evaluate_main

    raw = tmp_path / "raw"
    assert demo_main(["--cases", "2", "--test-cases", "2", "--out", str(raw),
                      "--shape-scale", "0.3"]) == 0  # fmt: skip
    dataset = raw / DEMO_DATASET
    test_ids = ["demo_002", "demo_003"]
    assert sorted(p.name for p in (dataset / "imagesTs").iterdir()) == [
        f"{c}_0000.nii.gz" for c in test_ids
    ]
    assert sorted(p.name for p in (dataset / "labelsTs").iterdir()) == [
        f"{c}.nii.gz" for c in test_ids
    ]
    image = np.asarray(nib.load(str(dataset / "imagesTs" / "demo_003_0000.nii.gz")).dataobj)
    np.testing.assert_array_equal(image.transpose(2, 1, 0), make_case(0, 3, 0.3)[0])
    assert len(open_raw_dataset(dataset).cases) == 2  # imagesTs is not training data
    assert demo_main(["--test-cases", "-1", "--out", str(raw)]) == 2

    out = tmp_path / "pred"
    assert predict(env, out, "-f", "0", "--disable_tta", images=dataset / "imagesTs") == 0
    assert evaluate_main([str(dataset / "labelsTs"), str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [Path(c["prediction_file"]).name for c in summary["metric_per_case"]] == [
        f"{c}.nii.gz" for c in test_ids
    ]
    assert sorted(summary["mean"]) == ["1", "2"]


@pytest.mark.parametrize(
    "module",
    [
        "trainer.inference.predict",
        "trainer.evaluation.ensemble",
        "trainer.evaluation.evaluate",
        "trainer.evaluation.best_configuration",
    ],
)
def test_help_exits_zero_with_usage(module):
    import subprocess
    import sys

    code = f"import sys; from {module} import main; sys.argv = ['x', '--help']; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower()
