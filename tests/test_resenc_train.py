"""`nnui-preprocess -pl nnUNetPlannerResEncM` on the demo: the preset's plans only (the default
data shared), the default data made first when missing, nnU-Net's files untouched; the same
plans nnU-Net 2.8.1's planner makes; and a ResEnc training stopped with SIGUSR1 and continued
with --c equal bit for bit to an uninterrupted one (CPU), under every launch mode."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_ddp_e2e import Procs, assert_clean_finish, torchrun
from test_trainer_run import events, finish, losses, model_tensors, start, wait_for

from trainer.demo import make_demo_dataset
from trainer.planning import preprocess
from trainer.schema.status import read_status
from trainer.schema.tree import Roots, run_dir

DATASET = "Dataset900_NnuiDemo"
PRESET = "nnuiResEncUNetMPlans"
# Tiny overrides so that training on 2 CPU cores takes seconds (the planned ones are larger).
TINY = ["--patch-size", "16", "32", "32", "--batch-size", "3d_fullres=2"]


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _pl(raw: Path, pre: Path, *extra: str) -> list[str]:
    return ["900", "-pl", "nnUNetPlannerResEncM", "--raw", str(raw), "--preprocessed", str(pre),
            "-np", "1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def resenc(demo_preprocessed, tmp_path_factory):
    """The demo's default data plus the M preset (tiny 3d patch), nnU-Net's own preset file
    planted beside them."""
    pre = tmp_path_factory.mktemp("resenc") / "pre"
    shutil.copytree(demo_preprocessed.preprocessed, pre)
    theirs = pre / DATASET / "nnUNetResEncUNetMPlans.json"
    theirs.write_text('{"plans_name": "nnUNetResEncUNetMPlans"}\n')
    before = _digests(pre)
    assert preprocess.main(_pl(demo_preprocessed.raw, pre, "-c", "3d_fullres", *TINY)) == 0
    return {"raw": demo_preprocessed.raw, "pre": pre, "before": before}


def test_preset_writes_only_its_plans_on_the_default_data(resenc):
    after = _digests(resenc["pre"])
    assert set(after) - set(resenc["before"]) == {f"{DATASET}/{PRESET}.json"}
    assert all(after[k] == v for k, v in resenc["before"].items())  # nnU-Net's file included
    plans = json.loads((resenc["pre"] / DATASET / f"{PRESET}.json").read_text())
    block = plans["configurations"]["3d_fullres"]
    assert plans["plans_name"] == PRESET
    assert block["data_identifier"] == "nnuiPlans_3d_fullres"
    assert block["network"]["architecture"] == "ResidualEncoderUNet"
    num_stages = len(block["network"]["strides"])
    assert block["network"]["n_blocks_per_stage"] == [1, 3, 4, 6, 6][:num_stages]
    assert block["patch_size"] == [16, 32, 32] and block["batch_size"] == 2


def test_board_lists_every_nnui_plans_identifier_and_not_nnunets(resenc, tmp_path):
    from app.services.launch import catalog, engines

    roots = Roots(resenc["raw"], resenc["pre"], tmp_path)
    listed = {(d.plans, c.name, c.batch_size)
              for d in catalog.list_engine_datasets(roots, engines.engine("nnui"))
              for c in d.configurations}  # fmt: skip
    assert (PRESET, "3d_fullres", 2) in listed
    assert {plans for plans, _, _ in listed} == {"nnuiPlans", PRESET}


def test_preset_makes_only_the_missing_default_data_first(tmp_path, capsys):
    raw = tmp_path / "raw"
    make_demo_dataset(raw, num_cases=2, seed=3, shape_scale=0.2)
    pre = tmp_path / "pre"
    folder = pre / DATASET
    assert preprocess.main(_pl(raw, pre, "-c", "2d")) == 0  # a fresh tree: 2d data made
    assert "data of 2d, missing or out of date: making it" in capsys.readouterr().out
    assert (folder / "nnuiPlans.json").is_file() and (folder / f"{PRESET}.json").is_file()
    data_2d = _digests(folder / "nnuiPlans_2d")
    assert data_2d and not list(folder.glob("nnUNet*"))
    assert preprocess.main(_pl(raw, pre)) == 0  # both: only 3d_fullres is made
    assert "data of 3d_fullres, missing" in capsys.readouterr().out
    assert _digests(folder / "nnuiPlans_2d") == data_2d
    plans = json.loads((folder / f"{PRESET}.json").read_text())
    assert sorted(plans["configurations"]) == ["2d", "3d_fullres"]
    before = _digests(pre)  # again: nothing to make, the same plans
    assert preprocess.main(_pl(raw, pre)) == 0
    assert "reusing the nnuiPlans data" in capsys.readouterr().out
    assert _digests(pre) == before


def test_unknown_planner_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        preprocess.main(["900", "-pl", "nnUNetPlannerResEncXXL", "--raw", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "nnUNetPlannerResEncM" in capsys.readouterr().err


# ---- the same plans as nnU-Net 2.8.1's planner ------------------------------------------------


def _nnunet(tool: str, env: dict) -> None:
    argv = [str(Path(sys.executable).with_name(tool)), "-d", "900"]
    fingerprint = tool == "nnUNetv2_extract_fingerprint"
    argv += ["-np", "1"] if fingerprint else ["-pl", "nnUNetPlannerResEncM"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def _summary(block: dict) -> dict:
    # nnU-Net's layout: architecture.arch_kwargs; nnui's: network
    net = block["architecture"]["arch_kwargs"] if "architecture" in block else block["network"]
    return {"patch": list(block["patch_size"]), "batch": block["batch_size"],
            "features": list(net["features_per_stage"]),
            "strides": [list(s) for s in net["strides"]],
            "kernels": [list(k) for k in net["kernel_sizes"]],
            "blocks": list(net["n_blocks_per_stage"]),
            "decoder": list(net["n_conv_per_stage_decoder"])}  # fmt: skip


@pytest.mark.slow
def test_plans_equal_nnunets_resenc_planner(demo_raw, tmp_path):
    """Patch, batch, features, strides, kernels and blocks of 2d and 3d_fullres: the demo,
    then a large fingerprint where the memory target shrinks the patch."""
    import os

    pytest.importorskip("nnunetv2", reason="make setup installs nnunetv2 (extra 'nnunet')")
    from trainer.planning.resenc import plan_preset

    raw, pre = tmp_path / "raw", tmp_path / "pre"
    shutil.copytree(demo_raw, raw)
    env = {**os.environ, "nnUNet_raw": str(raw), "nnUNet_preprocessed": str(pre),
           "nnUNet_results": str(tmp_path / "res")}  # fmt: skip
    _nnunet("nnUNetv2_extract_fingerprint", env)
    _nnunet("nnUNetv2_plan_experiment", env)
    folder = pre / DATASET
    theirs = json.loads((folder / "nnUNetResEncUNetMPlans.json").read_text())["configurations"]
    assert preprocess.main(_pl(raw, tmp_path / "ours")) == 0  # nnui's own fingerprint
    ours = json.loads((tmp_path / "ours" / DATASET / f"{PRESET}.json").read_text())
    for name in ("2d", "3d_fullres"):
        assert _summary(ours["configurations"][name]) == _summary(theirs[name]), name
    # a large dataset: the patch shrinks to the memory target
    fingerprint = json.loads((folder / "dataset_fingerprint.json").read_text())
    n = len(fingerprint["spacings"])
    fingerprint["spacings"] = [[1.0, 0.8, 0.8]] * (n - 1) + [[1.2, 0.7, 0.7]]
    fingerprint["shapes_after_crop"] = [[160, 320, 300]] * (n - 1) + [[200, 350, 350]]
    (folder / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))
    _nnunet("nnUNetv2_plan_experiment", env)
    theirs = json.loads((folder / "nnUNetResEncUNetMPlans.json").read_text())["configurations"]
    dataset_json = json.loads((folder / "dataset.json").read_text())
    mine = plan_preset(fingerprint, dataset_json, DATASET, "nnUNetPlannerResEncM")
    from trainer.planning.plans import plans_content

    for name, block in plans_content(mine)["configurations"].items():
        assert _summary(block) == _summary(theirs[name]), name


# ---- training: stop and --c, bit for bit ------------------------------------------------------


def _argv(resenc: dict, results: Path, *extra: str) -> list[str]:
    return ["900", "3d_fullres", "0", "-p", PRESET, "-device", "cpu", "--epochs", "2",
            "--iterations-per-epoch", "2", "--val-iterations", "1", "--num-workers", "1",
            "--raw", str(resenc["raw"]), "--preprocessed", str(resenc["pre"]),
            "--results", str(results), *extra]  # fmt: skip


def _run_dir(results: Path) -> Path:
    return run_dir(results, DATASET, "3d_fullres", "0", plans=PRESET)


@pytest.mark.slow
def test_resenc_stop_and_continue_equal_an_uninterrupted_run(resenc, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    a = start(_argv(resenc, whole), tmp_path / "a.log")
    b = start(_argv(resenc, split), tmp_path / "b.log")
    folder = _run_dir(split)
    try:
        wait_for(lambda: (s := read_status(folder)) is not None and s.state == "running", b)
        b.send_signal(signal.SIGUSR1)
        assert finish(b) == 0, (tmp_path / "b.log").read_text()
        assert finish(a) == 0, (tmp_path / "a.log").read_text()
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
    assert folder.parent.name == f"nnuiTrainer__{PRESET}__3d_fullres"
    assert [e["kind"] for e in events(folder)][-1] == "stopped"
    assert not (folder / "checkpoint_final.safetensors").exists()
    resumed = start([*_argv(resenc, split), "--c"], tmp_path / "c.log")
    assert finish(resumed) == 0, (tmp_path / "c.log").read_text()
    assert losses(folder) == losses(_run_dir(whole))
    final_a = model_tensors(_run_dir(whole) / "checkpoint_final.safetensors")
    final_b = model_tensors(folder / "checkpoint_final.safetensors")
    assert final_a.keys() == final_b.keys()
    assert any(".skip." in k for k in final_a)  # the residual network was trained
    assert all(final_a[k].equal(final_b[k]) for k in final_a)


@pytest.fixture
def procs(tmp_path: Path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_resenc_trains_with_two_processes(resenc, tmp_path, procs, launcher):
    """-num_gpus 2 (gloo on CPU) and torchrun; the one-process mode is the test above."""
    args = _argv(resenc, tmp_path / "r", "--epochs", "1")
    if launcher == "spawn":
        argv = [sys.executable, "-m", "trainer", *args, "-num_gpus", "2"]
    else:
        argv = [*torchrun("--standalone", "--nproc_per_node=2"), *args]
    proc = procs.start(argv, launcher)
    assert proc.wait(timeout=600) == 0, procs.log(launcher)
    ranks = assert_clean_finish(_run_dir(tmp_path / "r"), 2, launcher)
    assert [r["batch_size"] for r in ranks] == [1, 1]  # the preset's global batch 2
