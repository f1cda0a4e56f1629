"""The real nnU-Net 2.8.1 as an nnui engine: launch, follow, stop gracefully, resume.

End to end on CPU: nnU-Net plans and preprocesses a tiny demo, `nnui launch --engine nnunet`
starts `nnUNetv2_train ... -tr nnUNetTrainer_nnui` detached, `nnui stop` ends it at an
epoch end with a loadable checkpoint_latest.pth, `nnui resume` finishes it. nnU-Net refuses
-num_gpus on CPU, so the all-reduced stop flag of its DDP path is tested with gloo ranks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import make_nnunet_tree
from fake_trainer import wait_until
from nnui_cli import job_row, run_nnui

from app.services.launch import engines
from app.services.launch.launcher import plan_launch
from app.services.launch.request import LaunchRequest, check_request
from trainer.schema.nnunet import NNUNET_EXT_DIR, NNUNET_EXT_ENV
from trainer.schema.tree import Roots

ROOT = Path(__file__).resolve().parents[3]
DATASET = "Dataset900_NnuiDemo"
FOLD_DIR = Path(DATASET) / "nnUNetTrainer__nnUNetPlans__2d" / "fold_0"
# Tiny epochs, many of them: the stop sent after the first one lands long before the last,
# however slowly this test's own commands run on a busy machine.
SCHEDULE = ["--epochs", "30", "--iterations-per-epoch", "1", "--val-iterations", "1"]


@pytest.fixture(scope="module")
def nnunet_tree(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("nnunet")
    return {"base": base, "env": make_nnunet_tree(base)}


def _kinds(folder: Path) -> list[str]:
    lines = (folder / "events.jsonl").read_text().splitlines()
    return [json.loads(line)["kind"] for line in lines if line.strip()]


@pytest.mark.slow
# Past the suite-wide 600 s: its own safety nets add up to 25 min, and the module fixture
# (nnU-Net planning and preprocessing) is charged to it; a loaded box took 10 min in all.
@pytest.mark.timeout(1800)
def test_launch_stop_and_resume_a_real_nnunet_fold(nnunet_tree):
    tree, folder = nnunet_tree, nnunet_tree["base"] / "res" / FOLD_DIR
    done = run_nnui(tree["env"], "launch", "900", "2d", "--cpu", "--folds", "0",
                    "--engine", "nnunet", "--", *SCHEDULE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[0]
    assert wait_until(lambda: (folder / "events.jsonl").is_file(), 300)
    assert wait_until(lambda: "epoch_ended" in _kinds(folder), 300)
    row = job_row(tree["env"], job_id)
    assert row["state"] == "running" and row["worker_pids"], row

    stop = run_nnui(tree["env"], "stop", job_id, "--yes")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: job_row(tree["env"], job_id)["exit_code"] is not None, 300)
    row = job_row(tree["env"], job_id)
    assert row["state"] == "stopped" and row["exit_code"] == 0, row
    assert {"stop_requested", "stopped"} <= set(_kinds(folder))
    import torch

    latest = torch.load(folder / "checkpoint_latest.pth", map_location="cpu", weights_only=False)
    assert latest["trainer_name"] == "nnUNetTrainer" and 1 <= latest["current_epoch"] < 30
    assert not (folder / "checkpoint_final.pth").exists()

    resumed = run_nnui(tree["env"], "resume", job_id)
    assert resumed.returncode == 0, resumed.stderr
    new_id = resumed.stdout.split()[0]
    assert wait_until(lambda: job_row(tree["env"], new_id)["exit_code"] is not None, 600)
    row = job_row(tree["env"], new_id)
    assert row["state"] == "finished" and row["exit_code"] == 0, row
    assert (folder / "checkpoint_final.pth").is_file()
    kinds = _kinds(folder)
    assert kinds.count("run_started") == 2 and kinds[-1] == "finished", kinds
    assert (folder / "validation" / "summary.json").is_file()


def _roots(tmp_path: Path) -> Roots:
    pre = tmp_path / "pre" / DATASET
    pre.mkdir(parents=True)
    plans = {"configurations": {"2d": {"batch_size": 4, "patch_size": [32, 32]},
                                "3d_cascade_fullres": {"inherits_from": "3d_fullres"}}}  # fmt: skip
    (pre / "nnUNetPlans.json").write_text(json.dumps(plans))
    return Roots(tmp_path / "raw", tmp_path / "pre", tmp_path / "res")


def _request(**changes) -> LaunchRequest:
    fields = dict(dataset="900", configuration="2d", folds=["0"], gpus=["0"], mode="per_gpu",
                  device="cuda", trainer_args=["--epochs", "3"], simulated=False,
                  engine="nnunet")  # fmt: skip
    return LaunchRequest(**{**fields, **changes})


def test_an_nnunet_launch_runs_nnunets_entry_with_the_extension_trainer(tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "nnunet_available", lambda: True)
    roots = _roots(tmp_path)
    plans, errors = plan_launch(_request(trainer_args=["-tr", "nnUNetTrainerNoMirroring"]),
                                roots, 4)  # fmt: skip
    assert errors == []
    (plan,) = plans
    assert plan.argv[1:3] == ["-m", "trainer.nnunet_engine"]
    assert plan.argv[3:6] == [DATASET, "2d", "0"]
    # A stock trainer name runs its nnui wrapper (stock trainers die of SIGUSR1) and trains
    # in the stock trainer's own fold folder.
    assert plan.argv[plan.argv.index("-tr") + 1] == "nnUNetTrainerNoMirroring_nnui"
    assert plan.argv.count("-tr") == 1 and plan.argv[plan.argv.index("-p") + 1] == "nnUNetPlans"
    assert (
        plan.run_dir
        == roots.results / DATASET / "nnUNetTrainerNoMirroring__nnUNetPlans__2d" / "fold_0"
    )
    assert plan.env[NNUNET_EXT_ENV].split(os.pathsep)[0] == str(NNUNET_EXT_DIR)
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0" and plan.engine == "nnunet"
    spawn, _ = plan_launch(_request(mode="spawn", gpus=["0", "1"]), roots, 4)
    assert spawn[0].argv[-2:] == ["-num_gpus", "2"]


@pytest.mark.parametrize(
    ("changes", "available", "message"),
    [
        ({"mode": "torchrun", "gpus": ["0", "1"]}, True, "-num_gpus only"),
        ({}, False, "pip install 'nnui[nnunet]'"),
        ({"configuration": "3d_fullres"}, True, "unknown configuration '3d_fullres'"),
        ({"trainer_args": ["-p", "nnUNetResEncUNetLPlans"]}, True, "nnUNetResEncUNetLPlans.json"),
    ],
)
def test_nnunet_launches_that_cannot_work_are_refused(
    tmp_path, monkeypatch, changes, available, message
):
    monkeypatch.setattr(engines, "nnunet_available", lambda: available)
    checks = check_request(_request(**changes), _roots(tmp_path), 4)
    assert any(message in e for e in checks.errors), checks.errors


def test_a_stock_nnunet_fold_folder_is_finished_or_resumable(tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "nnunet_available", lambda: True)
    roots = _roots(tmp_path)
    folder = roots.results / FOLD_DIR
    folder.mkdir(parents=True)
    (folder / "checkpoint_latest.pth").write_bytes(b"x")
    checks = check_request(_request(), roots, 4)
    assert checks.resumable_folds == ["0"] and "continue it with --c" in checks.errors[0]
    assert check_request(_request(continue_training=True), roots, 4).errors == []
    (folder / "checkpoint_final.pth").write_bytes(b"x")
    assert "already finished" in check_request(_request(), roots, 4).errors[0]


# Which ranks asked to stop, round by round: none, one, two of three.
FLAGGED_ROUNDS = [[], [1], [0, 2]]


def _agree(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from trainer.nnunet_ext.nnui_trainers import agree_on_stop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    import torch

    answers = [agree_on_stop(rank in flagged, torch.device("cpu")) for flagged in FLAGGED_ROUNDS]
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(json.dumps(answers))


def test_the_stop_flag_is_all_reduced_across_ranks(tmp_path):
    """Each round every rank gets the same answer: stop when any rank asked. (One process
    group for all rounds: three ranks importing nnU-Net cost far more than the all-reduces.)"""
    pytest.importorskip("nnunetv2")
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(_agree, args=(3, port, str(tmp_path)), nprocs=3, join=True)
    answers = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(3)]
    assert answers == [[bool(flagged) for flagged in FLAGGED_ROUNDS]] * 3


def test_nnui_schedule_flags_become_the_extension_trainers_environment():
    from trainer.nnunet_engine import UsageError, split_schedule_flags

    rest, env = split_schedule_flags(["900", "2d", "0", "--epochs", "3", "--save-every=2", "--c"])
    assert rest == ["900", "2d", "0", "--c"]
    assert env == {"NNUI_EPOCHS": "3", "NNUI_SAVE_EVERY": "2"}
    with pytest.raises(UsageError, match="--epochs needs a whole number"):
        split_schedule_flags(["--epochs", "x"])
