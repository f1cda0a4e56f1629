"""Final validation in the raw geometry and -pretrained_weights (issue 11 items 2, 4, 7).

Final validation writes what nnui-predict writes for the same raw image (arrays, affine, the
whole NIfTI), and validation/summary.json is what nnui-evaluate computes against labelsTr.
Every refusal is one `error:` line, exit 2, before anything is written.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.run import main
from trainer.schema.events import decode_event
from trainer.schema.tree import (
    DEFAULT_PLANS,
    EVENTS_FILE,
    SUMMARY_FILE,
    VALIDATION_DIR,
    checkpoint_file,
)
from trainer.schema.tree import run_dir as schema_run_dir

ROOT = Path(__file__).resolve().parents[3]
DATASET = "Dataset900_NnuiDemo"
LAUNCH_ENVS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")  # fmt: skip


def train_argv(demo, results: Path, *extra: str, raw: Path | None = None) -> list[str]:
    return [
        "900", "2d", "0", "-device", "cpu", "--epochs", "1", "--iterations-per-epoch", "2",
        "--val-iterations", "1", "--num-workers", "1", "--raw", str(raw or demo.raw),
        "--preprocessed", str(demo.preprocessed), "--results", str(results), *extra,
    ]  # fmt: skip


def run_dir(results: Path) -> Path:
    return schema_run_dir(results, DATASET, "2d", "0")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENVS}
    env["OMP_NUM_THREADS"] = "1"  # the same threads on both sides: the same float sums
    return env


def run(argv: list[str], log: Path, timeout_s: float = 300) -> int:
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=_env(), start_new_session=True)  # fmt: skip
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def events(folder: Path) -> list[dict]:
    lines = (folder / EVENTS_FILE).read_text().splitlines()
    return [decode_event(line) for line in lines]


def refused(argv: list[str], capsys, results: Path) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not results.exists() or not any(results.rglob("*")), "written before the check"
    return err


def validation_cases(demo) -> list[str]:
    splits = json.loads((demo.preprocessed / DATASET / "splits_final.json").read_text())
    return sorted(splits[0]["val"])


def network(demo, num_classes: int | None = None, seed: int = 0):
    import torch

    from trainer.network.build import build_network
    from trainer.planning.plans import load_plans

    plans = load_plans(demo.preprocessed / DATASET)
    cplan = plans.configuration("2d")
    torch.manual_seed(seed)
    classes = num_classes or plans.num_classes
    return build_network(cplan.network, plans.num_input_channels, classes, cplan.ndim), plans


def plant_final(demo, results: Path) -> Path:
    """checkpoint_final of a seeded network with this run's identity (for --val)."""
    import torch

    from trainer.checkpoint import store

    model, plans = network(demo)
    identity = {
        "dataset_name": DATASET, "configuration": "2d", "plans_name": DEFAULT_PLANS,
        "plans_identity": plans.identity_of("2d"), "fold": "0",
    }  # fmt: skip
    folder = run_dir(results)
    folder.mkdir(parents=True)
    path = folder / checkpoint_file("final")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    store.save(path, model, optimizer, None,
                    {"kind": "final", "epoch_next": 1, "identity": identity})  # fmt: skip
    return path


def plain_weights(demo, path: Path, num_classes: int, prefix: str = "") -> dict:
    from safetensors.torch import save_file

    model, _ = network(demo, num_classes, seed=7)
    state = {f"{prefix}{k}": v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path))
    return {k.removeprefix(prefix): v for k, v in state.items()}


# ---- raw data: checked at start ---------------------------------------------------------


def test_val_without_the_raw_dataset_is_refused_in_one_line(demo_preprocessed, tmp_path, capsys):
    results = tmp_path / "results"
    plant_final(demo_preprocessed, results)
    before = sorted(p.name for p in results.rglob("*"))
    argv = train_argv(demo_preprocessed, results, "--val", raw=tmp_path / "no_raw")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --val: no raw dataset at ") and err.count("\n") == 1, err
    assert "--raw" in err and "nnUNet_raw" in err
    assert sorted(p.name for p in results.rglob("*")) == before


def test_training_without_the_raw_dataset_says_so_at_start(demo_preprocessed, tmp_path, caplog):
    from trainer.run import resolve_config
    from trainer.training.train_args import build_parser

    argv = train_argv(demo_preprocessed, tmp_path / "r", raw=tmp_path / "no_raw")
    with caplog.at_level(logging.WARNING, logger="trainer.run"):
        config = resolve_config(build_parser().parse_args(argv), argv)
    assert config.raw_dataset_dir is None
    assert "final validation will score in the preprocessed space" in caplog.text
    argv = train_argv(demo_preprocessed, tmp_path / "r")
    config = resolve_config(build_parser().parse_args(argv), argv)
    assert config.raw_dataset_dir == str(demo_preprocessed.raw / DATASET)


def _own_raw(demo, tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    shutil.copytree(demo.raw / DATASET, root / DATASET)
    return root


def _delete_label(root: Path, case_id: str) -> None:
    (root / DATASET / "labelsTr" / f"{case_id}.nii.gz").unlink()


def _swap_label(root: Path, case_id: str, other: str) -> None:
    labels = root / DATASET / "labelsTr"
    shutil.copy(labels / f"{other}.nii.gz", labels / f"{case_id}.nii.gz")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda root, case, other: _delete_label(root, case), "final validation needs"),
        (_swap_label, "the raw data changed; re-run nnui-preprocess"),
    ],
)
def test_raw_data_that_does_not_fit_is_refused_before_training(
    demo_preprocessed, tmp_path, capsys, damage, message
):
    root = _own_raw(demo_preprocessed, tmp_path)
    case, *_ = validation_cases(demo_preprocessed)
    other = next(c for c in ("demo_000", "demo_001", "demo_002") if c != case)
    damage(root, case, other)
    results = tmp_path / "results"
    err = refused(train_argv(demo_preprocessed, results, raw=root), capsys, results)
    assert message in err and case in err


def test_val_mirrors_by_default_and_the_flags_say_otherwise(demo_preprocessed, tmp_path):
    from trainer.training.train_args import build_parser

    base = train_argv(demo_preprocessed, tmp_path)
    assert build_parser().parse_args(base).val_mirror is True
    assert build_parser().parse_args([*base, "--val_disable_tta"]).val_mirror is False
    assert build_parser().parse_args([*base, "--val-mirror"]).val_mirror is True  # old flag


@pytest.mark.parametrize(
    ("axes", "message"),
    [("2", "--val_mirror_axes 2: the 2D patch has axes 0-1"),
     ("x", "give patch axes as numbers"), ("3", "patch axes are 0, 1 or 2")],
)  # fmt: skip
def test_mirror_axes_outside_the_patch_are_refused_in_one_line(
    demo_preprocessed, tmp_path, capsys, axes, message
):
    results = tmp_path / "results"
    assert main(train_argv(demo_preprocessed, results, "--val_mirror_axes", axes)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not results.exists()


@pytest.mark.parametrize(
    ("done", "total", "elapsed", "line"),
    [(3, 20, 36.0, "case 3/20, 12.0 s/case, ETA 3 min 24 s"),
     (1, 4, 5.0, "case 1/4, 5.0 s/case, ETA 15 s"),
     (2, 900, 20.0, "case 2/900, 10.0 s/case, ETA 2 h 29 min"),
     (4, 4, 8.0, "case 4/4, 2.0 s/case, ETA 0 s")],
)  # fmt: skip
def test_progress_line_says_case_rate_and_eta_in_whole_words(done, total, elapsed, line):
    from trainer.training.final_validation import progress_line

    assert progress_line(done, total, elapsed) == f"final validation: {line}"


def test_sigusr1_during_final_validation_is_logged_once(caplog) -> None:
    import signal

    from trainer import stop
    from trainer.training.worker import stop_notice

    on_case = stop_notice()
    previous = signal.getsignal(signal.SIGUSR1)
    stop.install()
    try:
        with caplog.at_level(logging.INFO, logger="trainer"):
            on_case()
            assert "SIGUSR1" not in caplog.text
            signal.raise_signal(signal.SIGUSR1)
            on_case()
            on_case()
    finally:
        stop.clear()
        signal.signal(signal.SIGUSR1, previous)
    assert caplog.text.count("finishing it first") == 1


# ---- -pretrained_weights: refusals ---------------------------------------------------------


def _pickle_named_safetensors(demo, folder: Path) -> Path:
    import torch

    path = folder / "weights.safetensors"
    torch.save(network(demo)[0].state_dict(), path)
    return path


def _garbage(folder: Path) -> Path:
    path = folder / "garbage.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return path


def _truncated_plain(demo, folder: Path) -> Path:
    path = folder / "short.safetensors"
    plain_weights(demo, path, 3)
    path.write_bytes(path.read_bytes()[:-64])
    return path


def _damaged_checkpoint(demo, folder: Path) -> Path:
    path = plant_final(demo, folder / "other")
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x10  # inside the tensor bytes
    path.write_bytes(bytes(data))
    return path


def _unrelated(folder: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    path = folder / "unrelated.safetensors"
    save_file({"encoder.0.0.0.weight": torch.zeros(2, 2), "x": torch.ones(3)}, str(path))
    return path


@pytest.mark.parametrize(
    ("make", "extra", "message"),
    [
        (lambda demo, d: d / "model_final.pth", [], "a .pth/.pt file is a pickle"),
        (_pickle_named_safetensors, [], "is a pickle (torch.save)"),
        (lambda demo, d: d / "missing.safetensors", [], "no such file"),
        (lambda demo, d: _garbage(d), [], "is not a safetensors file"),
        (_truncated_plain, [], "truncated or extended"),
        (_damaged_checkpoint, [], "checksum mismatch"),
        (lambda demo, d: _unrelated(d), [], "shares no tensor (name and shape)"),
        (lambda demo, d: _unrelated(d), ["--c"], "cannot be combined with --c"),
        (lambda demo, d: _unrelated(d), ["--val"], "cannot be combined with --val"),
    ],
)
def test_bad_pretrained_weights_are_one_line_and_exit_2(
    demo_preprocessed, tmp_path, capsys, make, extra, message
):
    path = make(demo_preprocessed, tmp_path)
    if path.suffix == ".pth":
        path.write_bytes(b"\x80\x04K\x01.")  # a pickle: never opened by nnui
    results = tmp_path / "results"
    argv = train_argv(demo_preprocessed, results, "-pretrained_weights", str(path), *extra)
    err = refused(argv, capsys, results)
    assert message in err, err


# ---- -pretrained_weights: what is loaded ---------------------------------------------------


def test_matching_tensors_are_loaded_and_the_heads_of_another_label_count_skipped(
    demo_preprocessed, tmp_path, caplog
):
    from types import SimpleNamespace

    import torch

    from trainer.training.worker import _load_pretrained

    path = tmp_path / "pre.safetensors"
    stored = plain_weights(demo_preprocessed, path, num_classes=5, prefix="module.")
    model, _ = network(demo_preprocessed, seed=1)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    config = SimpleNamespace(pretrained_weights=str(path))
    topology = SimpleNamespace(world_size=1, is_main=True)
    trainee = SimpleNamespace(raw_model=model, device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="trainer"):
        _load_pretrained(config, topology, trainee)  # type: ignore[arg-type]
    heads = [k for k in fresh if k.startswith("heads.")]
    assert heads
    for name, tensor in model.state_dict().items():
        expected = fresh[name] if name in heads else stored[name]
        assert torch.equal(tensor, expected), name
    (line,) = [r.getMessage() for r in caplog.records if "pretrained weights" in r.getMessage()]
    assert f"loaded {len(fresh) - len(heads)} of {len(fresh)} tensors" in line
    assert "skipped (shape differs): heads.0.weight" in line and "\n" not in line


def test_an_nnui_checkpoint_gives_its_model_tensors(demo_preprocessed, tmp_path):
    import torch

    from trainer.checkpoint.pretrained import load_matching

    path = plant_final(demo_preprocessed, tmp_path)
    source, _ = network(demo_preprocessed)  # the planted network (same seed)
    target, _ = network(demo_preprocessed, seed=3)
    tensors, report = load_matching(path, target)
    assert set(tensors) == set(source.state_dict())
    assert all(torch.equal(tensors[k], v) for k, v in source.state_dict().items())
    assert f"loaded {len(tensors)} of {len(tensors)} tensors" in report


# ---- end to end (subprocesses) -------------------------------------------------------------


def _predict(demo, results: Path, images: Path, out: Path, log: Path) -> None:
    argv = [
        sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(out), "-d", "900",
        "-c", "2d", "-f", "0", "-chk", "checkpoint_final", "--save_probabilities",
        "-device", "cpu", "--preprocessed", str(demo.preprocessed), "--results", str(results),
    ]  # fmt: skip
    assert run(argv, log) == 0, log.read_text()


def _evaluate(demo, validation: Path, out: Path) -> dict:
    from trainer.evaluation.evaluate import main as evaluate_main

    labels = demo.raw / DATASET / "labelsTr"
    assert evaluate_main([str(labels), str(validation), "--chill", "-o", str(out)]) == 0
    return json.loads(out.read_text())


def assert_same_nifti(a: Path, b: Path) -> None:
    import nibabel as nib

    first, second = nib.load(str(a)), nib.load(str(b))
    np.testing.assert_array_equal(np.asarray(first.dataobj), np.asarray(second.dataobj))
    np.testing.assert_array_equal(first.affine, second.affine)
    # The whole file but gzip's time stamp: header, affine, qform/sform, dtype, voxels.
    assert gzip.decompress(a.read_bytes()) == gzip.decompress(b.read_bytes())


def _probabilities(path: Path) -> np.ndarray:
    with np.load(path, allow_pickle=False) as archive:
        return archive["probabilities"]


@pytest.mark.slow
def test_final_validation_writes_what_nnui_predict_writes_and_nnui_evaluate_agrees(
    demo_preprocessed, tmp_path
):
    results = tmp_path / "results"
    argv = [sys.executable, "-m", "trainer", *train_argv(demo_preprocessed, results, "--npz")]
    assert run(argv, tmp_path / "train.log") == 0, (tmp_path / "train.log").read_text()
    validation = run_dir(results) / VALIDATION_DIR
    cases = validation_cases(demo_preprocessed)
    assert sorted(p.name for p in validation.iterdir()) == sorted(
        [*(f"{c}.nii.gz" for c in cases), *(f"{c}.npz" for c in cases), SUMMARY_FILE]
    )
    images = tmp_path / "images"
    images.mkdir()
    for case in cases:
        shutil.copy(demo_preprocessed.raw / DATASET / "imagesTr" / f"{case}_0000.nii.gz", images)
    predicted = tmp_path / "predicted"
    _predict(demo_preprocessed, results, images, predicted, tmp_path / "predict.log")
    for case in cases:
        assert_same_nifti(validation / f"{case}.nii.gz", predicted / f"{case}.nii.gz")
        ours, theirs = (
            _probabilities(validation / f"{case}.npz"),
            _probabilities(predicted / f"{case}.npz"),
        )
        assert ours.dtype == np.float32 and np.array_equal(ours, theirs)

    summary = json.loads((validation / SUMMARY_FILE).read_text())
    assert _evaluate(demo_preprocessed, validation, tmp_path / "eval.json") == summary
    (finished,) = [e for e in events(run_dir(results)) if e["kind"] == "validation_finished"]
    assert finished["mean_fg_dice"] == summary["foreground_mean"]["Dice"]
    assert finished["dice_per_class"] == [summary["mean"][k]["Dice"] for k in ("1", "2")]
    assert finished["num_cases"] == len(cases)
    progress = [e for e in events(run_dir(results)) if e["kind"] == "validation_case"]
    assert [e["index"] for e in progress][-len(cases) :] == list(range(1, len(cases) + 1))
    assert all(e["seconds_per_case"] > 0 for e in progress)
    console = (tmp_path / "train.log").read_text()
    for n in range(1, len(cases) + 1):  # the console follows it too, case by case with an ETA
        assert f"final validation: case {n}/{len(cases)}, " in console

    # --val --val_best: checkpoint_best of a one-epoch run holds the final weights.
    (validation / SUMMARY_FILE).unlink()
    assert run([*argv, "--val", "--val_best"], tmp_path / "val.log") == 0
    assert json.loads((validation / SUMMARY_FILE).read_text()) == summary
    assert [e["kind"] for e in events(run_dir(results))][-2:] == ["validation_finished", "finished"]


@pytest.mark.slow
def test_pretrained_weights_under_torchrun_and_validation_gathered_on_rank_0(
    demo_preprocessed, tmp_path
):
    """Rank 0 reads the file and hands the matching tensors to rank 1; both ranks validate
    one case each and rank 0 writes both in the raw geometry."""
    weights = tmp_path / "pretrained.safetensors"
    plain_weights(demo_preprocessed, weights, num_classes=4)
    results = tmp_path / "results"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "trainer"]  # fmt: skip
    extra = ("-pretrained_weights", str(weights), "--npz", "--val_disable_tta")
    log = tmp_path / "torchrun.log"
    assert run([*torchrun, *train_argv(demo_preprocessed, results, *extra)], log) == 0, (
        log.read_text()
    )
    lines = [line for line in log.read_text().splitlines() if "pretrained weights" in line]
    assert len(lines) == 1 and "skipped (shape differs): heads.0.weight" in lines[0], lines
    validation = run_dir(results) / VALIDATION_DIR
    cases = validation_cases(demo_preprocessed)
    assert sorted(p.name for p in validation.glob("*.nii.gz")) == [f"{c}.nii.gz" for c in cases]
    assert sorted(p.name for p in validation.glob("*.npz")) == [f"{c}.npz" for c in cases]
    summary = json.loads((validation / SUMMARY_FILE).read_text())
    assert _evaluate(demo_preprocessed, validation, tmp_path / "eval.json") == summary
    (started,) = [e for e in events(run_dir(results)) if e["kind"] == "run_started"]
    assert started["world_size"] == 2
