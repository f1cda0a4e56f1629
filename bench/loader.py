"""Loader throughput: patches/s and CPU-seconds per patch on the demo 3d_fullres config.

    python bench/loader.py [--preprocessed ROOT] [--batches 40] [--cases 20]

Without --preprocessed it writes the demo dataset and preprocesses 3d_fullres into a
temporary folder first. CPU time counts this process and its loader worker processes.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import psutil
import torch

from trainer.data.dataset import PreprocessedCases
from trainer.data.loader import PatchLoader
from trainer.data.planning import CPU_PLANNER, PlannerOptions
from trainer.demo import DEMO_DATASET, make_demo_dataset
from trainer.plans import load_plans
from trainer.preprocess import preprocess_dataset
from trainer.schema import DEFAULT_PLANS


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preprocessed", type=Path, help="preprocessed root holding Dataset900")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (training-like)")
    parser.add_argument("--device", default="cpu", help="where batches go and augmentation runs")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
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
