"""`bench/predict.py --real`: one 512x512x300 CT-like case through nnui's prediction stages
and nnU-Net 2.8.1's, stage by stage, each stage of each side a fresh process, A B A B.

    python bench/predict.py --real [--work /tmp/nnui-pbench-real] [--blocks 2] [--windows 2]
                                   [--threads N] [--json FILE]

Same plan: one synthetic dataset fingerprint (CT, median spacing 1.0 x 0.78 x 0.78 mm) is
planned by nnUNetv2_plan_experiment; nnui's plans take nnU-Net's spacing, patch, batch and
network (nnui's own planner on the same fingerprint, nnU-Net's values written over it).
Stages:
- prep: read the NIfTI and preprocess (nnU-Net: DefaultPreprocessor.run_case, as
  nnUNetPredictor does; nnui: inference.prepare.prepare_case).
- net: a random-initialised network of the plan on `--windows` windows of the patch (batch
  1, no mirroring; nnU-Net fp32 as on CPU, nnui as its engine runs: channels_last_3d and
  its default precision, bf16 autocast on AMX CPUs; NNUI_BENCH_PRECISION=fp32 for float32),
  seconds per window; times nnU-Net's number of sliding windows at
  step 0.5 gives the case's network time (the same windows for both).
- export: identical logits in (smooth, from the case's anatomy, cached as .npy); nnU-Net:
  export_prediction_from_logits (resampling of the logits, argmax, SimpleITK write); nnui:
  to_raw_geometry + write_prediction on softmax(logits), as its export thread does (the
  softmax belongs to nnui's sliding-window stage, timed on its own).
Labels: the fraction of voxels where the two written segmentations agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

DATASET_ID = 952
DATASET = "Dataset952_CTLike"
CONFIG = "3d_fullres"
CASE = "ct_000"
LABELS = {"background": 0, "organ": 1, "bone": 2}
STAGES = ("prep", "net", "export")
GOAL_TIME = 0.25
GOAL_MEMORY = 0.5


def ct_fingerprint(num_cases: int = 10) -> dict:
    """nnU-Net's dataset_fingerprint.json keys for a CT cohort at 1.0 x 0.78 x 0.78 mm."""
    props = {"max": 3000.0, "mean": 80.0, "median": 60.0, "min": -1000.0,
             "percentile_00_5": -150.0, "percentile_99_5": 900.0, "std": 180.0}  # fmt: skip
    return {
        "spacings": [[1.0, 0.78125, 0.78125]] * num_cases,
        "shapes_after_crop": [[300, 512, 512]] * num_cases,
        "foreground_intensity_properties_per_channel": {"0": props},
        "median_relative_size_after_cropping": 1.0,
    }


def dataset_json() -> dict:
    return {"channel_names": {"0": "CT"}, "labels": LABELS, "numTraining": 10,
            "file_ending": ".nii.gz", "name": DATASET}  # fmt: skip


def logits_from_image(hu, num_classes: int = 3):
    """Smooth (K, *shape) float32 logits that follow the anatomy (organ > 20 HU, bone >
    300 HU), with a ramp across every edge, like a trained network's."""
    import numpy as np
    from scipy.ndimage import uniform_filter

    soft = uniform_filter(hu.astype(np.float32), size=5)
    organ = np.tanh((soft - 20.0) / 30.0) * 4.0
    bone = np.tanh((soft - 300.0) / 80.0) * 6.0
    out = np.empty((num_classes, *hu.shape), np.float32)
    out[0] = -organ
    out[1] = organ - np.maximum(bone, 0)
    out[2] = bone
    return out


# ---- setup (this process) ----------------------------------------------------------------


def setup(work: Path, case_shape: tuple[int, int, int] | None = None) -> dict:
    """Raw case, nnU-Net's plans, nnui's plans (cached); the paths the stages need.
    `case_shape`: a smaller case than the real-size 512x512x300 (the set-up's test)."""
    import numpy as np
    from real_data import CT_SHAPE, ct_like_case

    from trainer.data.image_io import write_nifti

    raw = work / "raw" / DATASET
    image = raw / "imagesTs" / f"{CASE}_0000.nii.gz"
    if not image.is_file():
        image.parent.mkdir(parents=True, exist_ok=True)
        hu, spacing = ct_like_case(0, case_shape or CT_SHAPE)
        write_nifti(image, hu, spacing)
        (raw / "dataset.json").write_text(json.dumps(dataset_json(), indent=1))
    nnunet_pre = work / "nnunet_pre" / DATASET
    plans_path = nnunet_pre / "nnUNetPlans.json"
    env = dict(os.environ, nnUNet_raw=str(work / "raw"),
               nnUNet_preprocessed=str(work / "nnunet_pre"),
               nnUNet_results=str(work / "nnunet_results"))  # fmt: skip
    if not plans_path.is_file():
        nnunet_pre.mkdir(parents=True, exist_ok=True)
        (nnunet_pre / "dataset_fingerprint.json").write_text(json.dumps(ct_fingerprint()))
        example = raw / "imagesTr" / image.name  # the planner picks its reader from one
        example.parent.mkdir(exist_ok=True)
        if not example.exists():
            example.symlink_to(image)
        tool = Path(sys.executable).parent / "nnUNetv2_plan_experiment"
        done = subprocess.run(
            [str(tool), "-d", str(DATASET_ID)], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"nnUNetv2_plan_experiment failed: {done.stderr.strip()[-300:]}")
    nnui_plans = work / "nnui_pre" / DATASET / "nnuiPlans.json"
    if not nnui_plans.is_file():
        write_nnui_plans(json.loads(plans_path.read_text()), nnui_plans)
    logits = work / "logits.npy"
    if not logits.is_file():
        from trainer.data.image_io import read_image
        from trainer.inference.cases import InputCase
        from trainer.inference.prepare import prepare_case
        from trainer.planning.plans import load_plans

        plans = load_plans(nnui_plans.parent)
        cplan = plans.configuration(CONFIG)
        prepared = prepare_case(InputCase(CASE, (image,), ".nii.gz"), plans, cplan)
        hu, spacing = read_image(image, None)  # anatomy at the network's shape: resample the HU
        from trainer.data.case_ops import resample_image

        shape = tuple(prepared.data.shape[1:])
        hu_net = resample_image(
            hu[None].astype(np.float32), shape, tuple(spacing), tuple(cplan.spacing), order=1
        )[0]
        np.save(logits, logits_from_image(hu_net))
    return {"image": image, "nnunet_plans": plans_path, "nnui_plans": nnui_plans,
            "logits": logits, "env": env}  # fmt: skip


def write_nnui_plans(
    nnunet_plans: dict,
    path: Path,
    fingerprint: dict | None = None,
    meta: dict | None = None,
    name: str = DATASET,
    config: str = CONFIG,
) -> None:
    """nnui's planner on the same fingerprint (default: this CT case's), then nnU-Net's
    spacing, patch, batch and network."""
    from trainer.planning.plans import plans_content, plans_from_dict, plans_to_json
    from trainer.planning.rules import Overrides, plan_experiment

    conf = nnunet_plans["configurations"][config]
    over = Overrides({config: tuple(conf["patch_size"])}, {config: int(conf["batch_size"])})
    plans = plan_experiment(
        fingerprint or ct_fingerprint(), meta or dataset_json(), name, (config,), over
    )
    data = plans_content(plans)
    mine = data["configurations"][config]
    arch = conf["architecture"]["arch_kwargs"]
    if len(mine["spacing"]) == len(conf["spacing"]):
        mine["spacing"] = list(conf["spacing"])
    mine["network"].update(
        features_per_stage=list(arch["features_per_stage"]),
        kernel_sizes=[list(k) for k in arch["kernel_sizes"]],
        strides=[list(s) for s in arch["strides"]],
        n_conv_per_stage_encoder=list(arch["n_conv_per_stage"]),
        n_conv_per_stage_decoder=list(arch["n_conv_per_stage_decoder"]),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plans_to_json(plans_from_dict(data)))


# ---- one stage of one side (a fresh process) ----------------------------------------------


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def nnunet_stage(stage: str, paths: dict, work: Path, windows: int) -> dict:
    import numpy as np
    import torch
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    pm = PlansManager(json.loads(Path(paths["nnunet_plans"]).read_text()))
    cm = pm.get_configuration(CONFIG)
    if stage == "prep":
        from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor

        t0, c0 = time.perf_counter(), _cpu_s()
        data, _, props = DefaultPreprocessor(verbose=False).run_case(
            [paths["image"]], None, pm, cm, dataset_json()
        )
        out = {"s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0, "shape": list(data.shape)}
        (work / "nnunet_props.json").write_text(json.dumps(props, default=_plain))
        return out
    if stage == "net":
        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

        net = nnUNetTrainer.build_network_architecture(
            pm, cm, 1, len(LABELS), enable_deep_supervision=False
        ).eval()
        return time_windows(net, cm.patch_size, windows)
    from nnunetv2.inference.export_prediction import export_prediction_from_logits

    props = json.loads((work / "nnunet_props.json").read_text())
    logits = torch.from_numpy(np.load(paths["logits"]))
    out_dir = work / "out_nnunet"
    out_dir.mkdir(exist_ok=True)
    t0, c0 = time.perf_counter(), _cpu_s()
    export_prediction_from_logits(
        logits, props, cm, pm, dataset_json(), str(out_dir / CASE), False,
        num_threads_torch=torch.get_num_threads(),
    )  # fmt: skip
    return {"s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0}


def _plain(value):
    """JSON for nnU-Net's properties (numpy scalars and arrays, tuples)."""
    return value.tolist() if hasattr(value, "tolist") else list(value)


def nnui_stage(stage: str, paths: dict, work: Path, windows: int) -> dict:
    import numpy as np
    import torch

    from trainer.inference.cases import InputCase
    from trainer.planning.plans import load_plans

    plans = load_plans(Path(paths["nnui_plans"]).parent)
    cplan = plans.configuration(CONFIG)
    case = InputCase(CASE, (Path(paths["image"]),), ".nii.gz")
    if stage == "prep":
        from trainer.inference.prepare import prepare_case

        t0, c0 = time.perf_counter(), _cpu_s()
        prepared = prepare_case(case, plans, cplan)
        out = {"s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0,
               "shape": list(prepared.data.shape)}  # fmt: skip
        (work / "nnui_props.json").write_text(json.dumps(prepared.properties, default=_plain))
        return out
    if stage == "net":
        from trainer.inference.sliding import memory_format
        from trainer.network import precision
        from trainer.network.build import build_network

        net = build_network(
            cplan.network, plans.num_input_channels, plans.num_classes, cplan.ndim,
            deep_supervision=False, recompute_norm=False,
        ).eval()  # fmt: skip
        # As nnui's engine runs it: its CPU layout and its default precision (bf16 on AMX).
        layout = memory_format(torch.device("cpu"), cplan.ndim)
        dtype = precision.autocast_dtype(os.environ.get("NNUI_BENCH_PRECISION", "auto"), "cpu")
        return time_windows(net.to(memory_format=layout), cplan.patch_size, windows, layout,
                            lambda: precision.autocast("cpu", dtype))  # fmt: skip
    from trainer.inference.export import to_raw_geometry, write_prediction

    props = json.loads((work / "nnui_props.json").read_text())
    logits = torch.from_numpy(np.load(paths["logits"]))
    t0, c0 = time.perf_counter(), _cpu_s()
    probs = torch.softmax(logits, dim=0)  # nnui's sliding-window stage ends with this
    del logits
    softmax_s, softmax_cpu = time.perf_counter() - t0, _cpu_s() - c0
    out_dir = work / "out_nnui"
    out_dir.mkdir(exist_ok=True)
    t0, c0 = time.perf_counter(), _cpu_s()
    prediction = to_raw_geometry(probs, props, sorted(plans.labels.values()))
    write_prediction(out_dir, CASE, prediction, case.image_files[0], ".nii.gz")
    return {"s": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0,
            "softmax_s": softmax_s, "softmax_cpu_s": softmax_cpu}  # fmt: skip


def time_windows(net, patch, windows: int, layout=None, autocast=None) -> dict:
    """Seconds per window of a forward pass (batch 1, no gradients) after a warm-up; fp32
    in the default layout unless given (nnui: its engine's layout and autocast)."""
    from contextlib import nullcontext

    import torch

    x = torch.randn(1, 1, *patch).contiguous(memory_format=layout or torch.contiguous_format)
    context = autocast or nullcontext
    with torch.inference_mode(), context():
        net(x)
        t0, c0 = time.perf_counter(), _cpu_s()
        for _ in range(windows):
            net(x)
    n = max(1, windows)
    return {"s_per_window": (time.perf_counter() - t0) / n, "cpu_s_per_window": (_cpu_s() - c0) / n}


def stage_main(argv: list[str]) -> int:
    side, stage, paths_json, work, windows, out = argv
    import torch

    paths = json.loads(Path(paths_json).read_text())
    run = nnunet_stage if side == "nnU-Net" else nnui_stage
    result = run(stage, paths, Path(work), int(windows))
    result["threads"] = torch.get_num_threads()
    Path(out).write_text(json.dumps(result))
    return 0


# ---- the benchmark (parent) ---------------------------------------------------------------


def window_count(shape, patch, step: float = 0.5) -> int:
    """nnU-Net's number of sliding windows (compute_steps_for_sliding_window's rule)."""
    import math

    total = 1
    for size, tile in zip(shape, patch, strict=True):
        if size <= tile:
            continue
        target = tile * step
        total *= math.ceil((size - tile) / target) + 1
    return total


def run_stage(side: str, stage: str, block: int, a, paths_json: Path) -> dict:
    from _common import run_tree

    out = a.work / "runs" / f"{stage}_{side.lower()}_{block}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__)), "--stage", side, stage, str(paths_json),
            str(a.work), str(a.windows), str(out)]  # fmt: skip
    env = dict(json.loads(paths_json.read_text())["env"], PYTHONPATH=str(REPO),
               OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))  # fmt: skip
    tree, _ = run_tree(argv, a.work / "logs" / f"{stage}_{side.lower()}_{block}.log", env=env)
    if tree.exit_code != 0 or not out.is_file():
        raise RuntimeError(f"{side} {stage} failed (exit {tree.exit_code}); see {a.work}/logs")
    result = json.loads(out.read_text())
    result.update(side=side, stage=stage, block=block, peak_rss_bytes=tree.peak_rss_bytes,
                  peak_pss_bytes=tree.peak_pss_bytes, process_cpu_s=tree.cpu_s)  # fmt: skip
    return result


def labels_agreement(work: Path) -> float:
    import nibabel as nib
    import numpy as np

    a = np.asarray(nib.load(str(work / "out_nnunet" / f"{CASE}.nii.gz")).dataobj)
    b = np.asarray(nib.load(str(work / "out_nnui" / f"{CASE}.nii.gz")).dataobj)
    return float((a == b).mean()) if a.shape == b.shape else float("nan")


def summarize(runs: list[dict], windows: int) -> dict:
    """Per stage and side: medians over blocks of seconds, CPU-s and peak RSS; ratios
    nnui/nnU-Net. The net stage is per window, times `windows` for the case."""
    from _common import median_or_nan, ratio

    out = {}
    for stage in STAGES:
        row = {}
        for side in ("nnU-Net", "nnui"):
            mine = [r for r in runs if r["stage"] == stage and r["side"] == side]
            net = stage == "net"
            key, cpu_key = ("s_per_window", "cpu_s_per_window") if net else ("s", "cpu_s")
            scale = windows if stage == "net" else 1
            row[side] = {
                "s": scale * median_or_nan([r[key] for r in mine]),
                "cpu_s": scale * median_or_nan([r[cpu_key] for r in mine]),
                "peak_rss_mib": max((r["peak_rss_bytes"] for r in mine), default=0) / 2**20,
                "peak_pss_mib": max((r["peak_pss_bytes"] for r in mine), default=0) / 2**20,
            }
        row["ratio_s"] = ratio(row["nnui"]["s"], row["nnU-Net"]["s"])
        row["ratio_cpu_s"] = ratio(row["nnui"]["cpu_s"], row["nnU-Net"]["cpu_s"])
        row["ratio_rss"] = ratio(row["nnui"]["peak_rss_mib"], row["nnU-Net"]["peak_rss_mib"])
        row["ratio_pss"] = ratio(row["nnui"]["peak_pss_mib"], row["nnU-Net"]["peak_pss_mib"])
        out[stage] = row
    return out


def report_lines(summary: dict, info: dict) -> list[str]:
    lines = [
        f"case {info['raw_shape']} -> network shape {info['net_shape']}, patch {info['patch']},"
        f" {info['windows_case']} windows at step 0.5 (net: {info['windows']} timed per side,"
        f" scaled to the case), torch threads {info['threads']}"
    ]
    names = {"prep": "read + preprocess", "net": "network (whole case)",
             "export": "resampling + export"}  # fmt: skip
    for stage, row in summary.items():
        a, b = row["nnui"], row["nnU-Net"]
        lines.append(
            f"{names[stage]:22} nnui {a['s']:8.1f} s {a['cpu_s']:8.1f} CPU-s "
            f"{a['peak_rss_mib']:7.0f} MiB | nnU-Net {b['s']:8.1f} s {b['cpu_s']:8.1f} CPU-s "
            f"{b['peak_rss_mib']:7.0f} MiB"
            f" | ratio s {row['ratio_s']:.2f} CPU-s {row['ratio_cpu_s']:.2f}"
            f" RSS {row['ratio_rss']:.2f} PSS {row['ratio_pss']:.2f}"
        )
    ex = summary["export"]
    met_t = ex["ratio_cpu_s"] <= GOAL_TIME and ex["ratio_s"] <= GOAL_TIME
    met_m = ex["ratio_rss"] <= GOAL_MEMORY
    lines.append(
        f"goal export <= {GOAL_TIME}x time: {'met' if met_t else 'missed'} "
        f"({ex['ratio_s']:.2f} wall, {ex['ratio_cpu_s']:.2f} CPU); <= {GOAL_MEMORY}x peak memory: "
        f"{'met' if met_m else 'missed'} ({ex['ratio_rss']:.2f} RSS)"
    )
    lines.append(
        f"nnui softmax before export (its sliding stage): {info['softmax_s']:.1f} s; labels equal"
        f" to nnU-Net's in {100 * info['agreement']:.4f} % of voxels"
    )
    return lines


def real_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/predict.py --real", description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/nnui-pbench-real"))
    p.add_argument("--blocks", type=int, default=2, help="A B blocks of every stage")
    p.add_argument("--windows", type=int, default=2, help="timed network windows per side")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.blocks < 1 or a.windows < 1 or a.threads < 1:
        print("error: need --blocks, --windows and --threads >= 1", file=sys.stderr)
        return 2
    a.work = a.work.absolute()
    from _common import machine_line

    print(machine_line(), flush=True)
    try:
        paths = setup(a.work)
        paths_json = a.work / "paths.json"
        paths_json.write_text(json.dumps(paths, default=str))
        runs = []
        # export needs each side's preprocessing properties: prep runs once if they are missing
        missing = not all((a.work / f"{n}_props.json").is_file() for n in ("nnunet", "nnui"))
        # in the order given: the stage of interest first, while the machine is as it was
        stages = list(dict.fromkeys(["prep", *a.stages] if "export" in a.stages else a.stages))
        for block in range(a.blocks):
            for stage in stages:
                for side in ("nnU-Net", "nnui"):
                    if stage == "prep" and "prep" not in a.stages and (block > 0 or not missing):
                        continue
                    r = run_stage(side, stage, block, a, paths_json)
                    print(f"  block {block} {stage:6} {side:8} {json.dumps(r)}", flush=True)
                    runs.append(r)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return finish(a, runs, paths)


def finish(a, runs: list[dict], paths: dict) -> int:
    import nibabel as nib

    plans = json.loads(Path(paths["nnunet_plans"]).read_text())["configurations"][CONFIG]
    prep = [r for r in runs if r["stage"] == "prep"]
    props = a.work / "nnui_props.json"
    net_shape = json.loads(props.read_text())["shape_after_resampling"] if props.is_file() else []
    exports = [r for r in runs if r["stage"] == "export" and r["side"] == "nnui"]
    info = {
        "raw_shape": list(nib.load(str(paths["image"])).shape),
        "net_shape": net_shape,
        "patch": plans["patch_size"],
        "windows": a.windows,
        "windows_case": window_count(net_shape, plans["patch_size"]) if net_shape else 0,
        "threads": runs[0]["threads"],
        "softmax_s": exports[0]["softmax_s"] if exports else float("nan"),
        "agreement": labels_agreement(a.work) if exports else float("nan"),
        "prep_shapes": {r["side"]: r["shape"] for r in prep},
    }
    summary = summarize(runs, info["windows_case"])
    print("\n".join(report_lines(summary, info)))
    if a.json:
        a.json.write_text(json.dumps({"info": info, "summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--stage"]:
        raise SystemExit(stage_main(sys.argv[2:]))
    raise SystemExit(real_main(sys.argv[1:]))
