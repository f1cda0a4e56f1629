"""One tree, two tools: nnui shares nnUNet_raw/preprocessed/results with a real nnU-Net 2.8.1
and never changes a byte of what nnU-Net made (docs/nnunet.md).

The preprocessed folder is made by nnU-Net itself (nnUNetv2_plan_and_preprocess, installed in
the test venv by `make setup`); nnU-Net's results folder holds the files its trainer writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_nnunet_tree

from trainer.schema.nnunet import nnunet_files
from trainer.schema.tree import (
    DEFAULT_PLANS,
    DEFAULT_TRAINER,
    EVENTS_FILE,
    FINGERPRINT_FILE,
    LEGACY_PLANS,
    LEGACY_TRAINER,
    plans_file_name,
)

ROOT = Path(__file__).resolve().parents[2]
DATASET = "Dataset900_NnuiDemo"
NNUNET_FOLD = "nnUNetTrainer__nnUNetPlans__2d"
SHORT = ["-device", "cpu", "--epochs", "1", "--iterations-per-epoch", "2", "--val-iterations", "1"]
pytestmark = pytest.mark.slow


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict:
    """raw + nnU-Net's preprocessed (made by nnU-Net) + an nnU-Net results folder."""
    base = tmp_path_factory.mktemp("shared")
    env = make_nnunet_tree(base)
    trainer_dir = base / "res" / DATASET / NNUNET_FOLD
    fold = trainer_dir / "fold_0"
    fold.mkdir(parents=True)
    # What nnU-Net's trainer leaves in its results (contents do not matter, names do).
    for name, data in {
        "checkpoint_final.pth": os.urandom(256),
        "checkpoint_best.pth": os.urandom(256),
        "training_log_2026_12_1_10_00_00.txt": b"2026-12-01 epoch 0\n",
        "debug.json": b"{}",
        "progress.png": b"\x89PNG\r\n",
    }.items():
        (fold / name).write_bytes(data)
    for name in ("dataset.json", "nnUNetPlans.json", "dataset_fingerprint.json"):
        target = "plans.json" if name == "nnUNetPlans.json" else name
        shutil.copy(base / "pre" / DATASET / name, trainer_dir / target)
    return {"base": base, "env": env}


def _nnunet_digests(tree: dict) -> dict[str, str]:
    base = tree["base"]
    pre = {k: v for k, v in _digests(base / "pre").items() if not _is_nnui(k)}
    res = _digests(base / "res" / DATASET / NNUNET_FOLD)
    return {**{f"pre/{k}": v for k, v in pre.items()}, **{f"res/{k}": v for k, v in res.items()}}


def _is_nnui(relative: str) -> bool:
    first = relative.split("/")[1] if "/" in relative else ""
    return first.startswith("nnui") or first == "splits_final.json"


def _run(tree: dict, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), env=tree["env"], capture_output=True, text=True, cwd=ROOT)


def test_every_nnui_command_leaves_nnunets_files_byte_identical(tree):
    before = _nnunet_digests(tree)
    pre = tree["base"] / "pre" / DATASET

    done = _run(tree, _bin("nnui-preprocess"), "900", "-c", "2d", "-np", "1")
    assert done.returncode == 0, done.stderr
    assert "nnU-Net's files: they are left untouched" in done.stdout
    assert _nnunet_digests(tree) == before
    assert (pre / plans_file_name(DEFAULT_PLANS)).is_file()
    assert (pre / FINGERPRINT_FILE).is_file()
    assert any((pre / f"{DEFAULT_PLANS}_2d").glob("*.b2nd"))
    assert nnunet_files(pre / f"{DEFAULT_PLANS}_2d") == []  # nothing of nnU-Net's mixed in

    # splits_final.json is shared: nnui writes nnU-Net's own folds when there is none.
    from nnunetv2.utilities.crossval_split import generate_crossval_split

    ids = sorted(p.name[: -len(".b2nd")] for p in (pre / "nnUNetPlans_2d").glob("*[0-9].b2nd"))
    splits = json.loads((pre / "splits_final.json").read_text())
    theirs = generate_crossval_split(ids, seed=12345, n_splits=5)
    assert splits == [{"train": list(map(str, s["train"])), "val": list(map(str, s["val"]))}
                      for s in theirs]  # fmt: skip
    splits_bytes = (pre / "splits_final.json").read_bytes()

    done = _run(tree, _bin("nnui-train"), "900", "2d", "0", *SHORT)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = tree["base"] / "res" / DATASET / f"{DEFAULT_TRAINER}__{DEFAULT_PLANS}__2d" / "fold_0"
    assert (ours / EVENTS_FILE).is_file()
    assert _nnunet_digests(tree) == before

    for argv, message in [
        (["-tr", LEGACY_TRAINER, "-p", LEGACY_PLANS], "nnU-Net run folder"),
        (["-tr", LEGACY_TRAINER, "-p", LEGACY_PLANS, "--c"], "nnU-Net run folder"),
        (["-p", "nnUNetResEncUNetLPlans"], "not an nnui plans identifier"),
    ]:
        done = _run(tree, _bin("nnui-train"), "900", "2d", "0", *SHORT, *argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr

    for argv in (["status"], ["status", "--json"], ["launch", "900", "2d", "--cpu", "--folds",
                                                     "1", "--dry-run"]):  # fmt: skip
        done = _run(tree, sys.executable, "-m", "app.main", *argv)
        assert done.returncode == 0, (argv, done.stderr)
    assert _nnunet_digests(tree) == before
    # A second preprocessing keeps the shared splits as they are.
    assert _run(tree, _bin("nnui-preprocess"), "900", "-c", "2d", "-np", "1").returncode == 0
    assert (pre / "splits_final.json").read_bytes() == splits_bytes
    assert _nnunet_digests(tree) == before


def test_a_data_folder_holding_nnunets_files_is_refused_before_anything_is_written(tmp_path):
    from trainer.demo import make_demo_dataset
    from trainer.planning.preprocess import SharedTreeError, preprocess_dataset
    from trainer.planning.rules import Overrides

    make_demo_dataset(tmp_path / "raw", num_cases=3, seed=0, shape_scale=0.3)
    folder = tmp_path / "pre" / DATASET / f"{DEFAULT_PLANS}_2d"
    folder.mkdir(parents=True)
    (folder / "case.pkl").write_bytes(b"nnU-Net's")
    (folder / "case.b2nd").write_bytes(b"nnU-Net's")
    with pytest.raises(SharedTreeError, match="holds nnU-Net's files"):
        preprocess_dataset(tmp_path / "raw", tmp_path / "pre", "900", ("2d",), 1, Overrides())
    left = sorted(p.name for p in (tmp_path / "pre" / DATASET).rglob("*"))
    assert left == sorted([f"{DEFAULT_PLANS}_2d", "case.b2nd", "case.pkl"])


@pytest.mark.parametrize(
    ("trainer", "plans", "continuing", "events", "refused"),
    [
        (DEFAULT_TRAINER, DEFAULT_PLANS, False, False, False),
        (LEGACY_TRAINER, LEGACY_PLANS, False, False, True),  # nothing new under nnU-Net's names
        (LEGACY_TRAINER, LEGACY_PLANS, True, False, True),  # no nnui 0.1 run to continue
        (LEGACY_TRAINER, LEGACY_PLANS, True, True, False),  # nnui 0.1's run: --c continues it
        (DEFAULT_TRAINER, LEGACY_PLANS, False, True, True),
    ],
)
def test_old_identifiers_only_continue_runs_nnui_made(
    tmp_path, trainer, plans, continuing, events, refused
):
    from trainer.run import UsageError, _check_shared_tree

    if events:
        (tmp_path / EVENTS_FILE).write_text("")
    if refused:
        with pytest.raises(UsageError, match="nnU-Net's names"):
            _check_shared_tree(tmp_path, trainer, plans, continuing)
    else:
        _check_shared_tree(tmp_path, trainer, plans, continuing)


def test_resume_of_an_old_job_names_its_folders_identifiers():
    from app.services.jobs.registry import Job
    from app.services.launch.request import resume_request

    def job(folder: str, args: list[str]) -> Job:
        return Job(
            job_id="j", created_at=0.0, dataset=DATASET, configuration="2d", fold="0",
            mode="single", device="cpu", gpus=[], simulated=False, argv=[], env={},
            run_dir=f"/r/{DATASET}/{folder}/fold_0", console_path="/r/c.log", trainer_args=args,
        )  # fmt: skip

    old = resume_request(job(f"{LEGACY_TRAINER}__{LEGACY_PLANS}__2d", ["--epochs", "3"]))
    assert old.trainer_args == ["--epochs", "3", "-tr", LEGACY_TRAINER, "-p", LEGACY_PLANS]
    new = resume_request(job(f"{DEFAULT_TRAINER}__{DEFAULT_PLANS}__2d", ["--epochs", "3"]))
    assert new.trainer_args == ["--epochs", "3"]


@pytest.mark.parametrize(
    ("names", "theirs"),
    [
        (["events.jsonl", "status.json", "checkpoint_latest.safetensors"], []),
        (["events.jsonl", "checkpoint_final.pth"], ["checkpoint_final.pth"]),
        (["training_log_2026_1_1_00_00_00.txt"], ["training_log_2026_1_1_00_00_00.txt"]),
        (["nnUNetResEncUNetLPlans.json", "nnuiPlans.json"], ["nnUNetResEncUNetLPlans.json"]),
        (["case_000.pkl", "case_000.b2nd"], ["case_000.pkl"]),
    ],
)
def test_nnunet_files_are_recognised_by_name(tmp_path, names, theirs):
    for name in names:
        (tmp_path / name).write_text("")
    assert nnunet_files(tmp_path) == theirs
    assert nnunet_files(tmp_path / "missing") == []
