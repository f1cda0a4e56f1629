"""nnui-predict and nnui-ensemble never write into a folder that holds nnU-Net's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.evaluation import ensemble
from trainer.inference import predict


@pytest.fixture
def nnunet_prediction_folder(tmp_path: Path) -> Path:
    out = tmp_path / "nnunet_out"
    out.mkdir()
    (out / "predict_from_raw_data_args.json").write_text("{}")
    (out / "case_000.nii.gz").write_bytes(b"nnU-Net's prediction")
    return out


def _unchanged(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_predict_refuses_an_nnunet_output_folder(tmp_path, nnunet_prediction_folder, capsys):
    before = _unchanged(nnunet_prediction_folder)
    (tmp_path / "in").mkdir()
    argv = ["-i", str(tmp_path / "in"), "-o", str(nnunet_prediction_folder), "-d", "900",
            "-c", "2d", "-f", "0", "-device", "cpu"]  # fmt: skip
    assert predict.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds nnU-Net's files" in err, err
    assert _unchanged(nnunet_prediction_folder) == before


def test_ensemble_refuses_an_nnunet_output_folder(tmp_path, nnunet_prediction_folder):
    before = _unchanged(nnunet_prediction_folder)
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    with pytest.raises(ensemble.EnsembleError, match="holds nnU-Net's files"):
        ensemble.plan_ensemble(folders, nnunet_prediction_folder)
    assert _unchanged(nnunet_prediction_folder) == before
