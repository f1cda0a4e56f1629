"""bench/accuracy.py --raw: each side plans and preprocesses one raw dataset for itself.

nnU-Net 2.8.1 runs `nnUNetv2_plan_and_preprocess` (its default planner, nnUNetPlans) and nnui
runs `nnui-preprocess` (its default planner, nnuiPlans), both reading the same raw folder
through a link in the bench's work folder (the raw folder is only read). The planned
configuration of each side is kept untouched beside the runs (work/plans/); a --patch/--batch
override is then written into BOTH sides' plans files in the work folder, never into a
user's files. Patch and batch do not change what preprocessing stores, so the override needs
no second preprocessing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _common import run_logged
from compare_nnunet import BENCH_DIR, REPO, ensure_nnunet_venv, share_splits

NNUNET_PLANS = "nnUNetPlans.json"
NNUI_PLANS = "nnuiPlans.json"


@dataclass(frozen=True)
class RawDataset:
    """A DatasetNNN_Name folder in nnU-Net's raw layout."""

    folder: Path

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def dataset_id(self) -> int:
        return int(self.name.removeprefix("Dataset").split("_")[0])


def raw_dataset(path: str) -> RawDataset:
    """The raw dataset at `path`, or ValueError with the reason."""
    folder = Path(path).absolute()
    head = folder.name.removeprefix("Dataset").split("_")[0]
    if not folder.name.startswith("Dataset") or not head.isdigit() or "_" not in folder.name:
        raise ValueError(f"--raw {path}: the folder must be named DatasetNNN_Name")
    if not (folder / "dataset.json").is_file() or not (folder / "imagesTr").is_dir():
        raise ValueError(f"--raw {path}: no dataset.json and imagesTr/ (nnU-Net raw layout)")
    return RawDataset(folder)


def link_raw(work: Path, ds: RawDataset) -> Path:
    """work/raw/<DatasetNNN_Name> -> the user's folder; returns the raw root both sides read."""
    root = work / "raw"
    root.mkdir(parents=True, exist_ok=True)
    link = root / ds.name
    if link.is_symlink() and link.resolve() == ds.folder.resolve():
        return root
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.exists():
        shutil.rmtree(link)  # a real folder here was the bench's own generated copy
    link.symlink_to(ds.folder.resolve())
    return root


def _stamp_ok(stamp: Path, want: dict, *needed: Path) -> bool:
    if not stamp.is_file() or not all(p.is_file() for p in needed):
        return False
    return {k: v for k, v in json.loads(stamp.read_text()).items() if k != "wall_s"} == want


def preprocess_both(
    work: Path, ds: RawDataset, configuration: str, venv: Path, processes: int = 2
) -> dict[str, float]:
    """Both sides' own planning + preprocessing (cached per dataset and configuration in the
    work folder); {side: wall s of that stage} (the first run's figure when cached)."""
    raw_root = link_raw(work, ds)
    want = {"raw": str(ds.folder.resolve()), "configuration": configuration}
    walls = {}
    steps = {
        "nnU-Net": (work / "nnunet_preprocessed", NNUNET_PLANS, [
            str(venv / "bin" / "nnUNetv2_plan_and_preprocess"), "-d", str(ds.dataset_id),
            "-c", configuration, "-np", str(processes), "-npfp", str(processes),
            "--verify_dataset_integrity"]),
        "nnui": (work / "nnui_preprocessed", NNUI_PLANS, [
            sys.executable, "-m", "trainer.planning.preprocess", str(ds.dataset_id),
            "-c", configuration,
            "--raw", str(raw_root), "--preprocessed", str(work / "nnui_preprocessed"),
            "-np", str(processes)]),
    }  # fmt: skip
    for side, (pre, plans_name, argv) in steps.items():
        stamp = work / "plans" / f"{side}.stamp.json"
        pristine = work / "plans" / f"{side}.{plans_name}"
        if _stamp_ok(stamp, want, pristine, pre / ds.name / plans_name):
            walls[side] = float(json.loads(stamp.read_text())["wall_s"])
            continue
        shutil.rmtree(pre / ds.name, ignore_errors=True)
        env = dict(os.environ, nnUNet_raw=str(raw_root), nnUNet_preprocessed=str(pre))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        started = time.time()
        log_path = work / "logs" / f"{side}_preprocess.log"
        if run_logged(argv, log_path, env=env) != 0:
            raise RuntimeError(f"{side} planning/preprocessing failed; see {log_path}")
        walls[side] = time.time() - started
        pristine.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pre / ds.name / plans_name, pristine)  # before any override
        stamp.write_text(json.dumps({**want, "wall_s": walls[side]}))
    return walls


def planned(work: Path, side: str) -> dict:
    """A side's plans as its planner wrote them (before any override)."""
    name = NNUNET_PLANS if side == "nnU-Net" else NNUI_PLANS
    return json.loads((work / "plans" / f"{side}.{name}").read_text())


# ---- what each side planned ---------------------------------------------------------------


def nnunet_fields(plans: dict, configuration: str) -> dict:
    """The compared fields of one nnUNetPlans configuration (inheritance resolved). Which
    configurations exist is not compared here: nnU-Net plans all whatever -c says, nnui
    writes the -c ones (tests/test_planner_vs_nnunet.py compares the full plans)."""
    blocks = plans["configurations"]
    conf = dict(blocks[configuration])
    while "inherits_from" in conf and "patch_size" not in conf:
        conf = {**blocks[conf["inherits_from"]], **conf}
    arch = conf["architecture"]["arch_kwargs"]
    return {
        "transpose_forward": list(plans["transpose_forward"]),
        "patch_size": list(conf["patch_size"]),
        "batch_size": conf["batch_size"],
        "spacing": [float(v) for v in conf["spacing"]],
        "median_image_size_in_voxels": [float(v) for v in conf["median_image_size_in_voxels"]],
        "normalization_schemes": list(conf["normalization_schemes"]),
        "use_mask_for_norm": list(conf["use_mask_for_norm"]),
        "batch_dice": conf["batch_dice"],
        "features_per_stage": list(arch["features_per_stage"]),
        "kernel_sizes": [list(k) for k in arch["kernel_sizes"]],
        "strides": [list(s) for s in arch["strides"]],
        "n_conv_per_stage": list(arch["n_conv_per_stage"]),
        "n_conv_per_stage_decoder": list(arch["n_conv_per_stage_decoder"]),
    }


def nnui_fields(plans: dict, configuration: str) -> dict:
    """The same fields of one nnuiPlans configuration (nnU-Net's names)."""
    blocks = plans["configurations"]
    conf = blocks[configuration]
    net = conf["network"]
    ndim = len(conf["patch_size"])  # nnui keeps z (999 in 2d) where nnU-Net's 2d has 2 values
    return {
        "transpose_forward": list(plans["transpose_forward"]),
        "patch_size": list(conf["patch_size"]),
        "batch_size": conf["batch_size"],
        "spacing": [float(v) for v in conf["spacing"][-ndim:]],
        "median_image_size_in_voxels": [
            float(v) for v in conf["median_image_size_in_voxels"][-ndim:]
        ],
        "normalization_schemes": list(conf["normalization_schemes"]),
        "use_mask_for_norm": list(conf["use_mask_for_norm"]),
        "batch_dice": conf.get("batch_dice"),
        "features_per_stage": list(net["features_per_stage"]),
        "kernel_sizes": [list(k) for k in net["kernel_sizes"]],
        "strides": [list(s) for s in net["strides"]],
        "n_conv_per_stage": list(net["n_conv_per_stage_encoder"]),
        "n_conv_per_stage_decoder": list(net["n_conv_per_stage_decoder"]),
    }


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and math.isclose(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def plan_differences(theirs: dict, ours: dict) -> list[str]:
    """'field: nnU-Net X, nnui Y' for every compared field that differs."""
    return [
        f"{k}: nnU-Net {theirs[k]}, nnui {ours.get(k)}"
        for k in theirs
        if not _same(theirs[k], ours.get(k))
    ]


def plan_lines(theirs: dict, ours: dict, configuration: str) -> list[str]:
    """What each planner chose and whether the plans are equal."""
    lines = []
    for side, f in (("nnU-Net (nnUNetPlans)", theirs), ("nnui (nnuiPlans)", ours)):
        lines.append(
            f"planned {configuration} by {side}: patch {f['patch_size']}, batch "
            f"{f['batch_size']}, {len(f['strides'])} stages, features "
            f"{f['features_per_stage']}, spacing {f['spacing']}"
        )
    differences = plan_differences(theirs, ours)
    lines.append(
        "plans equal: yes (every compared field)" if not differences
        else "plans equal: NO; " + "; ".join(differences)
    )  # fmt: skip
    return lines


# ---- the same override on both sides -----------------------------------------------------


def check_override(fields: dict, patch: list[int] | None) -> None:
    """ValueError when `patch` does not fit the planned network (nnui's own check)."""
    if patch is None:
        return
    if len(patch) != len(fields["patch_size"]):
        raise ValueError(
            f"--patch {patch}: the configuration's patch has {len(fields['patch_size'])} sizes"
        )
    kept = fields["strides"][: max(1, stages_for(fields["strides"], patch))]
    divisor = [math.prod(s[i] for s in kept) for i in range(len(patch))]
    if any(v < 1 or v % d for v, d in zip(patch, divisor, strict=True)):
        raise ValueError(
            f"--patch {patch}: each size must be a multiple of {divisor} (the network's pooling)"
        )


MIN_FEATURE_MAP = 4  # nnU-Net's planner pools an axis only while its map stays >= 4 voxels


def stages_for(strides: list[list[int]], patch: list[int]) -> int:
    """How many of the planned stages a smaller patch keeps: the deepest ones go while their
    feature map would fall under MIN_FEATURE_MAP voxels on an axis (at 128x128, the 8 stages
    planned for DRIVE's 640x640 would end at 1x1, where instance norm cannot train)."""
    kept, scale = 0, [1] * len(patch)
    for stride in strides:
        scale = [a * b for a, b in zip(scale, stride, strict=True)]
        pooled = zip(patch, scale, stride, strict=True)
        if any(size / s < MIN_FEATURE_MAP for size, s, step in pooled if step > 1):
            break
        kept += 1
    return kept


def _cut(net: dict, stages: int, encoder_key: str) -> None:
    for key in ("features_per_stage", "kernel_sizes", "strides", encoder_key):
        net[key] = net[key][:stages]
    net["n_conv_per_stage_decoder"] = net["n_conv_per_stage_decoder"][: stages - 1]
    if "n_stages" in net:
        net["n_stages"] = stages


def apply_override(
    work: Path, ds: RawDataset, configuration: str, patch: list[int] | None, batch: int | None
) -> None:
    """Both sides' plans in the work folder = as planned, then patch/batch replaced alike
    (and the deepest stages cut alike where the smaller patch leaves them no room)."""
    for side, pre, name in (
        ("nnU-Net", work / "nnunet_preprocessed", NNUNET_PLANS),
        ("nnui", work / "nnui_preprocessed", NNUI_PLANS),
    ):
        plans = planned(work, side)
        conf = plans["configurations"][configuration]
        if patch is not None:
            conf["patch_size"] = list(patch)
            if side == "nnU-Net":
                net, encoder_key = conf["architecture"]["arch_kwargs"], "n_conv_per_stage"
            else:
                net, encoder_key = conf["network"], "n_conv_per_stage_encoder"
            stages = stages_for(net["strides"], list(patch))
            if stages < len(net["strides"]):
                _cut(net, stages, encoder_key)
        if batch is not None:
            conf["batch_size"] = int(batch)
        (pre / ds.name / name).write_text(json.dumps(plans, indent=1) + "\n")


def override_line(theirs: dict, patch: list[int] | None, batch: int | None) -> str:
    if patch is None and batch is None:
        return "override: none (each side trains its own plans as planned)"
    parts = []
    if patch is not None:
        parts.append(f"patch {theirs['patch_size']} -> {list(patch)}")
    if batch is not None:
        parts.append(f"batch {theirs['batch_size']} -> {batch}")
    planned_stages = len(theirs["strides"])
    stages = stages_for(theirs["strides"], list(patch)) if patch is not None else planned_stages
    topology = (
        "network topology as planned" if stages == planned_stages
        else f"network cut from {planned_stages} to {stages} stages (bottleneck >= "
        f"{MIN_FEATURE_MAP} voxels, nnU-Net's rule), otherwise as planned"
    )  # fmt: skip
    return f"override (CPU budget), the SAME on both sides' plans: {', '.join(parts)}; {topology}"


# ---- report -------------------------------------------------------------------------------


def stage_s(path: Path, key: str, start: str, end: str) -> float:
    """Seconds between the first `start` and the last `end` record of a JSON-lines log
    (nnU-Net's bench stamps or nnui's events); nan when either is missing."""
    if not path.is_file():
        return float("nan")
    records = []
    for line in path.read_text().splitlines():
        if line.strip().endswith("}"):
            records.append(json.loads(line))
    begins = [r["t"] for r in records if r.get(key) == start]
    ends = [r["t"] for r in records if r.get(key) == end]
    return ends[-1] - begins[0] if begins and ends else float("nan")


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def fold_table(units: list[tuple[str, int]], by: dict) -> list[str]:
    """Markdown rows: foreground Dice per fold (and repeat) of both sides, then mean and sd."""
    rows = ["| fold | nnU-Net Dice | nnui Dice | nnui - nnU-Net |", "|---|---|---|---|"]
    dice = {"nnU-Net": [], "nnui": []}
    for fold, repeat in units:
        them, us = by[("nnU-Net", fold, repeat)].fg_dice, by[("nnui", fold, repeat)].fg_dice
        dice["nnU-Net"].append(them)
        dice["nnui"].append(us)
        name = fold + (f" (repeat {repeat})" if repeat else "")
        rows.append(f"| {name} | {them:.4f} | {us:.4f} | {us - them:+.4f} |")
    diffs = [u - t for u, t in zip(dice["nnui"], dice["nnU-Net"], strict=True)]
    rows.append(
        f"| mean | {statistics.fmean(dice['nnU-Net']):.4f} | {statistics.fmean(dice['nnui']):.4f}"
        f" | {statistics.fmean(diffs):+.4f} |"
    )
    rows.append(f"| sd | {_sd(dice['nnU-Net']):.4f} | {_sd(dice['nnui']):.4f} | {_sd(diffs):.4f} |")
    return rows


def noise_line(units: list[tuple[str, int]], by: dict) -> str:
    """Is the mean paired difference within its own noise (2 standard errors)?"""
    diffs = [by[("nnui", *u)].fg_dice - by[("nnU-Net", *u)].fg_dice for u in units]
    if len(diffs) < 2 or any(d != d for d in diffs):
        return "within noise: cannot tell (needs >= 2 folds with a Dice on both sides)"
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    verdict = "yes" if abs(mean) <= 2 * se else "NO"
    return (
        f"within noise: {verdict} (mean paired difference {mean:+.4f}, 2 x its standard "
        f"error {2 * se:.4f}, over {len(diffs)} folds; the paired spread holds fold-to-fold "
        "and run-to-run variation: one training per fold and side)"
    )


def stage_lines(prep_s: dict[str, float], units: list[tuple[str, int]], by: dict) -> list[str]:
    """Wall time of each stage per side: plan+preprocess, training, final validation."""
    lines = []
    for side in ("nnU-Net", "nnui"):
        runs = [by[(side, *u)] for u in units]
        final = sum(r.final_val_s for r in runs)
        train = sum(r.wall_s for r in runs) - final
        lines.append(
            f"wall s {side}: plan+preprocess {prep_s.get(side, float('nan')):.0f}, training "
            f"{train:.0f} (process start to final validation, all folds), final validation "
            f"{final:.0f}"
        )
    return lines


# ---- the bench's --raw steps ----------------------------------------------------------------


def parse_raw_options(
    raw: str | None, patch_text: str | None, batch: int | None
) -> tuple[RawDataset | None, list[int] | None, int | None]:
    """(--raw dataset, --patch sizes, --batch), or one error line and exit 2."""
    try:
        if raw is None and (patch_text or batch is not None):
            raise ValueError("--patch and --batch need --raw (the demo copies nnU-Net's plan)")
        patch = None
        if patch_text:
            patch = [int(v) for v in patch_text.replace("x", ",").split(",") if v.strip()]
            if not patch or any(v < 1 for v in patch):
                raise ValueError(f"--patch {patch_text}: sizes must be positive integers")
        if batch is not None and batch < 1:
            raise ValueError(f"--batch {batch}: must be >= 1")
        return (raw_dataset(raw) if raw else None), patch, batch
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("--") else f"--patch {patch_text}: not integers"
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


def prepare(
    work: Path, ds: RawDataset, configuration: str, patch: list[int] | None, batch: int | None
) -> tuple[Path, dict[str, str], list[str], dict[str, float]]:
    """The venv, each side's own plans and preprocessing, the same override on both, the
    shared splits; (venv, nnU-Net's roots, plan report lines, plan+preprocess wall s)."""
    nnunet_pre, nnui_pre = work / "nnunet_preprocessed", work / "nnui_preprocessed"
    venv = ensure_nnunet_venv(work, BENCH_DIR / "nnunet_short_trainer.py")
    walls = preprocess_both(work, ds, configuration, venv)
    theirs = nnunet_fields(planned(work, "nnU-Net"), configuration)
    ours = nnui_fields(planned(work, "nnui"), configuration)
    check_override(theirs, patch)
    check_override(ours, patch)
    apply_override(work, ds, configuration, patch, batch)
    share_splits(nnunet_pre, nnui_pre, ds.name)
    lines = [*plan_lines(theirs, ours, configuration), override_line(theirs, patch, batch)]
    roots = {"nnUNet_raw": str(work / "raw"), "nnUNet_preprocessed": str(nnunet_pre)}
    return venv, roots, lines, walls


def trained_plan(work: Path, ds: RawDataset, configuration: str) -> dict:
    """Patch, batch and network nnU-Net trains (its plans after any override)."""
    plans_path = work / "nnunet_preprocessed" / ds.name / NNUNET_PLANS
    conf = json.loads(plans_path.read_text())["configurations"][configuration]
    return {
        "patch_size": conf["patch_size"],
        "batch_size": conf["batch_size"],
        "architecture": conf["architecture"]["arch_kwargs"],
    }
