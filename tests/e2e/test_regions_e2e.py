"""A BraTS-like region dataset and an ignore-label dataset, end to end on the CPU (issue 29):
preprocess, train (few iterations), final validation, predict, evaluate; the numbers equal
nnU-Net's folder evaluation of the same files. Bad input: one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.image_io import read_image, write_nifti
from trainer.demo import DEMO_DATASET, make_case
from trainer.inference.predict import PREDICTION_INFO_FILE
from trainer.schema.events import decode_event
from trainer.schema.tree import EVENTS_FILE, SUMMARY_FILE, VALIDATION_DIR
from trainer.schema.tree import run_dir as schema_run_dir

ROOT = Path(__file__).resolve().parents[2]
NUM_CASES = 6
SCALE = 0.4
BRATS_LABELS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing": [3]}
BRATS_ORDER = [1, 2, 3]
REGION_KEYS = ["(1, 2, 3)", "(2, 3)", "(3,)"]


def _nested(label: np.ndarray) -> np.ndarray:
    """Demo labels (1 organ, 2 lesion) with a third, nested label: the lesion's low-x half."""
    out = label.copy()
    lesion = np.argwhere(label == 2)
    if len(lesion):
        middle = np.median(lesion[:, 2])
        out[(label == 2) & (np.arange(label.shape[2])[None, None, :] <= middle)] = 3
    return out


def _sparse(label: np.ndarray) -> np.ndarray:
    """Demo labels with every third slice unannotated (ignore label 3)."""
    out = label.copy()
    out[::3] = 3
    return out


def make_dataset(root: Path, labels: dict, relabel, order=None) -> Path:
    """The demo's images with relabelled segmentations and the given dataset.json labels."""
    folder = root / DEMO_DATASET
    for sub in ("imagesTr", "labelsTr"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    for index in range(NUM_CASES):
        image, label, spacing = make_case(0, index, SCALE)
        write_nifti(folder / "imagesTr" / f"demo_{index:03d}_0000.nii.gz", image, spacing)
        write_nifti(folder / "labelsTr" / f"demo_{index:03d}.nii.gz", relabel(label), spacing)
    dataset_json = {
        "channel_names": {"0": "MRI"}, "labels": labels, "numTraining": NUM_CASES,
        "file_ending": ".nii.gz",
        **({"regions_class_order": order} if order is not None else {}),
    }  # fmt: skip
    (folder / "dataset.json").write_text(json.dumps(dataset_json, indent=1))
    return folder


def preprocess(raw: Path, preprocessed: Path) -> None:
    """The one place this file preprocesses (the lead may switch the planner here)."""
    from trainer.planning.preprocess import preprocess_dataset
    from trainer.planning.rules import CPU_PLANNER, Overrides, PlannerOptions
    from trainer.schema.tree import DEFAULT_PLANS

    preprocess_dataset(
        raw, preprocessed, "900", configurations=("2d",), num_processes=1,
        overrides=Overrides(patch_size={"2d": (32, 32)}, batch_size={"2d": 4}),
        options=PlannerOptions(CPU_PLANNER, plans_name=DEFAULT_PLANS),  # CPU plans by name
    )  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(argv: list[str], log: Path, timeout_s: float = 400) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def train(raw: Path, preprocessed: Path, results: Path, log: Path, *extra: str) -> int:
    argv = [
        sys.executable, "-m", "trainer", "900", "2d", "0", "-device", "cpu", "--epochs", "1",
        "--iterations-per-epoch", "2", "--val-iterations", "1", "--num-workers", "1",
        "--raw", str(raw), "--preprocessed", str(preprocessed), "--results", str(results),
        *extra,
    ]  # fmt: skip
    return run(argv, log)


def _nnunet_summary(reference: Path, predicted: Path, keys, ignore=None) -> dict:
    from nnunetv2.evaluation.evaluate_predictions import compute_metrics_on_folder
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    return compute_metrics_on_folder(
        str(reference), str(predicted), None, SimpleITKIO(), ".nii.gz", keys, ignore,
        num_processes=1,
    )  # fmt: skip


def _assert_same_dice(ours: dict, theirs: dict, keys) -> None:
    for key in keys:
        mine, value = ours["mean"][str(key)]["Dice"], float(theirs["mean"][key]["Dice"])
        assert (mine is None and math.isnan(value)) or mine == pytest.approx(value), key
    value = float(theirs["foreground_mean"]["Dice"])
    mine = ours["foreground_mean"]["Dice"]
    assert (mine is None and math.isnan(value)) or mine == pytest.approx(value)


@pytest.fixture(scope="module")
def brats(tmp_path_factory):
    base = tmp_path_factory.mktemp("brats")
    make_dataset(base / "raw", BRATS_LABELS, _nested, BRATS_ORDER)
    preprocess(base / "raw", base / "pre")
    code = train(base / "raw", base / "pre", base / "res", base / "train.log", "--npz")
    assert code == 0, (base / "train.log").read_text()[-3000:]
    return base


def test_region_dataset_trains_validates_per_region_like_nnunet(brats):
    run_dir = schema_run_dir(brats / "res", DEMO_DATASET, "2d", "0")
    plans = json.loads((brats / "pre" / DEMO_DATASET / "nnuiPlans.json").read_text())
    assert plans["labels"]["whole tumor"] == [1, 2, 3] and plans["regions_class_order"] == [1, 2, 3]
    lines = (run_dir / EVENTS_FILE).read_text().splitlines()
    events = [decode_event(line) for line in lines]
    epoch = next(e for e in events if e["kind"] == "epoch_ended")
    assert len(epoch["dice_per_class"]) == 3  # one pseudo-Dice per region
    started = next(e for e in events if e["kind"] == "run_started")
    assert started["class_names"] == ["whole tumor", "tumor core", "enhancing"]
    validation = run_dir / VALIDATION_DIR
    summary = json.loads((validation / SUMMARY_FILE).read_text())
    assert sorted(summary["mean"]) == sorted(REGION_KEYS)
    for path in validation.glob("*.nii.gz"):
        assert set(np.unique(read_image(path)[0]).tolist()) <= {0, 1, 2, 3}
    with np.load(next(validation.glob("*.npz"))) as archive:
        assert archive["probabilities"].shape[0] == 3  # sigmoid per region, no background
    keys = [(1, 2, 3), (2, 3), (3,)]
    theirs = _nnunet_summary(brats / "raw" / DEMO_DATASET / "labelsTr", validation, keys)
    _assert_same_dice(summary, theirs, keys)


def test_region_prediction_and_evaluation(brats, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for index in (0, 1):
        name = f"demo_{index:03d}_0000.nii.gz"
        shutil.copy(brats / "raw" / DEMO_DATASET / "imagesTr" / name, images / name)
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(out), "-d", "900",
        "-c", "2d", "-f", "0", "-device", "cpu", "--disable_tta",
        "--preprocessed", str(brats / "pre"), "--results", str(brats / "res"),
    ]  # fmt: skip
    assert run(argv, tmp_path / "predict.log") == 0, (tmp_path / "predict.log").read_text()
    for path in out.glob("*.nii.gz"):
        assert set(np.unique(read_image(path)[0]).tolist()) <= {0, 1, 2, 3}
    info = json.loads((out / PREDICTION_INFO_FILE).read_text())
    assert info["regions_class_order"] == [1, 2, 3]
    from trainer.evaluation.evaluate import main as evaluate_main

    labels = brats / "raw" / DEMO_DATASET / "labelsTr"
    summary_file = tmp_path / "summary.json"
    assert evaluate_main([str(labels), str(out), "--chill", "-o", str(summary_file)]) == 0
    summary = json.loads(summary_file.read_text())
    assert sorted(summary["mean"]) == sorted(REGION_KEYS)
    keys = [(1, 2, 3), (2, 3), (3,)]
    _assert_same_dice(summary, _nnunet_summary(labels, out, keys), keys)


def test_region_dataset_given_to_a_label_only_checkpoint_is_one_line(brats, tmp_path):
    """The plans (regions) changed after the checkpoint was trained on labels: predicting or
    continuing with that checkpoint is refused in one line, nothing written."""
    pre = tmp_path / "pre"
    shutil.copytree(brats / "pre", pre)
    plans_path = pre / DEMO_DATASET / "nnuiPlans.json"
    plans = json.loads(plans_path.read_text())
    plans["labels"] = {"background": 0, "a": 1, "b": 2, "c": 3}
    del plans["regions_class_order"]
    plans_path.write_text(json.dumps(plans))
    out = tmp_path / "out"
    images = brats / "raw" / DEMO_DATASET / "imagesTr"
    argv = [
        sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(out), "-d", "900",
        "-c", "2d", "-f", "0", "-device", "cpu", "--preprocessed", str(pre),
        "--results", str(brats / "res"),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
    assert "plans_identity" in done.stderr


def test_ignore_label_dataset_trains_and_never_predicts_the_ignore_label(tmp_path):
    labels = {"background": 0, "organ": 1, "lesion": 2, "ignore": 3}
    make_dataset(tmp_path / "raw", labels, _sparse)
    preprocess(tmp_path / "raw", tmp_path / "pre")
    case_json = next((tmp_path / "pre" / DEMO_DATASET / "nnuiPlans_2d").glob("*.json"))
    props = json.loads(case_json.read_text())
    assert "annotated" in props["class_locations"]
    code = train(tmp_path / "raw", tmp_path / "pre", tmp_path / "res", tmp_path / "train.log")
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    run_dir = schema_run_dir(tmp_path / "res", DEMO_DATASET, "2d", "0")
    validation = run_dir / VALIDATION_DIR
    predicted = sorted(validation.glob("*.nii.gz"))
    assert predicted
    for path in predicted:
        assert 3 not in np.unique(read_image(path)[0])
    summary = json.loads((validation / SUMMARY_FILE).read_text())
    assert sorted(summary["mean"]) == ["1", "2"]
    theirs = _nnunet_summary(tmp_path / "raw" / DEMO_DATASET / "labelsTr", validation, [1, 2], 3)
    _assert_same_dice(summary, theirs, [1, 2])


@pytest.mark.parametrize(
    ("labels", "order", "message"),
    [
        ({"background": 0, "organ": [1, 3], "lesion": [3]}, [1, 3], "2 missing from [0, 1, 3]"),
        ({"background": 0, "organ": 1, "lesion": 2, "ignore": 5}, None, "ignore label (5)"),
        ({"background": 0, "organ": [1, 2], "lesion": [2]}, None, "no regions_class_order"),
    ],
)
def test_bad_labels_stop_preprocessing_in_one_line(tmp_path, labels, order, message):
    make_dataset(tmp_path / "raw", labels, lambda label: label, order)
    argv = [sys.executable, "-m", "trainer.planning.preprocess",
            "900", "--raw", str(tmp_path / "raw"),
            "--preprocessed", str(tmp_path / "pre"), "-c", "2d"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr
    assert not (tmp_path / "pre").exists() or not any((tmp_path / "pre").rglob("*.b2nd"))


BRATS5_LABELS = {"background": 0, "whole_tumour": [1, 2, 3, 4], "tumour_core": [1, 3, 4],
                 "enhancing": [4]}  # fmt: skip
BRATS5_ORDER = [2, 1, 4]


def _brats5(label: np.ndarray) -> np.ndarray:
    """Five labels as real BraTS: the organ becomes oedema (2), the lesion's low-x half the
    necrosis (1) and non-enhancing core (3) in alternating rows, its other half enhancing (4)."""
    nested = _nested(label)
    out = np.where(label == 1, 2, 0).astype(np.uint8)
    rows = (np.arange(label.shape[1]) % 2 == 0)[None, :, None]
    out[(nested == 3) & rows] = 1
    out[(nested == 3) & ~rows] = 3
    out[nested == 2] = 4
    return out


def test_brats_five_labels_sharing_regions_train_predict_and_evaluate_as_nnunet(tmp_path):
    """Labels 1 and 3 belong to the same regions: nnU-Net accepts it, so does nnui (one
    note); predictions hold regions_class_order's values; Dice equals nnU-Net's."""
    from trainer.planning.preprocess import preprocess_dataset
    from trainer.planning.rules import CPU_PLANNER, Overrides, PlannerOptions
    from trainer.schema.tree import DEFAULT_PLANS

    make_dataset(tmp_path / "raw", BRATS5_LABELS, _brats5, BRATS5_ORDER)
    lines: list[str] = []
    preprocess_dataset(
        tmp_path / "raw", tmp_path / "pre", "900", configurations=("2d",), num_processes=1,
        overrides=Overrides(patch_size={"2d": (32, 32)}, batch_size={"2d": 4}),
        options=PlannerOptions(CPU_PLANNER, plans_name=DEFAULT_PLANS), progress=lines.append,
    )  # fmt: skip
    notes = [line for line in lines if "belong to the same regions" in line]
    assert len(notes) == 1 and notes[0].startswith("note: labels 1 and 3"), lines
    code = train(tmp_path / "raw", tmp_path / "pre", tmp_path / "res", tmp_path / "train.log")
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    validation = schema_run_dir(tmp_path / "res", DEMO_DATASET, "2d", "0") / VALIDATION_DIR
    for path in validation.glob("*.nii.gz"):
        assert set(np.unique(read_image(path)[0]).tolist()) <= {0, 1, 2, 4}
    keys = [(1, 2, 3, 4), (1, 3, 4), (4,)]
    summary = json.loads((validation / SUMMARY_FILE).read_text())
    assert sorted(summary["mean"]) == sorted(str(k) for k in keys)
    labels = tmp_path / "raw" / DEMO_DATASET / "labelsTr"
    _assert_same_dice(summary, _nnunet_summary(labels, validation, keys), keys)
    from trainer.evaluation.evaluate import main as evaluate_main

    out = tmp_path / "summary.json"
    assert evaluate_main([str(labels), str(validation), "--chill", "-o", str(out)]) == 0
    _assert_same_dice(json.loads(out.read_text()), _nnunet_summary(labels, validation, keys), keys)


def test_region_ensemble_and_find_best_configuration(brats, tmp_path):
    """Both average the regions' sigmoid probabilities and write the label map in
    regions_class_order; find-best scores the regions as the final validation did."""
    best = subprocess.run(
        [sys.executable, "-m", "trainer.evaluation.best_configuration",
         "900", "-c", "2d", "-f", "0",
         "--raw", str(brats / "raw"), "--results", str(brats / "res")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert best.returncode == 0, best.stdout[-2000:] + best.stderr[-2000:]
    info = json.loads(
        (brats / "res" / DEMO_DATASET / "nnui_inference_information.json").read_text()
    )
    run_dir = schema_run_dir(brats / "res", DEMO_DATASET, "2d", "0")
    summary = json.loads((run_dir / VALIDATION_DIR / SUMMARY_FILE).read_text())
    assert info["mean_foreground_dice"]["2d"] == pytest.approx(summary["foreground_mean"]["Dice"])

    images = tmp_path / "images"
    images.mkdir()
    name = "demo_000_0000.nii.gz"
    shutil.copy(brats / "raw" / DEMO_DATASET / "imagesTr" / name, images / name)
    first = tmp_path / "first"
    argv = [
        sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(first), "-d", "900",
        "-c", "2d", "-f", "0", "-device", "cpu", "--disable_tta", "--save_probabilities",
        "--preprocessed", str(brats / "pre"), "--results", str(brats / "res"),
    ]  # fmt: skip
    assert run(argv, tmp_path / "predict.log") == 0, (tmp_path / "predict.log").read_text()
    second = tmp_path / "second"
    shutil.copytree(first, second)
    from trainer.evaluation.ensemble import main as ensemble_main

    out = tmp_path / "ensemble"
    assert ensemble_main(["-i", str(first), str(second), "-o", str(out)]) == 0
    ours = read_image(out / "demo_000.nii.gz")[0]
    assert np.array_equal(ours, read_image(first / "demo_000.nii.gz")[0])
    # Folders predicted with other labels (names, regions or their order): refused.
    info_path = second / PREDICTION_INFO_FILE
    other = json.loads(info_path.read_text())
    other["labels"] = {"background": 0, "a": [1, 2, 3], "b": [2, 3], "c": [3]}
    info_path.write_text(json.dumps(other))
    assert ensemble_main(["-i", str(first), str(second), "-o", str(tmp_path / "refused")]) == 2
    assert not (tmp_path / "refused").exists()
