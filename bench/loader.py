"""Loader throughput: patches/s and CPU-seconds per patch on the demo 3d_fullres config.

    python bench/loader.py [--preprocessed ROOT] [--batches 40] [--cases 20]
    python bench/loader.py --real [--plans 3d 2d] [--blocks 2] [--batches N] [--workers 0]
                                  [--work /tmp/nnui-lbench] [--no-profile]

Without --preprocessed it writes the demo dataset and preprocesses 3d_fullres into a
temporary folder first. CPU time counts this process and its loader worker processes.

--real: nnui's training batches against nnU-Net 2.8.1's (its nnUNetDataLoader and its
trainer's training transforms) at nnU-Net's real plans, on the same cases: a generated
BraTS-sized 4-channel MR-like dataset at 3d_fullres patch 128x128x128 batch 2, and DRIVE
(../shared/data) at 2d patch 640x640 batch 2. Each side is preprocessed by its own tool
(nnUNetv2_plan_and_preprocess, then the patch and batch set in nnUNetPlans.json;
nnui-preprocess --patch-size --batch-size), one splits_final.json serves both. Each block is
a fresh process per side (bench/loader_sides.py), blocks alternate A B A B; samples per
CPU-second of the process tree is "samples/s per core". Then one profiled nnui block per
plan (cProfile, own time per function). Figures go to stdout and --json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from trainer.data.dataset import PreprocessedCases
from trainer.data.loader import PatchLoader
from trainer.demo import DEMO_DATASET, make_demo_dataset
from trainer.planning.plans import load_plans
from trainer.planning.preprocess import preprocess_dataset
from trainer.planning.rules import CPU_PLANNER, PlannerOptions
from trainer.schema.tree import DEFAULT_PLANS


def _cpu_seconds(proc: psutil.Process) -> float:
    total = sum(proc.cpu_times()[:2])
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total


def measure(
    cases, config, augment: bool, num_workers: int, mode: str, batches: int, device: torch.device
) -> dict:
    me = psutil.Process()
    loader = PatchLoader(
        cases,
        cases.case_ids,
        config.patch_size,
        config.batch_size,
        0.33,
        seed=0,
        rank=0,
        device=device,
        augment=augment,
        num_workers=num_workers,
        prefetch=max(2, num_workers),
        worker_mode=mode,
    )
    try:
        for _ in range(3):  # warm-up: worker start, first file opens
            next(loader)
        cpu0, wall0 = _cpu_seconds(me), time.perf_counter()
        for _ in range(batches):
            batch = next(loader)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        del batch
        # children's CPU is read before close(), while they still exist
        cpu, wall = _cpu_seconds(me) - cpu0, time.perf_counter() - wall0
    finally:
        loader.close()
    patches = batches * config.batch_size
    return {"patches_per_s": patches / wall, "cpu_s_per_patch": cpu / patches}


# ---- --real: nnui vs nnU-Net 2.8.1 at real plans ------------------------------------------

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
SHARED_RAW = REPO.parent / "shared" / "data"
SIDES = ("nnU-Net", "nnui")


@dataclass(frozen=True)
class RealPlan:
    key: str
    dataset_id: int
    dataset: str
    configuration: str
    patch: tuple[int, ...]
    batch: int
    mr_cases: int = 0  # > 0: generated MR-like cases, else read from ../shared/data
    # timed per block unless --batches says otherwise: a batch's cost depends on which of
    # its samples are rotated or scaled (~36 %, ~3x an unmoved one's), so 60 samples per
    # block moved the ratio by +-15 % from block to block; 300 (2d) and 60 (3d) keep it
    # within a few %
    batches: int = 30


REAL_PLANS = {
    "3d": RealPlan("3d", 951, "Dataset951_MRLike", "3d_fullres", (128, 128, 128), 2, 5),
    "2d": RealPlan("2d", 701, "Dataset701_DRIVE", "2d", (640, 640), 2, batches=300),
}


def block_order(blocks: int, sides: tuple[str, ...] = SIDES) -> list[tuple[int, str]]:
    """(block, side) in run order: A B A B ..., so drift of the machine hits both sides."""
    return [(b, side) for b in range(blocks) for side in sides]


def samples_per_core(run: dict) -> float:
    """Samples per CPU-second of the process tree (samples/s on one fully used core)."""
    return run["batches"] * run["batch_size"] / run["cpu_s"] if run["cpu_s"] > 0 else float("nan")


def summarize_blocks(runs: list[dict]) -> dict:
    """Per side: samples/s per core over all blocks (total samples / total CPU-s), wall
    samples/s, peak RSS / PSS (max over blocks); the ratio nnui/nnU-Net of samples per core
    overall and of each block pair, with their spread."""
    out: dict = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        samples = sum(r["batches"] * r["batch_size"] for r in mine)
        out[side] = {
            "samples_per_core": samples / sum(r["cpu_s"] for r in mine),
            "samples_per_s_wall": samples / sum(r["wall_s"] for r in mine),
            "peak_rss_mib": max(r["peak_rss_bytes"] for r in mine) / 2**20,
            "peak_pss_mib": max(r["peak_pss_bytes"] for r in mine) / 2**20,
            "blocks": len(mine),
        }
    if all(side in out for side in SIDES):
        per_block = {}
        for r in runs:
            per_block.setdefault(r["block"], {})[r["side"]] = samples_per_core(r)
        pairs = [v["nnui"] / v["nnU-Net"] for v in per_block.values() if len(v) == 2]
        out["ratio"] = out["nnui"]["samples_per_core"] / out["nnU-Net"]["samples_per_core"]
        out["block_ratios"] = pairs
        out["peak_rss_ratio"] = out["nnui"]["peak_rss_mib"] / out["nnU-Net"]["peak_rss_mib"]
    return out


def _run_logged(argv: list[str], log_path: Path, env: dict | None = None) -> None:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise RuntimeError(
            f"{Path(argv[1]).name if len(argv) > 1 else argv[0]} failed; see {log_path}"
        )


def _roots(work: Path) -> dict[str, str]:
    return {
        "nnUNet_raw": str(work / "raw"),
        "nnUNet_preprocessed": str(work / "nnunet_pre"),
        "nnUNet_results": str(work / "nnunet_results"),
    }


def prepare_real(plan: RealPlan, work: Path) -> tuple[Path, Path]:
    """(nnU-Net's, nnui's preprocessed dataset folder) at plan's patch and batch (cached)."""
    from real_data import write_mr_dataset

    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    if plan.mr_cases and not (raw / plan.dataset / "dataset.json").is_file():
        write_mr_dataset(raw, plan.dataset, plan.mr_cases)
    elif not plan.mr_cases and not (raw / plan.dataset).exists():
        (raw / plan.dataset).symlink_to(SHARED_RAW / plan.dataset)
    env, logs = dict(os.environ, **_roots(work)), work / "logs"
    nnunet = work / "nnunet_pre" / plan.dataset
    if not (nnunet / "nnUNetPlans.json").is_file():
        bindir = Path(sys.executable).parent
        # fmt: off
        _run_logged([str(bindir / "nnUNetv2_plan_and_preprocess"), "-d", str(plan.dataset_id),
                     "-c", plan.configuration, "-np", "2", "-npfp", "2"],
                    logs / "nnunet_pp.log", env)
        # fmt: on
    plans = json.loads((nnunet / "nnUNetPlans.json").read_text())
    conf = plans["configurations"][plan.configuration]
    planned = {"patch_size": conf["patch_size"], "batch_size": conf["batch_size"]}
    stamp = nnunet / "bench_planned.json"
    if not stamp.is_file():  # what nnU-Net's planner chose, before the plan is set by hand
        stamp.write_text(json.dumps(planned))
    conf["patch_size"], conf["batch_size"] = list(plan.patch), plan.batch
    (nnunet / "nnUNetPlans.json").write_text(json.dumps(plans, indent=1))
    ours = work / "nnui_pre" / plan.dataset
    if not (ours / "nnuiPlans.json").is_file():
        # fmt: off
        _run_logged([sys.executable, "-m", "trainer.planning.preprocess", str(plan.dataset_id),
                     "-c", plan.configuration, "--raw", str(raw), "--preprocessed",
                     str(work / "nnui_pre"), "-np", "2", "--patch-size", *map(str, plan.patch),
                     "--batch-size", f"{plan.configuration}={plan.batch}"],
                    logs / "nnui_pp.log", dict(env, PYTHONPATH=str(REPO)))
        # fmt: on
    from trainer.planning.splits import create_splits

    data = nnunet / conf["data_identifier"]
    ids = sorted(p.name[:-5] for p in data.glob("*.b2nd") if not p.name.endswith("_seg.b2nd"))
    text = json.dumps(create_splits(ids), indent=1) + "\n"
    for folder in (nnunet, ours):
        (folder / "splits_final.json").write_text(text)
    return nnunet, ours


def run_side(
    side: str, folder: Path, plan: RealPlan, a: argparse.Namespace, tag: str, profile: bool
) -> dict:
    """One fresh process of one side; its timing JSON plus the tree's peak memory."""
    from _common import run_tree

    out = a.work / "runs" / f"{plan.key}_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    # fmt: off
    argv = [sys.executable, str(BENCH_DIR / "loader_sides.py"), side, str(folder),
            plan.configuration, str(out), "--workers", str(a.workers), "--warmup",
            str(a.warmup), "--batches", str(a.batches or plan.batches), "--seed",
            tag.rsplit("_", 1)[-1]]
    # fmt: on
    if profile:
        argv.append("--profile")
    env = dict(os.environ, **_roots(a.work), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    tree, _ = run_tree(argv, a.work / "logs" / f"{plan.key}_{tag}.log", env=env)
    if tree.exit_code != 0 or not out.is_file():
        raise RuntimeError(f"{side} block failed (exit {tree.exit_code}); see {a.work}/logs")
    result = json.loads(out.read_text())
    result.update(peak_rss_bytes=tree.peak_rss_bytes, peak_pss_bytes=tree.peak_pss_bytes)
    return result


def real_plan_report(plan: RealPlan, a: argparse.Namespace) -> dict:
    nnunet, ours = prepare_real(plan, a.work)
    folders = {"nnU-Net": nnunet, "nnui": ours}
    runs = []
    for block, side in block_order(a.blocks):
        r = run_side(side, folders[side], plan, a, f"{side.lower()}_{block}", False)
        r["block"] = block
        print(
            f"  {plan.key} block {block} {side:8} {samples_per_core(r):6.2f} samples/CPU-s  "
            f"{r['batches'] * r['batch_size'] / r['wall_s']:6.2f} samples/s wall  "
            f"peak RSS {r['peak_rss_bytes'] / 2**20:7.0f} MiB",
            flush=True,
        )
        runs.append(r)
    report = {"plan": asdict(plan), "runs": runs, "summary": summarize_blocks(runs)}
    report["nnunet_planner"] = json.loads((nnunet / "bench_planned.json").read_text())
    if a.profile:
        prof = run_side("nnui", ours, plan, a, "nnui_profile_0", True)
        report["nnui_profile"] = prof["profile"]
    return report


def print_real(report: dict) -> None:
    plan, s = report["plan"], report["summary"]
    run0 = report["runs"][0]
    print(
        f"{plan['key']}: {plan['dataset']} {plan['configuration']} patch {plan['patch']} batch "
        f"{plan['batch']} (nnU-Net's planner: {report['nnunet_planner']}), read size nnU-Net "
        f"{next(r['read_size'] for r in report['runs'] if r['side'] == 'nnU-Net')} nnui "
        f"{next(r['read_size'] for r in report['runs'] if r['side'] == 'nnui')}, "
        f"{run0['train_cases']} training cases, {run0['workers']} workers"
    )
    for side in SIDES:
        v = s[side]
        print(
            f"  {side:8} {v['samples_per_core']:6.2f} samples/s per core  "
            f"{v['samples_per_s_wall']:6.2f} samples/s wall  peak RSS {v['peak_rss_mib']:.0f} MiB"
            f"  peak PSS {v['peak_pss_mib']:.0f} MiB  ({v['blocks']} blocks)"
        )
    pairs = ", ".join(f"{x:.2f}" for x in s["block_ratios"])
    print(
        f"  ratio nnui/nnU-Net samples/s per core = {s['ratio']:.2f} (blocks: {pairs}); "
        f"peak RSS nnui/nnU-Net = {s['peak_rss_ratio']:.2f}"
    )
    for row in report.get("nnui_profile", [])[:10]:
        print(f"    {100 * row['share']:5.1f} %  {row['tottime_s']:7.2f} s  {row['function']}")


def real_main(a: argparse.Namespace) -> int:
    sys.path.insert(0, str(BENCH_DIR))
    from _common import machine_line

    print(machine_line())
    reports = []
    try:
        for key in a.plans:
            reports.append(real_plan_report(REAL_PLANS[key], a))
            print_real(reports[-1])
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if a.json:
        Path(a.json).write_text(json.dumps(reports, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preprocessed", type=Path, help="preprocessed root holding Dataset900")
    parser.add_argument("--batches", type=int, help="timed (default 40; --real 30 3d, 300 2d)")
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (training-like)")
    parser.add_argument("--device", default="cpu", help="where batches go and augmentation runs")
    parser.add_argument("--real", action="store_true", help="nnui vs nnU-Net at real plans")
    parser.add_argument("--plans", nargs="+", default=["3d", "2d"], choices=sorted(REAL_PLANS))
    parser.add_argument("--blocks", type=int, default=2, help="--real: A B blocks per side")
    parser.add_argument("--warmup", type=int, default=3, help="--real: untimed batches first")
    parser.add_argument("--workers", type=int, default=0, help="--real: for each side")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nnui-lbench"), help="--real")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--json", help="--real: write the runs and summaries here")
    args = parser.parse_args(argv)
    if args.real:
        if args.blocks < 1 or (args.batches or 1) < 1 or args.workers < 0 or args.warmup < 0:
            print("error: need --blocks >= 1, --batches >= 1, --workers >= 0", file=sys.stderr)
            return 2
        args.work = args.work.absolute()
        return real_main(args)
    torch.set_num_threads(args.threads)
    args.batches = args.batches or 40
    with tempfile.TemporaryDirectory() as tmp:
        root = args.preprocessed
        if root is None:
            root = Path(tmp) / "preprocessed"
            make_demo_dataset(Path(tmp) / "raw", args.cases, seed=0)
            started = time.perf_counter()
            preprocess_dataset(
                Path(tmp) / "raw",
                root,
                "900",
                ("3d_fullres",),
                num_processes=2,
                progress=lambda line: None,
                # CPU-sized plans by name, under the default identifier read below
                options=PlannerOptions(CPU_PLANNER, DEFAULT_PLANS),
            )
            print(
                f"demo: {args.cases} cases preprocessed (3d_fullres) in "
                f"{time.perf_counter() - started:.1f} s"
            )
        folder = root / DEMO_DATASET
        config = load_plans(folder).configuration("3d_fullres")
        cases = PreprocessedCases(folder / config.data_identifier)
        print(
            f"3d_fullres patch {list(config.patch_size)} batch {config.batch_size}, "
            f"{args.batches} batches, device {args.device}, torch threads {args.threads}, "
            f"{psutil.cpu_count()} cores"
        )
        print(f"{'augment':8} {'workers':8} {'mode':8} {'patches/s':>10} {'CPU-s/patch':>12}")
        for augment in (False, True):
            for workers, mode in [
                (0, "inline"),
                (1, "thread"),
                (2, "thread"),
                (1, "process"),
                (2, "process"),
            ]:
                r = measure(
                    cases,
                    config,
                    augment,
                    workers,
                    "thread" if workers == 0 else mode,
                    args.batches,
                    torch.device(args.device),
                )
                print(
                    f"{augment!s:8} {workers:<8} {mode:8} {r['patches_per_s']:10.1f} "
                    f"{r['cpu_s_per_patch']:12.4f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
