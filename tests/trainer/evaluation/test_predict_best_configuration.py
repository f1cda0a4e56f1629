"""nnui-find-best-configuration on a hand-made results tree, and the postprocessing it
chooses (largest connected component per label)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.data.image_io import write_nifti
from trainer.evaluation.best_configuration import INFO_FILE, POSTPROCESSING_FILE, main
from trainer.inference.cases import InputError
from trainer.inference.postprocess import keep_largest_component, read_postprocessing
from trainer.schema.tree import run_dir

DATASET = "Dataset902_Pick"
FOLDS = {"0": ["c0", "c1"], "1": ["c2", "c3"]}


def _reference() -> np.ndarray:
    seg = np.zeros((8, 8, 8), dtype=np.uint8)
    seg[1:4, 1:4, 1:4] = 1
    seg[5:7, 5:7, 5:7] = 2
    return seg


def _one_hot(seg: np.ndarray) -> np.ndarray:
    return np.stack([(seg == k).astype(np.float32) for k in range(3)])


def _tree(root: Path, skip: tuple[str, str] | None = None) -> tuple[Path, Path]:
    """3d_fullres: the reference plus one stray voxel of label 1 (postprocessing removes
    it); 2d: background everywhere."""
    raw, results = root / "raw", root / "results"
    labels = raw / DATASET / "labelsTr"
    labels.mkdir(parents=True)
    (raw / DATASET / "dataset.json").write_text(json.dumps(
        {"labels": {"background": 0, "a": 1, "b": 2}, "file_ending": ".nii.gz"}))  # fmt: skip
    stray = _reference()
    stray[7, 0, 7] = 1
    for fold, cases in FOLDS.items():
        for config, seg in (("3d_fullres", stray), ("2d", np.zeros_like(stray))):
            if skip == (config, fold):
                continue
            folder = run_dir(results, DATASET, config, fold) / "validation"
            folder.mkdir(parents=True)
            for case in cases:
                np.savez_compressed(folder / f"{case}.npz", probabilities=_one_hot(seg))
        for case in cases:
            write_nifti(labels / f"{case}.nii.gz", _reference(), (1.0, 1.0, 1.0))
    return raw, results


def _argv(raw: Path, results: Path) -> list[str]:
    return ["902", "-c", "2d", "3d_fullres", "-f", "0", "1", "--raw", str(raw),
            "--results", str(results)]  # fmt: skip


def test_picks_the_best_configuration_and_the_helpful_postprocessing(tmp_path, capsys):
    raw, results = _tree(tmp_path)
    assert main(_argv(raw, results)) == 0
    info = json.loads((results / DATASET / INFO_FILE).read_text())
    dice = info["mean_foreground_dice"]
    assert dice["3d_fullres"] == pytest.approx((54 / 55 + 1) / 2)
    assert dice["2d"] == 0.0 and "2d + 3d_fullres" in dice
    assert info["configurations"] == ["3d_fullres"] and not info["is_ensemble"]
    assert info["largest_component_labels"] == [1]  # label 2 has one component: no gain
    assert info["mean_foreground_dice_after_postprocessing"] == 1.0
    assert info["num_cases"] == 4
    pp_file = results / DATASET / POSTPROCESSING_FILE
    assert read_postprocessing(pp_file) == [1]
    assert info["commands"] == [
        f"nnui-predict -i INPUT_FOLDER -d {DATASET} -f 0 1 -o OUTPUT_FOLDER -c 3d_fullres "
        f"--postprocess {pp_file}"
    ]


def test_missing_validation_probabilities_is_one_line(tmp_path, capsys):
    raw, results = _tree(tmp_path, skip=("2d", "1"))
    assert main(_argv(raw, results)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 2d fold 1 has no validation probabilities") and "\n" not in err
    assert not (results / DATASET / INFO_FILE).exists()


def test_keep_largest_component_per_label():
    seg = np.zeros((5, 5, 5), dtype=np.uint8)
    seg[0:2, 0:2, 0:2] = 1  # 8 voxels
    seg[4, 4, 4] = 1  # a stray voxel
    seg[3, 3, 3] = 2  # touches the stray voxel's corner only: another label
    seg[0, 4, 0] = 2
    out = keep_largest_component(seg, [1])
    assert out[4, 4, 4] == 0 and (out[0:2, 0:2, 0:2] == 1).all()
    np.testing.assert_array_equal(out == 2, seg == 2)  # other labels untouched
    diagonal = np.zeros((3, 3, 3), dtype=np.uint8)
    diagonal[0, 0, 0] = diagonal[1, 1, 1] = 1  # 26-connected: one component
    np.testing.assert_array_equal(keep_largest_component(diagonal, [1]), diagonal)


def test_a_bad_postprocessing_file_is_refused(tmp_path):
    path = tmp_path / "pp.json"
    path.write_text("{}")
    with pytest.raises(InputError, match="not a postprocessing file"):
        read_postprocessing(path)
