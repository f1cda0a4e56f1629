"""--precision (trainer.network.precision): which float format each device computes in,
the refusals, and that bf16 on CPU trains and predicts the same segmentations as float32 up
to rounding."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from test_final_validation import (
    DATASET,
    _probabilities,
    plant_final,
    run,
    run_dir,
    train_argv,
    validation_cases,
)

from trainer.inference.predict import main as predict_main
from trainer.network import precision
from trainer.run import main as train_main


def test_auto_is_bf16_on_amx_cpus_and_float32_on_others(monkeypatch) -> None:
    monkeypatch.setattr(precision, "cpu_has_amx", lambda: True)
    assert precision.autocast_dtype("auto", "cpu") is torch.bfloat16
    assert precision.autocast_dtype("fp32", "cpu") is None
    monkeypatch.setattr(precision, "cpu_has_amx", lambda: False)
    assert precision.autocast_dtype("auto", "cpu") is None
    assert precision.autocast_dtype("bf16", "cpu") is torch.bfloat16  # asked for: given
    assert precision.autocast_dtype("auto", "mps") is None


@pytest.mark.parametrize("bf16_gpu", [True, False])
def test_auto_on_cuda_is_bf16_where_the_gpu_has_it_else_fp16(monkeypatch, bf16_gpu) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    expected = torch.bfloat16 if bf16_gpu else torch.float16
    assert precision.autocast_dtype("auto", "cuda") is expected
    assert precision.autocast_dtype("fp16", "cuda") is torch.float16
    assert precision.autocast_dtype("fp32", "cuda") is None
    if not bf16_gpu:
        with pytest.raises(ValueError, match="no bf16 support"):
            precision.autocast_dtype("bf16", "cuda")


@pytest.mark.parametrize(
    ("choice", "device", "message"),
    [("fp16", "cpu", "needs -device cuda"), ("bf16", "mps", "mps"), ("fp8", "cuda", "one of")],
)
def test_impossible_choices_are_named(choice, device, message) -> None:
    with pytest.raises(ValueError, match=message):
        precision.check(choice, device)


def test_train_refuses_fp16_on_cpu_in_one_line_before_writing(demo_preprocessed, tmp_path, capsys):
    results = tmp_path / "results"
    assert train_main(train_argv(demo_preprocessed, results, "--precision", "fp16")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "fp16" in err, err
    assert not results.exists() or not any(results.rglob("*"))


def test_predict_refuses_fp16_on_cpu_in_one_line(demo_preprocessed, tmp_path, capsys):
    images = demo_preprocessed.raw / DATASET / "imagesTr"
    out = tmp_path / "out"
    code = predict_main(["-i", str(images), "-o", str(out), "-d", "900", "-c", "2d", "-f", "0",
                         "-device", "cpu", "--precision", "fp16",
                         "--preprocessed", str(demo_preprocessed.preprocessed),
                         "--results", str(tmp_path / "results")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_bf16_training_logs_it_and_predicts_what_float32_predicts(demo_preprocessed, tmp_path):
    """A bf16 CPU training runs (float32 weights in its checkpoint); predictions of one
    checkpoint in bf16 and float32 differ by rounding only."""
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "trainer",
            *train_argv(demo_preprocessed, results, "--precision", "bf16")]  # fmt: skip
    log = tmp_path / "train.log"
    assert run(argv, log) == 0, log.read_text()
    assert "precision: bf16 autocast (--precision bf16)" in log.read_text()
    from trainer.checkpoint import store
    from trainer.schema.tree import checkpoint_file

    tensors, _ = store.load(run_dir(results) / checkpoint_file("final"))
    assert {t.dtype for k, t in tensors.items() if k.startswith("model.")} == {torch.float32}

    planted = tmp_path / "planted"
    plant_final(demo_preprocessed, planted)  # a seeded network: confident, not all background
    images = tmp_path / "images"
    images.mkdir()
    cases = validation_cases(demo_preprocessed)
    for case in cases:
        (images / f"{case}_0000.nii.gz").symlink_to(
            demo_preprocessed.raw / DATASET / "imagesTr" / f"{case}_0000.nii.gz"
        )
    probabilities = {}
    for choice in ("fp32", "bf16"):
        out = tmp_path / choice
        argv = [sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(out),
                "-d", "900", "-c", "2d", "-f", "0", "-chk", "checkpoint_final",
                "--save_probabilities", "-device", "cpu", "--precision", choice,
                "--preprocessed", str(demo_preprocessed.preprocessed),
                "--results", str(planted)]  # fmt: skip
        assert run(argv, tmp_path / f"{choice}.log") == 0, (tmp_path / f"{choice}.log").read_text()
        name = "bf16 autocast" if choice == "bf16" else "float32"
        assert f"precision: {name}" in (tmp_path / f"{choice}.log").read_text()
        probabilities[choice] = [_probabilities(out / f"{case}.npz") for case in cases]
    for fp32, bf16 in zip(probabilities["fp32"], probabilities["bf16"], strict=True):
        assert not np.array_equal(fp32, bf16)  # bf16 really ran
        assert np.abs(fp32 - bf16).max() < 0.1
        assert (fp32.argmax(0) == bf16.argmax(0)).mean() > 0.99
