"""3d_lowres -> 3d_cascade_fullres (issue 29, item 3), end to end on a tiny demo on the CPU:
five lowres folds write predicted_next_stage (nnU-Net's folder, each fold its validation
cases), the cascade trains on image + one-hot lowres segmentation, nnui-predict runs the
lowres stage first (or takes -prev_stage_predictions), find-best-configuration compares
both. A cascade fold started before its inputs exist: one line naming the missing folds.

The plans with 3d_lowres and 3d_cascade_fullres are written here by hand (nnU-Net's keys:
next_stage, previous_stage, inherits_from); the planner decides when to make them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data.cascade import NEXT_STAGE_DIR, CascadeError, check_inputs
from trainer.data.image_io import read_image
from trainer.demo import DEMO_DATASET, make_demo_dataset
from trainer.schema.tree import SUMMARY_FILE, VALIDATION_DIR, checkpoint_file
from trainer.schema.tree import run_dir as schema_run_dir

ROOT = Path(__file__).resolve().parents[3]
LOWRES, CASCADE = "3d_lowres", "3d_cascade_fullres"


def preprocess(raw: Path, preprocessed: Path) -> None:
    """The one place this file preprocesses (the lead may switch the planner here)."""
    from trainer.planning.preprocess import preprocess_dataset
    from trainer.planning.rules import CPU_PLANNER, Overrides, PlannerOptions
    from trainer.schema.tree import DEFAULT_PLANS

    preprocess_dataset(
        raw, preprocessed, "900", configurations=("3d_fullres",), num_processes=1,
        overrides=Overrides(patch_size={"3d_fullres": (16, 32, 32)},
                            batch_size={"3d_fullres": 2}),
        options=PlannerOptions(CPU_PLANNER, plans_name=DEFAULT_PLANS),  # CPU plans by name
    )  # fmt: skip


def add_lowres_and_cascade(raw: Path, preprocessed: Path) -> None:
    """3d_lowres at twice 3d_fullres's spacing, preprocessed by nnui's case pipeline, and
    3d_cascade_fullres inheriting 3d_fullres, in the plans as nnU-Net writes them."""
    from trainer.data.raw import open_raw_dataset
    from trainer.planning.preprocess import CaseJob, preprocess_case

    dataset_dir = preprocessed / DEMO_DATASET
    plans_path = dataset_dir / "nnuiPlans.json"
    plans = json.loads(plans_path.read_text())
    full = plans["configurations"]["3d_fullres"]
    lowres = {**full, "data_identifier": "nnuiPlans_3d_lowres", "next_stage": [CASCADE],
              "spacing": [2 * s for s in full["spacing"]]}  # fmt: skip
    folder = dataset_dir / lowres["data_identifier"]
    folder.mkdir()
    data = open_raw_dataset(raw / DEMO_DATASET)
    fg = [plans["foreground_intensity_properties_per_channel"]["0"]]
    config = {"name": LOWRES, "folder": str(folder), "spacing": lowres["spacing"],
              "patch_size": lowres["patch_size"], "schemes": full["normalization_schemes"],
              "use_mask": full["use_mask_for_norm"]}  # fmt: skip
    for case in data.cases:
        preprocess_case(CaseJob(case, data.labels, None, fg, (config,)))
    plans["configurations"][LOWRES] = lowres
    plans["configurations"][CASCADE] = {"inherits_from": "3d_fullres", "previous_stage": LOWRES}
    plans_path.write_text(json.dumps(plans, indent=1))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(argv: list[str], timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip


def train(base: Path, configuration: str, fold: str, *extra: str):
    return run([
        sys.executable, "-m", "trainer", "900", configuration, fold, "-device", "cpu",
        "--epochs", "1", "--iterations-per-epoch", "2", "--val-iterations", "1",
        "--num-workers", "1", "--raw", str(base / "raw"), "--preprocessed", str(base / "pre"),
        "--results", str(base / "res"), "--npz", "--val_disable_tta", *extra,
    ])  # fmt: skip


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def cascade(tmp_path_factory):
    base = tmp_path_factory.mktemp("cascade")
    make_demo_dataset(base / "raw", num_cases=6, seed=0, shape_scale=0.4)
    preprocess(base / "raw", base / "pre")
    add_lowres_and_cascade(base / "raw", base / "pre")
    done = train(base, LOWRES, "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return base


def _splits(base: Path) -> list[dict]:
    return json.loads((base / "pre" / DEMO_DATASET / "splits_final.json").read_text())


def test_cascade_before_its_lowres_folds_names_them_and_writes_nothing(cascade):
    err = _one_line_error(train(cascade, CASCADE, "0"))
    assert "train 3d_lowres fold(s) 1, 2, 3, 4 first" in err, err
    run_dir = schema_run_dir(cascade / "res", DEMO_DATASET, CASCADE, "0")
    assert not run_dir.exists()


def test_fold_all_counts_each_missing_case_once(tmp_path: Path) -> None:
    """Fold `all` trains and validates on the same cases: the refusal counts them once."""
    from types import SimpleNamespace

    (tmp_path / "b.b2nd").write_bytes(b"")
    splits = [{"train": ["b", "c"], "val": ["a"]}, {"train": ["a", "b"], "val": ["c"]}]
    plan = SimpleNamespace(name="3d_cascade_fullres", previous_stage="3d_lowres")
    with pytest.raises(CascadeError) as refused:
        check_inputs(tmp_path, ["a", "b", "c", "a", "b", "c"], splits, plan)
    assert "segmentations of 2 case(s) (a ...)" in str(refused.value)
    assert "fold(s) 0, 1 first" in str(refused.value)


def test_lowres_fold_writes_its_validation_cases_for_the_next_stage(cascade):
    folder = (schema_run_dir(cascade / "res", DEMO_DATASET, LOWRES, "0").parent
              / NEXT_STAGE_DIR / CASCADE)  # fmt: skip
    assert sorted(p.name for p in folder.glob("*.b2nd")) == sorted(
        f"{c}.b2nd" for c in _splits(cascade)[0]["val"]
    )
    from trainer.data.blosc_io import open_array

    case = _splits(cascade)[0]["val"][0]
    full = cascade / "pre" / DEMO_DATASET / "nnuiPlans_3d_fullres"
    seg = open_array(folder / f"{case}.b2nd")[...]
    assert seg.shape == open_array(full / f"{case}_seg.b2nd").shape  # fullres geometry
    assert set(np.unique(seg).tolist()) <= {0, 1, 2}


def test_cascade_trains_predicts_and_is_compared(cascade, tmp_path):
    for fold in "1234":
        done = train(cascade, LOWRES, fold)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = train(cascade, CASCADE, "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = schema_run_dir(cascade / "res", DEMO_DATASET, CASCADE, "0")
    summary = json.loads((run_dir / VALIDATION_DIR / SUMMARY_FILE).read_text())
    assert sorted(summary["mean"]) == ["1", "2"]
    from trainer.checkpoint import store

    tensors, _ = store.load(run_dir / checkpoint_file("final"))
    first_conv = tensors["model.encoder.0.0.0.weight"]
    assert first_conv.shape[1] == 1 + 2  # MRI + one-hot organ and lesion of the lowres stage

    images = tmp_path / "images"
    images.mkdir()
    for case in _splits(cascade)[0]["val"]:
        name = f"{case}_0000.nii.gz"
        shutil.copy(cascade / "raw" / DEMO_DATASET / "imagesTr" / name, images / name)
    predict = [
        sys.executable, "-m", "trainer.predict", "-i", str(images), "-d", "900", "-c", CASCADE,
        "-f", "0", "-device", "cpu", "--disable_tta", "--preprocessed", str(cascade / "pre"),
        "--results", str(cascade / "res"),
    ]  # fmt: skip
    out = tmp_path / "out"
    done = run([*predict, "-o", str(out)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = out / f"prev_stage_{LOWRES}"
    for case in _splits(cascade)[0]["val"]:
        assert (first / f"{case}.nii.gz").is_file()
        labels = read_image(out / f"{case}.nii.gz")[0]
        assert set(np.unique(labels).tolist()) <= {0, 1, 2}
    # The lowres stage's files given: the same result.
    again = tmp_path / "again"
    done = run([*predict, "-o", str(again), "-prev_stage_predictions", str(first)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for case in _splits(cascade)[0]["val"]:
        a, b = read_image(out / f"{case}.nii.gz")[0], read_image(again / f"{case}.nii.gz")[0]
        assert np.array_equal(a, b)
    # A missing previous-stage folder: one line, nothing written.
    nowhere = tmp_path / "nowhere"
    err = _one_line_error(run([*predict, "-o", str(nowhere), "-prev_stage_predictions",
                               str(tmp_path / "missing")]))  # fmt: skip
    assert "predict 3d_lowres first" in err and not nowhere.exists()

    best = run([
        sys.executable, "-m", "trainer.evaluation.best_configuration", "900", "-c", LOWRES, CASCADE,
        "-f", "0", "--raw", str(cascade / "raw"), "--results", str(cascade / "res"),
    ])  # fmt: skip
    assert best.returncode == 0, best.stdout[-3000:] + best.stderr[-3000:]
    info = json.loads(
        (cascade / "res" / DEMO_DATASET / "nnui_inference_information.json").read_text()
    )
    assert set(info["mean_foreground_dice"]) >= {LOWRES, CASCADE}
