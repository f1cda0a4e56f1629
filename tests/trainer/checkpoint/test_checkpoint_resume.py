"""nnui-train and its checkpoints (CPU demo): `--c`/`--val` refuse another run's checkpoint
in one line before anything is written, bad splits are refused the same way, and a full
disk during a checkpoint write fails the run in one line while the older checkpoints stay
usable (with stale temporary files cleaned at the next start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import store
from trainer.network.unet import PlainConvUNet
from trainer.run import main
from trainer.schema.status import read_status
from trainer.schema.tree import DEFAULT_PLANS, checkpoint_file, run_dir

ROOT = Path(__file__).resolve().parents[3]
DATASET = "Dataset900_NnuiDemo"


def train_argv(preprocessed: Path, results: Path, *extra: str) -> list[str]:
    return [
        "900", "2d", "0", "-device", "cpu", "--epochs", "2", "--iterations-per-epoch", "2",
        "--val-iterations", "1", "--num-workers", "1", "--preprocessed", str(preprocessed),
        "--results", str(results), *extra,
    ]  # fmt: skip


def demo_identity(preprocessed: Path, **changes: str) -> dict[str, str]:
    from trainer.planning.plans import load_plans

    plans = load_plans(preprocessed / DATASET, DEFAULT_PLANS)
    identity = {"dataset_name": DATASET, "configuration": "2d", "plans_name": DEFAULT_PLANS,
                "plans_identity": plans.identity_of("2d"), "fold": "0"}  # fmt: skip
    return {**identity, **changes}


def plant(folder: Path, kind: str, identity: dict, config: dict | None = None) -> Path:
    """A valid checkpoint with the given identity (the network does not matter: the CLI
    refuses before any weights are loaded)."""
    folder.mkdir(parents=True, exist_ok=True)
    net = PlainConvUNet(1, 3, [4, 8], [[3, 3]] * 2, [[1, 1], [2, 2]], [1, 1], [1], 2)
    path = folder / checkpoint_file(kind)
    meta = {"epoch_next": 1, "identity": identity, "config": config or {"num_epochs": 2}}
    store.save(path, net, torch.optim.SGD(net.parameters(), lr=0.1), None, meta)
    return path


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def refused(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flag", "kind"), [("--c", "latest"), ("--val", "final"), ("--val_best", "best")]
)
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"fold": "1"}, "fold='1'"),
        ({"dataset_name": "Dataset901_Other"}, "dataset_name='Dataset901_Other'"),
        ({"configuration": "3d_fullres"}, "configuration='3d_fullres'"),
        ({"plans_identity": "0" * 64}, "plans_identity="),
    ],
)
def test_checkpoint_of_another_run_is_refused_in_one_line_before_anything_is_written(
    demo_preprocessed, tmp_path, capsys, flag, kind, changes, message
):
    folder = run_dir(tmp_path, DATASET, "2d", "0")
    plant(folder, kind, demo_identity(demo_preprocessed.preprocessed, **changes))
    before = contents(tmp_path)
    extra = ["--val", "--val_best"] if flag == "--val_best" else [flag]
    err = refused(train_argv(demo_preprocessed.preprocessed, tmp_path, *extra), capsys)
    assert message in err
    assert contents(tmp_path) == before


def test_older_checkpoint_without_fold_in_its_identity_is_judged_by_its_config(
    demo_preprocessed, tmp_path, capsys
):
    folder = run_dir(tmp_path, DATASET, "2d", "0")
    identity = demo_identity(demo_preprocessed.preprocessed)
    identity.pop("fold")
    plant(folder, "final", identity, config={"num_epochs": 2, "fold": "3"})
    err = refused(train_argv(demo_preprocessed.preprocessed, tmp_path, "--val"), capsys)
    assert "fold='3'" in err


def test_val_refuses_a_damaged_final_checkpoint(demo_preprocessed, tmp_path, capsys):
    folder = run_dir(tmp_path, DATASET, "2d", "0")
    path = plant(folder, "final", demo_identity(demo_preprocessed.preprocessed))
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x10  # inside the tensor bytes
    path.write_bytes(bytes(data))
    err = refused(train_argv(demo_preprocessed.preprocessed, tmp_path, "--val"), capsys)
    assert "cannot validate" in err and "checksum mismatch" in err


# ---- splits -------------------------------------------------------------------------------


@pytest.fixture
def own_demo(demo_preprocessed, tmp_path):
    import shutil

    root = tmp_path / "preprocessed"
    shutil.copytree(demo_preprocessed.preprocessed, root)
    return root


def _splits(preprocessed: Path) -> list[dict]:
    return json.loads((preprocessed / DATASET / "splits_final.json").read_text())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: s[0]["val"].append(s[0]["train"][0]), "fold 0 of"),
        (lambda s: s[3]["val"].append(s[3]["train"][-1]), "fold 3 of"),
        (lambda s: s[0]["train"].append(s[0]["train"][0]), "lists train cases twice"),
        (lambda s: s[1]["val"].extend(s[1]["val"]), "lists val cases twice"),
        (lambda s: s.__setitem__(2, None), "is not a list of"),
    ],
)
def test_bad_splits_are_refused_in_one_line_before_anything_is_written(
    own_demo, tmp_path, capsys, damage, message
):
    splits = _splits(own_demo)
    damage(splits)
    (own_demo / DATASET / "splits_final.json").write_text(json.dumps(splits))
    results = tmp_path / "results"
    err = refused(train_argv(own_demo, results), capsys)
    assert message in err
    if "twice" not in message and "list of" not in message:
        assert "validates on cases it trains on" in err
    assert not results.exists() or not any(results.rglob("*"))


def test_splits_units() -> None:
    from trainer.planning.splits import SplitsError, create_splits, validate_splits

    path = Path("splits_final.json")
    assert validate_splits(create_splits(["a"]), path)  # one case trains and validates on it
    assert validate_splits(create_splits([f"c{i}" for i in range(7)]), path)
    with pytest.raises(SplitsError, match=r"validates on cases it trains on: \['b'\]"):
        validate_splits([{"train": ["a", "b"], "val": ["b", "c"]}], path)
    with pytest.raises(SplitsError, match="twice"):
        validate_splits([{"train": ["a", "a"], "val": ["b"]}], path)


# ---- a full disk while writing a checkpoint (real runs, subprocesses) ---------------------

FULL_DISK_ON_FINAL = """
import errno, sys
from trainer.schema import atomic as schema_atomic
real = schema_atomic._write_all
def write(handle, data):
    if "checkpoint_final" in handle.name:  # half of it lands, then the disk is full
        handle.write(data[: len(data) // 2])
        handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device")
    real(handle, data)
schema_atomic._write_all = write
from trainer.run import main
sys.exit(main(sys.argv[1:]))
"""


def run_trainer(args: list[str], log: Path, code: str | None = None) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = ["-c", code] if code else ["-m", "trainer"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, *command, *args], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            return proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def _flip_a_weight(path: Path) -> None:
    import struct

    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    key = next(k for k in header if k.startswith("model."))
    data[8 + length + header[key]["data_offsets"][0]] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.slow
def test_full_disk_fails_in_one_line_and_continue_uses_the_older_checkpoints(
    demo_preprocessed, tmp_path
):
    results = tmp_path / "results"
    argv = train_argv(demo_preprocessed.preprocessed, results, "--epochs", "3", "--save-every", "1")
    assert run_trainer(argv, tmp_path / "a.log", FULL_DISK_ON_FINAL) == 1
    folder = run_dir(results, DATASET, "2d", "0")
    log = (tmp_path / "a.log").read_text()
    failed = [line for line in log.splitlines() if "failed:" in line]
    assert len(failed) == 1 and "no space left on device" in failed[0], log
    assert "Traceback" not in log
    status = read_status(folder)
    assert status.state == "failed" and "no space left on device" in status.message
    assert not list(folder.glob(".*.tmp")), "partial file left behind"
    assert not (folder / "checkpoint_final.safetensors").exists()

    # The newest older checkpoint is damaged too: --c uses the next one, after cleaning up
    # what a killed write would have left.
    newest = store.find_resume(folder)
    _flip_a_weight(newest.path)
    fallback = store.find_resume(folder)
    assert fallback is not None and fallback.path != newest.path
    stale = folder / f".checkpoint_latest.safetensors.{_dead_pid()}.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert run_trainer([*argv, "--c"], tmp_path / "b.log") == 0, (tmp_path / "b.log").read_text()
    log = (tmp_path / "b.log").read_text()
    assert f"skipping invalid checkpoint {newest.path.name}: checksum mismatch" in log
    assert f"continuing from {fallback.path.name} at epoch {fallback.epoch_next}" in log
    assert "removed 1 temporary file(s) of an interrupted write" in log and not stale.exists()
    assert read_status(folder).state == "finished"
    assert store.load(folder / "checkpoint_final.safetensors")[1]["epoch_next"] == 3


@pytest.mark.slow
def test_a_stop_before_the_first_epoch_of_a_resume_keeps_the_last_checkpoint(
    demo_preprocessed, tmp_path, monkeypatch
):
    """status.json names the checkpoint the run continued from even when a SIGUSR1 during
    start-up stops it before its first epoch (nothing new was saved)."""
    from trainer import stop

    results = tmp_path / "results"
    argv = train_argv(demo_preprocessed.preprocessed, results, "--save-every", "1")
    assert main(argv) == 0
    folder = run_dir(results, DATASET, "2d", "0")
    (folder / checkpoint_file("final")).unlink()  # the run stopped after its latest
    latest = folder / checkpoint_file("latest")
    assert latest.is_file()
    monkeypatch.setattr(stop, "_requested", True)  # SIGUSR1 arrived during start-up
    assert main([*argv, "--epochs", "4", "--c"]) == 0
    status = read_status(folder)
    assert status.state == "stopped"
    assert status.last_checkpoint == str(latest)
