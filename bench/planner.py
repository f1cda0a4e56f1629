"""nnui's default planner beside nnU-Net 2.8.1's on one raw dataset (planning only).

    python bench/planner.py --raw ../shared/data/Dataset701_DRIVE [--work DIR] [-np 2]

nnU-Net runs unmodified (`nnUNetv2_extract_fingerprint` and `nnUNetv2_plan_experiment`,
nnUNet_preprocessed in a temporary folder under --work; the raw folder is only read); nnui
reads the same cases with its own fingerprint and plans them with its default planner.
Prints one row per configuration and side (patch, batch, stages, spacing, transpose) and
whether every compared field is equal (the comparison of
tests/trainer/planning/test_planner_vs_nnunet.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "trainer" / "planning"))


def nnunet_plans(raw: Path, work: Path, processes: int) -> tuple[dict, dict, float]:
    """nnU-Net's plans, its memory estimate per configuration, and its wall time."""
    pre = Path(tempfile.mkdtemp(prefix="nnunet_pre_", dir=work))
    env = {**os.environ, "nnUNet_raw": str(raw.parent), "nnUNet_preprocessed": str(pre),
           "nnUNet_results": str(work / "results")}  # fmt: skip
    dataset_id = str(int(raw.name.removeprefix("Dataset").split("_")[0]))
    started = time.perf_counter()
    binary = Path(sys.executable).parent
    for argv in ([str(binary / "nnUNetv2_extract_fingerprint"), "-d", dataset_id,
                  "-np", str(processes)],
                 [str(binary / "nnUNetv2_plan_experiment"), "-d", dataset_id]):  # fmt: skip
        subprocess.run(argv, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - started
    plans = json.loads((pre / raw.name / "nnUNetPlans.json").read_text())
    script = (
        "import json,sys\n"
        "from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner "
        "import ExperimentPlanner as E\n"
        "p=json.load(open(sys.argv[1])); n=int(sys.argv[2]); out={}\n"
        "for k,c in p['configurations'].items():\n"
        "  a=c.get('architecture')\n"
        "  if a: out[k]=int(E.static_estimate_VRAM_usage(c['patch_size'],"
        "len(p['foreground_intensity_properties_per_channel']),n,a['network_class_name'],"
        "a['arch_kwargs'],a['_kw_requires_import']))\n"
        "print(json.dumps(out))\n"
    )
    labels = json.loads((raw / "dataset.json").read_text())["labels"]
    plans_path = pre / raw.name / "nnUNetPlans.json"
    argv = [sys.executable, "-c", script, str(plans_path), str(len(labels))]
    done = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
    return plans, json.loads(done.stdout.strip().splitlines()[-1]), wall


def nnui_plans(raw: Path, processes: int):
    from trainer.data.raw import open_raw_dataset
    from trainer.planning.fingerprint import fingerprint_dataset
    from trainer.planning.presets import make_plans
    from trainer.planning.rules import PlannerOptions

    started = time.perf_counter()
    dataset = open_raw_dataset(raw)
    fingerprint = fingerprint_dataset(dataset, processes, lambda _: None, per_case=False)
    plans = make_plans(PlannerOptions(), fingerprint, dataset.dataset_json, raw.name, None, None)
    return plans, time.perf_counter() - started


def rows(theirs: dict, ours) -> list[str]:
    out = ["| configuration | side | patch | batch | stages | spacing | GPU memory est. |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in sorted(set(theirs["configurations"]) | set(ours.configurations)):
        block = theirs["configurations"].get(name)
        if block and "patch_size" in block:
            arch = block["architecture"]["arch_kwargs"]
            spacing = [round(s, 3) for s in block["spacing"]]
            out.append(f"| {name} | nnU-Net | {block['patch_size']} | {block['batch_size']} | "
                       f"{arch['n_stages']} | {spacing} | - |")  # fmt: skip
        elif block:
            out.append(f"| {name} | nnU-Net | {block} | | | | |")
        mine = ours.configurations.get(name)
        if mine:
            spacing = [round(s, 3) for s in mine.spacing[-mine.ndim :]]
            memory = f"{mine.gpu_memory_gb} GB"
            out.append(f"| {name} | nnui | {list(mine.patch_size)} | {mine.batch_size} | "
                       f"{mine.network.num_stages} | {spacing} | {memory} |")  # fmt: skip
        elif name in ours.cascades:
            out.append(f"| {name} | nnui | {ours.cascades[name]} | | | | |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw", required=True, help="a DatasetNNN_Name folder in nnU-Net's layout")
    parser.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("-np", type=int, default=2)
    args = parser.parse_args()
    from test_planner_vs_nnunet import plans_differences

    raw = Path(args.raw).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_planner_"))
    work.mkdir(parents=True, exist_ok=True)
    theirs, estimates, their_wall = nnunet_plans(raw, work, args.np)
    ours, our_wall = nnui_plans(raw, args.np)
    print("\n".join(rows(theirs, ours)))
    print(f"transpose_forward: nnU-Net {theirs['transpose_forward']}  "
          f"nnui {list(ours.transpose[0])}")  # fmt: skip
    differences = plans_differences(theirs, estimates, ours)
    print(f"fields that differ: {differences or 'none'}")
    print(f"wall (fingerprint + plan): nnU-Net {their_wall:.1f} s  nnui {our_wall:.1f} s")
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
