"""nnui-train end to end on the tiny demo (CPU): files, events, graceful stop, exact resume,
corrupt checkpoints, failures and one-line user errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer.run import main
from trainer.schema.events import decode_event
from trainer.schema.status import read_status
from trainer.schema.tree import EVENTS_FILE
from trainer.schema.tree import run_dir as schema_run_dir

ROOT = Path(__file__).resolve().parent.parent


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


EVENT_FIELDS = {
    "run_started": {
        "dataset",
        "configuration",
        "fold",
        "num_epochs",
        "iterations_per_epoch",
        "world_size",
        "launcher",
        "host",
        "argv",
    },
    "topology": {"ranks"},
    "epoch_ended": {
        "epoch",
        "train_loss",
        "val_loss",
        "dice_per_class",
        "mean_fg_dice",
        "ema_fg_dice",
        "lr",
        "epoch_time_s",
        "iterations_per_s",
        "data_wait_s",
        "data_wait_share",
    },
    "checkpoint_saved": {"checkpoint", "path", "epoch", "write_time_s"},
    "stop_requested": {"epoch", "ranks"},
    "stopped": {"epoch", "reason"},
    "validation_started": {"num_cases"},
    "validation_case": {"index", "num_cases"},
    "validation_finished": {"mean_fg_dice", "dice_per_class"},
    "finished": set(),
    "failed": {"message", "traceback"},
    "train_loss_running": {"epoch", "iteration", "num_iterations", "loss"},
}
RANK_FIELDS = {
    "global_rank",
    "local_rank",
    "host",
    "pid",
    "device",
    "batch_size",
    "oversample_foreground_percent",
    "sigusr1_handler",
}


def train_argv(demo, results: Path, configuration: str = "2d", *extra: str) -> list[str]:
    return [
        "900", configuration, "0", "-device", "cpu", "--epochs", "2",
        "--iterations-per-epoch", "2", "--val-iterations", "1", "--num-workers", "1",
        "--raw", str(demo.raw), "--preprocessed", str(demo.preprocessed),
        "--results", str(results), *extra,
    ]  # fmt: skip


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # deterministic and light on 2 cores
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer", *argv], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def finish(proc: subprocess.Popen, timeout_s: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_dir(results: Path, configuration: str = "2d") -> Path:
    return schema_run_dir(results, "Dataset900_NnuiDemo", configuration, "0")


def events(folder: Path) -> list[dict]:
    lines = (folder / EVENTS_FILE).read_text().splitlines()
    return [decode_event(line) for line in lines]


def wait_for(predicate, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, "trainer exited early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def catches_sigusr1(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGUSR1 - 1)))
    return False


def model_tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(path)).items() if k.startswith("model.")}


def losses(folder: Path) -> list[tuple]:
    return [(e["epoch"], e["train_loss"], e["val_loss"], e["dice_per_class"])
            for e in events(folder) if e["kind"] == "epoch_ended"]  # fmt: skip


# ---- user mistakes: one line, exit 2, no traceback (in-process, fast) -------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({0: "901"}, "no dataset with id 901"),
        ({1: "3d_lowres"}, "configuration '3d_lowres' not in plans"),
        ({2: "7"}, "fold must be one of"),
        ({"--epochs": "0"}, "--epochs must be a positive integer"),
        ({"--iterations-per-epoch": "-3"}, "--iterations-per-epoch"),
        ({"--epochs": "ten"}, "invalid int value"),
        ({"-device": "tpu"}, "-device must be one of"),
        pytest.param(
            {"-device": "cuda"},
            "CUDA is not available on this machine; pass -device cpu",
            marks=pytest.mark.skipif(_has_cuda(), reason="this machine has CUDA"),
        ),
        ({"extra": ["-tr", "nnUNetTrainer_5epochs"]}, "available: nnuiTrainer"),
        ({"extra": ["--val"]}, "--val needs"),
        ({"extra": ["--augment-on", "gpu"]}, "invalid choice: 'gpu'"),
        ({"extra": ["--val_best"]}, "--val_best only makes sense with --val"),
        # the plans that exist and the flag that picks them
        ({"extra": ["-p", "otherPlans"]}, "it has nnuiPlans: pick one with -p nnuiPlans"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(
    demo_preprocessed, tmp_path, capsys, change, message
):
    argv = train_argv(demo_preprocessed, tmp_path)
    for key, value in change.items():
        if key == "extra":
            argv += value
        elif isinstance(key, int):
            argv[key] = value
        else:
            argv[argv.index(key) + 1] = value
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err


def test_checkpoint_of_another_configuration_is_refused(demo_preprocessed, tmp_path, capsys):
    import torch

    from trainer.checkpoint import store
    from trainer.network.unet import PlainConvUNet

    folder = run_dir(tmp_path)
    folder.mkdir(parents=True)
    net = PlainConvUNet(1, 3, [4, 8], [[3, 3]] * 2, [[1, 1], [2, 2]], [1, 1], [1], 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    identity = {"dataset_name": "Dataset900_NnuiDemo", "configuration": "3d_fullres"}
    store.save(folder / "checkpoint_latest.safetensors", net, opt, None,
                    {"epoch_next": 1, "identity": identity})  # fmt: skip
    assert main([*train_argv(demo_preprocessed, tmp_path), "--c"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "configuration='3d_fullres'" in err


@pytest.fixture
def own_demo(demo_preprocessed, tmp_path):
    """A private copy of the preprocessed demo, safe to damage."""
    import shutil

    root = tmp_path / "preprocessed"
    shutil.copytree(demo_preprocessed.preprocessed, root)
    return demo_preprocessed._replace(preprocessed=root)


def _dataset_dir(demo) -> Path:
    return demo.preprocessed / "Dataset900_NnuiDemo"


def _damage_splits(demo, text: str) -> None:
    (_dataset_dir(demo) / "splits_final.json").write_text(text)


def _delete_one_case(demo) -> str:
    data_dir = next(p for p in _dataset_dir(demo).iterdir() if p.is_dir() and "2d" in p.name)
    victim = sorted(data_dir.glob("*_seg.b2nd"))[0]
    victim.unlink()
    return victim.name.removesuffix("_seg.b2nd")


@pytest.mark.parametrize(
    ("damage", "env", "message"),
    [
        (lambda d: _damage_splits(d, "{"), {}, "is not valid JSON"),
        (lambda d: _damage_splits(d, "[1]"), {}, "is not a list of"),
        (
            lambda d: _damage_splits(d, json.dumps([{"train": ["a"], "val": ["b"]}] * 2)),
            {},
            "case a listed in splits_final.json",
        ),
        (
            lambda d: _damage_splits(d, json.dumps([{"train": [], "val": []}])),
            {"fold": "3"},
            "fold 3 does not exist",
        ),
        (_delete_one_case, {}, "has no preprocessed files in"),
        (None, {"results_is_file": True}, "cannot create the run folder"),
        (
            None,
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "5", "LOCAL_RANK": "0"},
            "global batch size 4 < world size 5",
        ),
        (
            None,
            {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "6", "LOCAL_RANK": "1"},
            "global batch size 4 < world size 6",
        ),
    ],
)
def test_start_up_problems_are_one_line_before_anything_is_written(
    own_demo, tmp_path, capsys, monkeypatch, damage, env, message
):
    env = dict(env)
    results = tmp_path / "results"
    if env.pop("results_is_file", False):
        results.write_text("not a folder")
    argv = train_argv(own_demo, results)
    if "fold" in env:
        argv[2] = env.pop("fold")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if damage is not None:
        damage(own_demo)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not results.is_dir() or not any(results.rglob("*")), "written before the check"


def test_val_best_hint_only_when_given(demo_preprocessed, tmp_path, capsys):
    assert main([*train_argv(demo_preprocessed, tmp_path), "--val"]) == 2
    assert "drop --val_best" not in capsys.readouterr().err
    assert main([*train_argv(demo_preprocessed, tmp_path), "--val", "--val_best"]) == 2
    assert "drop --val_best" in capsys.readouterr().err


def test_missing_plans_names_the_plans_that_exist(demo_preprocessed, tmp_path, capsys):
    assert main([*train_argv(demo_preprocessed, tmp_path), "-p", "otherPlans"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "it has nnuiPlans: pick one with -p nnuiPlans" in err


def test_a_dataset_without_plans_says_preprocess_once(demo_preprocessed, tmp_path, capsys):
    empty = tmp_path / "preprocessed"
    shutil.copytree(demo_preprocessed.preprocessed, empty)
    for plans in (empty / "Dataset900_NnuiDemo").glob("*Plans*.json"):
        plans.unlink()
    argv = [*train_argv(demo_preprocessed, tmp_path), "--preprocessed", str(empty)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("nnui-preprocess") == 1 and err.count("\n") == 1, err


# ---- real runs (subprocesses) -------------------------------------------------------------


@pytest.mark.slow
def test_full_run_writes_every_file_and_event_and_lines_stay_whole(demo_preprocessed, tmp_path):
    argv = train_argv(demo_preprocessed, tmp_path, "3d_fullres", "--npz", "--save-every", "1")
    folder = run_dir(tmp_path, "3d_fullres")
    torn: list[str] = []
    seen_lines: list[str] = []
    done = threading.Event()

    def tail() -> None:  # a reader polling by offset must only ever see complete lines
        offset, pending = 0, b""
        while not done.is_set():
            path = folder / EVENTS_FILE
            if path.exists():
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    seen_lines.append(line.decode())
                    if decode_event(line) is None:
                        torn.append(line.decode())
            time.sleep(0.005)

    reader = threading.Thread(target=tail)
    reader.start()
    try:
        proc = start(argv, tmp_path / "console.log")
        assert finish(proc) == 0, (tmp_path / "console.log").read_text()
    finally:
        done.set()
        reader.join()
    assert torn == [] and seen_lines
    for name in ("events.jsonl", "status.json", "config.json", "checkpoint_latest.safetensors",
                 "checkpoint_best.safetensors", "checkpoint_final.safetensors",
                 "validation/summary.json"):  # fmt: skip
        assert (folder / name).is_file(), name
    npz_files = sorted((folder / "validation").glob("*.npz"))
    assert len(npz_files) == 2
    import numpy as np

    with np.load(npz_files[0], allow_pickle=False) as saved:
        probabilities = saved["probabilities"]
    assert probabilities.shape[0] == 3 and np.allclose(probabilities.sum(0), 1, atol=1e-4)
    records = events(folder)
    kinds = [e["kind"] for e in records]
    assert kinds[:2] == ["run_started", "topology"] and kinds[-2:] == [
        "validation_finished",
        "finished",
    ]
    assert kinds.count("epoch_ended") == 2
    # The final validation's own progress: started with its case count, then every case.
    (started,) = [e for e in records if e["kind"] == "validation_started"]
    progress = [e["index"] for e in records if e["kind"] == "validation_case"]
    assert progress == list(range(1, started["num_cases"] + 1)) and started["num_cases"] == 2
    assert kinds.index("validation_started") < kinds.index("validation_finished")
    # One epoch numbering: the console's line for the first epoch says 1/2, as the table.
    console = (tmp_path / "console.log").read_text()
    assert "epoch 1/2 lr" in console and "epoch 2/2 lr" in console and "epoch 0/2" not in console
    for record in records:
        assert EVENT_FIELDS[record["kind"]] <= set(record), record
    topology = next(e for e in records if e["kind"] == "topology")
    assert len(topology["ranks"]) == 1 and set(topology["ranks"][0]) >= RANK_FIELDS
    status = read_status(folder)
    assert status.state == "finished" and status.epoch == 2 and status.pids == [proc.pid]
    summary = json.loads((folder / "validation" / "summary.json").read_text())
    assert len(summary["metric_per_case"]) == 2 and set(summary["mean"]) == {"1", "2"}
    assert len(list((folder / "validation").glob("*.nii.gz"))) == 2  # in the raw geometry
    config = json.loads((folder / "config.json").read_text())
    assert config["num_epochs"] == 2 and config["configuration"] == "3d_fullres"
    epochs = [e for e in records if e["kind"] == "epoch_ended"]
    assert all(e["nan_loss"] is False for e in epochs)
    # The running loss: 2 steps per epoch -> a point after each; their mean is the epoch's.
    running = [e for e in records if e["kind"] == "train_loss_running"]
    assert [(e["epoch"], e["iteration"]) for e in running] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for epoch in epochs:
        points = [e["loss"] for e in running if e["epoch"] == epoch["epoch"]]
        assert sum(points) / 2 == pytest.approx(epoch["train_loss"], rel=1e-5)
    from app.services.jobs.registry import Job, Registry
    from app.services.jobs.views import JobTracker  # the jobs reader sees them

    registry = Registry(tmp_path / "state")
    registry.add(Job(job_id="j", created_at=0.0, dataset="Dataset900_NnuiDemo",
                     configuration="3d_fullres", fold="0", mode="single", device="cpu", gpus=[],
                     simulated=False, argv=[], env={}, run_dir=str(folder),
                     console_path=str(tmp_path / "console.log"), exit_code=0))  # fmt: skip
    (view,) = JobTracker(registry).refresh()
    assert [p.x for p in view.running_loss] == [0.5, 1.0, 1.5, 2.0]
    assert all(0 <= e["data_wait_s"] < e["epoch_time_s"] for e in epochs)
    validated = next(e for e in records if e["kind"] == "validation_finished")
    # The same shape as in epoch_ended: a list indexed by foreground class.
    assert isinstance(validated["dice_per_class"], list)
    assert len(validated["dice_per_class"]) == len(epochs[-1]["dice_per_class"]) == 2

    # --val validates again without touching the training's config.json.
    config_bytes = (folder / "config.json").read_bytes()
    val = start([*argv, "--val"], tmp_path / "val.log")
    assert finish(val) == 0, (tmp_path / "val.log").read_text()
    assert (folder / "config.json").read_bytes() == config_bytes
    assert [e["kind"] for e in events(folder)][-2:] == ["validation_finished", "finished"]


@pytest.mark.slow
def test_sigusr1_stops_after_the_epoch_and_continue_is_exact(demo_preprocessed, tmp_path):
    """Uninterrupted 3 epochs == stopped after epoch 0 + `--c` (weights bit for bit, losses)."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    base = ["--epochs", "3"]
    a = start([*train_argv(demo_preprocessed, whole), *base], tmp_path / "a.log")
    b = start([*train_argv(demo_preprocessed, split), *base], tmp_path / "b.log")
    try:
        folder = run_dir(split)
        wait_for(lambda: (s := read_status(folder)) is not None and s.state == "running", b)
        b.send_signal(signal.SIGUSR1)
        b.send_signal(signal.SIGUSR1)  # a second request changes nothing
        assert finish(b) == 0, (tmp_path / "b.log").read_text()
        assert finish(a) == 0, (tmp_path / "a.log").read_text()
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
    kinds = [e["kind"] for e in events(folder)]
    assert kinds[-3:] == ["stop_requested", "checkpoint_saved", "stopped"]
    stop_event = next(e for e in events(folder) if e["kind"] == "stop_requested")
    assert stop_event["ranks"] == [0] and stop_event["epoch"] == 0
    assert next(e for e in events(folder) if e["kind"] == "stopped")["reason"] == "SIGUSR1"
    assert read_status(folder).state == "stopped"
    from trainer.checkpoint import store

    tensors, meta = store.load(folder / "checkpoint_latest.safetensors")
    assert meta["epoch_next"] == 1 and any(k.startswith("model.") for k in tensors)
    assert not (folder / "checkpoint_final.safetensors").exists()

    resumed = start([*train_argv(demo_preprocessed, split), *base, "--c"], tmp_path / "c.log")
    assert finish(resumed) == 0, (tmp_path / "c.log").read_text()
    assert losses(folder) == losses(run_dir(whole))
    final_a = model_tensors(run_dir(whole) / "checkpoint_final.safetensors")
    final_b = model_tensors(folder / "checkpoint_final.safetensors")
    assert final_a.keys() == final_b.keys()
    assert all(final_a[k].equal(final_b[k]) for k in final_a)

    # A truncated newest checkpoint is skipped in favour of the next valid one.
    final = folder / "checkpoint_final.safetensors"
    final.write_bytes(final.read_bytes()[:1000])
    # The next newest valid one: checkpoint_best of the EMA's best epoch (which epoch that is
    # depends on the curves), unless the stop's checkpoint_latest is as new. Read before the
    # run that may write them again.
    candidates = {
        name: store.load(folder / f"{name}.safetensors")[1]["epoch_next"]
        for name in ("checkpoint_best", "checkpoint_latest")
    }
    newest = max(candidates.values())
    again = start([*train_argv(demo_preprocessed, split), *base, "--c"], tmp_path / "d.log")
    assert finish(again) == 0
    log = (tmp_path / "d.log").read_text()
    assert "skipping invalid checkpoint checkpoint_final.safetensors" in log
    assert any(
        f"continuing from {name}.safetensors at epoch {epoch}" in log
        for name, epoch in candidates.items()
        if epoch == newest
    ), log


@pytest.mark.slow
def test_sigusr1_during_start_up_exits_0_and_continue_starts_fresh(demo_preprocessed, tmp_path):
    proc = start(train_argv(demo_preprocessed, tmp_path), tmp_path / "a.log")
    try:
        wait_for(lambda: catches_sigusr1(proc.pid), proc, timeout_s=30)
        proc.send_signal(signal.SIGUSR1)  # torch is most likely still being imported
        assert finish(proc) == 0, (tmp_path / "a.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    folder = run_dir(tmp_path)
    assert [e["kind"] for e in events(folder)][-2:] == ["stop_requested", "stopped"]
    assert read_status(folder).state == "stopped"
    assert not list(folder.glob("*.safetensors"))  # nothing trained, nothing to save
    again = start([*train_argv(demo_preprocessed, tmp_path), "--c"], tmp_path / "b.log")
    assert finish(again) == 0
    assert "no valid checkpoint" in (tmp_path / "b.log").read_text()
    assert read_status(folder).state == "finished"


@pytest.mark.slow
def test_sigterm_records_failed_and_exits_nonzero(demo_preprocessed, tmp_path):
    proc = start([*train_argv(demo_preprocessed, tmp_path), "--epochs", "50"], tmp_path / "a.log")
    try:
        folder = run_dir(tmp_path)
        wait_for(lambda: (s := read_status(folder)) is not None and s.state == "running", proc)
        proc.terminate()
        assert finish(proc) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    failed = events(folder)[-1]
    assert failed["kind"] == "failed" and "SIGTERM" in failed["message"] and failed["traceback"]
    status = read_status(folder)
    assert status.state == "failed" and "SIGTERM" in status.message


@pytest.mark.gpu
@pytest.mark.slow
def test_two_epochs_on_one_gpu_with_amp(demo_preprocessed, tmp_path):
    """CUDA end to end: autocast (bf16, or fp16 with loss scaling), checkpoints, validation."""
    argv = [*train_argv(demo_preprocessed, tmp_path, "3d_fullres"), "--npz"]
    argv[argv.index("-device") + 1] = "cuda"
    env_log = tmp_path / "gpu.log"
    proc = start(argv, env_log)
    assert finish(proc) == 0, env_log.read_text()
    folder = run_dir(tmp_path, "3d_fullres")
    records = events(folder)
    epochs = [e for e in records if e["kind"] == "epoch_ended"]
    assert len(epochs) == 2 and not any(e.get("nan_loss") for e in epochs)
    (topology,) = [e for e in records if e["kind"] == "topology"]
    assert topology["ranks"][0]["device"].startswith("cuda")
    assert records[-1]["kind"] == "finished"
    assert (folder / "checkpoint_final.safetensors").is_file()
    assert len(list((folder / "validation").glob("*.npz"))) == 2
