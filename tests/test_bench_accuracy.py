"""bench/accuracy.py: what it reads from each side and how it reports (no training here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import accuracy


def _args(**overrides) -> accuracy.AccuracyArgs:
    values = dict(
        work=Path("/tmp/x"), cases=20, shape_scale=0.5, configuration="2d", epochs=3,
        iterations=2, val_iterations=1, folds=["0", "1"], repeats=1, num_workers=2,
        order="alternate", nnui_args=[],
    )  # fmt: skip
    values.update(overrides)
    return accuracy.AccuracyArgs(**values)


def test_read_summary_takes_foreground_mean_and_per_label_dice(tmp_path):
    path = tmp_path / "summary.json"
    summary = {
        "foreground_mean": {"Dice": 0.75, "IoU": 0.6},
        "mean": {"1": {"Dice": 0.9, "IoU": 0.8}, "2": {"Dice": 0.6, "IoU": 0.4}},
        "metric_per_case": [],
    }
    path.write_text(json.dumps(summary))
    assert accuracy.read_summary(path) == (0.75, {"1": 0.9, "2": 0.6})


def test_read_summary_of_a_missing_file_is_nan(tmp_path):
    fg, labels = accuracy.read_summary(tmp_path / "absent.json")
    assert fg != fg and labels == {}


def test_nnunet_pseudo_dice_reads_numpy_reprs_from_its_log(tmp_path):
    (tmp_path / "training_log_2026_1_1_00_00_00.txt").write_text(
        "2026-12-01 18:57:21.273432: Pseudo dice [np.float32(0.2), np.float32(0.4)]\n"
        "2026-12-01 18:57:33.729146: Pseudo dice [0.5, 0.7]\n"
    )
    assert accuracy.nnunet_pseudo_dice(tmp_path) == [0.3, 0.6]


def test_nnui_pseudo_dice_reads_epoch_ended_events(tmp_path):
    events = tmp_path / "events.jsonl"
    lines = [
        {"kind": "run_started"},
        {"kind": "epoch_ended", "epoch": 1, "mean_fg_dice": 0.25},
        {"kind": "epoch_ended", "epoch": 2, "mean_fg_dice": 0.5},
    ]
    events.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"kind": "epo')  # torn tail
    assert accuracy.nnui_pseudo_dice(events) == [0.25, 0.5]


def test_learned_epoch_is_the_first_epoch_each_label_reaches_half(tmp_path):
    (tmp_path / "training_log_2026_1_1_00_00_00.txt").write_text(
        "".join(f"x: Pseudo dice [{a}, {b}]\n" for a, b in [(0.3, 0.0), (0.8, 0.2), (0.9, 0.6)])
    )
    curves = accuracy.nnunet_pseudo_dice_per_label(tmp_path)
    assert accuracy.learned_epoch(curves) == {"1": 1, "2": 2}
    events = tmp_path / "events.jsonl"
    rows = [{"kind": "epoch_ended", "dice_per_class": [0.7, x]} for x in (0.0, 0.1)]
    events.write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    per_label = accuracy.nnui_pseudo_dice_per_label(events)
    assert accuracy.learned_epoch(per_label) == {"1": 0, "2": None}


def test_summary_ends_with_the_difference_and_wall_ratio_lines():
    def run(side, fold, dice, wall):
        return accuracy.FoldRun(side, fold, 0, 0, dice, {"1": dice}, wall, 2 * wall)

    runs = [
        run("nnU-Net", "0", 0.80, 100.0),
        run("nnui", "0", 0.82, 60.0),
        run("nnU-Net", "1", 0.70, 100.0),
        run("nnui", "1", 0.66, 60.0),
    ]
    lines = accuracy.summarize(_args(), runs)
    assert lines[-2] == "mean foreground Dice difference nnui - nnU-Net = -0.010"
    assert lines[-1] == "wall time ratio nnui/nnU-Net = 0.60"
    assert "CPU-s ratio nnui/nnU-Net = 0.60" in lines


def test_repeats_run_every_fold_again_and_count_in_the_spread():
    a = _args(folds=["0", "1"], repeats=2)
    assert a.units() == [("0", 0), ("1", 0), ("0", 1), ("1", 1)]

    def run(side, fold, repeat, dice):
        return accuracy.FoldRun(side, fold, repeat, 0, dice, {"1": dice}, 10.0, 5.0)

    runs = [
        run(side, fold, repeat, 0.5 + (0.1 if side == "nnui" else 0.0) + 0.01 * repeat)
        for fold, repeat in a.units()
        for side in accuracy.SIDES
    ]
    lines = accuracy.summarize(a, runs)
    assert sum(line.startswith("fold 1 repeat 1: foreground Dice") for line in lines) == 1
    assert "Dice difference per run: +0.100 +0.100 +0.100 +0.100" in "\n".join(lines)
    assert lines[-2] == "mean foreground Dice difference nnui - nnU-Net = +0.100"


@pytest.mark.parametrize(
    "argv",
    [
        ["--repeats", "0"],
        ["--folds", "7"],
        ["--epochs", "0"],
        ["--cases", "3"],
        ["--shape-scale", "9"],
    ],
)
def test_bad_arguments_exit_2_with_one_error_line(argv, capsys):
    assert accuracy.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


# ---- --raw: each side's own plans, the same override, the per-fold table ------------------

import accuracy_data  # noqa: E402
import accuracy_raw  # noqa: E402

FAKE_NNUNET = """#!{python}
import json, os, pathlib, sys
# Stands in for nnUNetv2_plan_and_preprocess: counts its calls, writes the given plans.
pre = pathlib.Path(os.environ["nnUNet_preprocessed"]) / "{name}"
pre.mkdir(parents=True, exist_ok=True)
(pre / "nnUNetPlans.json").write_text(pathlib.Path("{plans}").read_text())
with open("{calls}", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
"""


def nnunet_plans_like(nnui: dict, configuration: str) -> dict:
    """nnU-Net's layout of nnui's planned configuration (2 values per 2d spacing)."""
    conf = nnui["configurations"][configuration]
    ndim = len(conf["patch_size"])
    net = conf["network"]
    block = {
        "patch_size": conf["patch_size"], "batch_size": conf["batch_size"],
        "spacing": conf["spacing"][-ndim:],
        "median_image_size_in_voxels": conf["median_image_size_in_voxels"][-ndim:],
        "normalization_schemes": conf["normalization_schemes"],
        "use_mask_for_norm": conf["use_mask_for_norm"], "batch_dice": conf["batch_dice"],
        "architecture": {"arch_kwargs": {
            "features_per_stage": net["features_per_stage"], "kernel_sizes": net["kernel_sizes"],
            "strides": net["strides"], "n_conv_per_stage": net["n_conv_per_stage_encoder"],
            "n_conv_per_stage_decoder": net["n_conv_per_stage_decoder"]}},
    }  # fmt: skip
    return {
        "transpose_forward": nnui["transpose_forward"],
        "configurations": {name: block for name in nnui["configurations"]},
    }


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("acc_raw")
    assert accuracy_data.main(["--out", str(root), "--cases", "5", "--shape-scale", "0.25"]) == 0
    return root


def test_generated_datasets_are_two_channel_isotropic_and_thick_sliced(generated):
    import SimpleITK as sitk

    multi = generated / accuracy_data.MULTI_CHANNEL
    assert json.loads((multi / "dataset.json").read_text())["channel_names"] == {
        "0": "T1",
        "1": "T2",
    }
    first = [sitk.ReadImage(str(multi / "imagesTr" / f"mc_000_000{c}.nii.gz")) for c in (0, 1)]
    assert first[0].GetSize() == first[1].GetSize() and first[0].GetSpacing() == (1.0,) * 3
    a0, a1 = (sitk.GetArrayFromImage(i) for i in first)
    assert a1.max() > 5 * a0.max()  # the second contrast has its own intensity range
    aniso = generated / accuracy_data.ANISO
    for path in sorted((aniso / "imagesTr").glob("*.nii.gz")):
        spacing = sitk.ReadImage(str(path)).GetSpacing()  # x, y, z
        assert spacing[2] / spacing[0] > 3


def test_raw_mode_plans_each_side_and_overrides_both_in_the_work_folder(generated, tmp_path):
    ds = accuracy_raw.raw_dataset(str(generated / accuracy_data.MULTI_CHANNEL))
    assert (ds.dataset_id, ds.name) == (910, "Dataset910_NnuiMultiChannel")
    before = sorted((p.name, p.stat().st_mtime) for p in ds.folder.rglob("*"))
    # nnui's real planner first, to give the stand-in nnU-Net the same plans
    scratch = tmp_path / "scratch"
    accuracy_raw.preprocess_both(scratch, ds, "3d_fullres", _fake_venv(tmp_path, ds, None))
    nnui = accuracy_raw.planned(scratch, "nnui")
    work = tmp_path / "work"
    venv = _fake_venv(tmp_path, ds, nnunet_plans_like(nnui, "3d_fullres"))
    walls = accuracy_raw.preprocess_both(work, ds, "3d_fullres", venv)
    assert set(walls) == {"nnU-Net", "nnui"}
    theirs = accuracy_raw.nnunet_fields(accuracy_raw.planned(work, "nnU-Net"), "3d_fullres")
    ours = accuracy_raw.nnui_fields(accuracy_raw.planned(work, "nnui"), "3d_fullres")
    assert accuracy_raw.plan_differences(theirs, ours) == []
    assert accuracy_raw.plan_lines(theirs, ours, "3d_fullres")[-1].startswith("plans equal: yes")

    divisor = [2 ** sum(1 for s in theirs["strides"] if s[i] > 1) for i in range(3)]
    patch = [d * 2 for d in divisor]
    accuracy_raw.check_override(theirs, patch)
    accuracy_raw.apply_override(work, ds, "3d_fullres", patch, 3)
    nnunet_file = work / "nnunet_preprocessed" / ds.name / "nnUNetPlans.json"
    nnui_file = work / "nnui_preprocessed" / ds.name / "nnuiPlans.json"
    stages = []
    for path in (nnunet_file, nnui_file):
        conf = json.loads(path.read_text())["configurations"]["3d_fullres"]
        assert (conf["patch_size"], conf["batch_size"]) == (patch, 3)
        net = conf.get("network") or conf["architecture"]["arch_kwargs"]
        stages.append(len(net["strides"]))
        assert len(net["features_per_stage"]) == len(net["kernel_sizes"]) == stages[-1]
        assert len(net["n_conv_per_stage_decoder"]) == stages[-1] - 1
    # a bottleneck of 2 voxels is under nnU-Net's 4: both sides lose the same deepest stages
    assert stages == [accuracy_raw.stages_for(theirs["strides"], patch)] * 2
    assert stages[0] < len(theirs["strides"])
    assert accuracy_raw.planned(work, "nnui") == nnui  # the planned copy stays as planned
    line = accuracy_raw.override_line(theirs, patch, 3)
    assert "SAME on both sides" in line and f"-> {patch}" in line and "-> 3" in line
    assert f"cut from {len(theirs['strides'])} to {stages[0]} stages" in line
    # cached: a second call plans nothing again; the user's raw folder was only read
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    accuracy_raw.preprocess_both(work, ds, "3d_fullres", venv)
    assert (tmp_path / "calls.txt").read_text().splitlines() == calls
    assert sorted((p.name, p.stat().st_mtime) for p in ds.folder.rglob("*")) == before


def _fake_venv(tmp_path: Path, ds, plans: dict | None) -> Path:
    venv = tmp_path / ("venv_real" if plans else "venv_dummy")
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    plans_path = venv / "plans.json"
    plans_path.write_text(json.dumps(plans or {"configurations": {}}))
    script = venv / "bin" / "nnUNetv2_plan_and_preprocess"
    text = FAKE_NNUNET.format(
        python=sys.executable, name=ds.name, plans=plans_path, calls=tmp_path / "calls.txt"
    )
    script.write_text(text)
    script.chmod(0o755)
    return venv


def test_plan_differences_name_the_field():
    base = {"patch_size": [64, 64], "spacing": [1.0, 1.0], "strides": [[1, 1], [2, 2]]}
    assert accuracy_raw.plan_differences(base, {**base, "spacing": [1.0, 1.0 + 1e-12]}) == []
    assert accuracy_raw.plan_differences(base, {**base, "patch_size": [32, 64]}) == [
        "patch_size: nnU-Net [64, 64], nnui [32, 64]"
    ]


def test_a_smaller_patch_keeps_the_stages_whose_map_stays_four_voxels():
    drive = [[1, 1]] + [[2, 2]] * 7  # DRIVE 2d as planned for 640x640
    assert accuracy_raw.stages_for(drive, [640, 640]) == 8
    assert accuracy_raw.stages_for(drive, [128, 128]) == 6  # 4x4 at the bottom, not 1x1
    anisotropic = [[1, 1, 1], [1, 2, 2], [1, 2, 2], [2, 2, 2]]  # z pooled last, once
    assert accuracy_raw.stages_for(anisotropic, [8, 32, 32]) == 4  # z 8 -> 4 at the bottom
    assert accuracy_raw.stages_for(anisotropic, [4, 32, 32]) == 3  # z would fall to 2


def test_an_override_that_does_not_fit_the_network_is_refused():
    fields = {"patch_size": [64, 64], "strides": [[1, 1], [2, 2], [2, 2]]}
    accuracy_raw.check_override(fields, [32, 40])
    with pytest.raises(ValueError, match=r"multiple of \[4, 4\]"):
        accuracy_raw.check_override(fields, [32, 30])
    with pytest.raises(ValueError, match="has 2 sizes"):
        accuracy_raw.check_override(fields, [8, 32, 32])


def test_per_fold_table_mean_sd_noise_and_stage_times():
    a = _args(folds=["0", "1", "2"])
    dice = {"0": (0.70, 0.72), "1": (0.60, 0.59), "2": (0.80, 0.83)}
    runs = {}
    for fold, (them, us) in dice.items():
        for side, value in (("nnU-Net", them), ("nnui", us)):
            runs[(side, fold, 0)] = accuracy.FoldRun(
                side, fold, 0, 0, value, {"1": value}, 100.0, 150.0, final_val_s=10.0
            )
    table = accuracy_raw.fold_table(a.units(), runs)
    assert table[2] == "| 0 | 0.7000 | 0.7200 | +0.0200 |"
    assert table[-2] == "| mean | 0.7000 | 0.7133 | +0.0133 |"
    assert table[-1] == "| sd | 0.1000 | 0.1201 | 0.0208 |"
    # mean paired difference 0.0133 <= 2 x standard error 2 * 0.0208 / sqrt(3) = 0.0240
    assert accuracy_raw.noise_line(a.units(), runs).startswith("within noise: yes")
    stages = accuracy_raw.stage_lines({"nnU-Net": 50.0, "nnui": 20.0}, a.units(), runs)
    assert stages[0].startswith("wall s nnU-Net: plan+preprocess 50, training 270")
    assert stages[1].endswith("final validation 30")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--patch", "64,64"], "need --raw"),
        (["--raw", "/nonexistent/Dataset5_X"], "nnU-Net raw layout"),
        (["--raw", "/tmp"], "DatasetNNN_Name"),
        (["--raw", "/nonexistent/Dataset5_X", "--patch", "6a"], "not integers"),
        (["--raw", "/nonexistent/Dataset5_X", "--batch", "0"], "--batch 0"),
    ],
)
def test_bad_raw_arguments_exit_2_with_one_error_line(argv, message, capsys):
    assert accuracy.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_nnui_seed_belongs_to_the_fold_and_repeat_not_the_run_order():
    whole = _args(folds=["0", "1", "2", "3", "4"], repeats=2)
    seeds = [accuracy.nnui_seed(f, r) for f, r in whole.units()]
    assert len(set(seeds)) == len(seeds)  # every run its own weights
    assert seeds[:5] == [12345, 12346, 12347, 12348, 12349]  # one repeat: as before
    # the same folds split over two commands get the seeds of the single command
    split = [_args(folds=["0", "1"], repeats=2), _args(folds=["2", "3", "4"], repeats=2)]
    assert sorted(accuracy.nnui_seed(f, r) for a in split for f, r in a.units()) == sorted(seeds)
