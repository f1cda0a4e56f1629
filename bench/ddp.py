"""Step time of `-num_gpus 2` vs one process, at the same global batch.

    python bench/ddp.py [--configuration 3d_fullres] [--batch 4] [--iterations 5] [--epochs 3]
                        [-device auto|cuda|cpu]

`-device auto` (default) measures on CUDA (nccl) when torch sees a GPU, else on the CPU
(gloo); the 2-process row needs two visible GPUs on CUDA.

Writes a small demo dataset and preprocesses it with the given global batch (patch 16x32x32
in 3D, 32x32 in 2D) into a temporary folder, then runs `python -m trainer` with one process
and with `-num_gpus 2` (gloo). The figure per run is the median train step time of the
epochs after the first (the first includes warm-up), from `iterations_per_s` in events.jsonl,
plus the wall time of the whole command (start-up, spawn, validation included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.demo import DEMO_DATASET, make_demo_dataset  # noqa: E402
from trainer.planning.preprocess import preprocess_dataset  # noqa: E402
from trainer.planning.rules import CPU_PLANNER, Overrides, PlannerOptions  # noqa: E402
from trainer.schema.events import decode_event  # noqa: E402
from trainer.schema.tree import DEFAULT_PLANS, EVENTS_FILE, run_dir  # noqa: E402

PATCH = {"3d_fullres": (16, 32, 32), "2d": (32, 32)}


def _prepare(work: Path, configuration: str, batch: int, num_cases: int) -> Path:
    raw, pre = work / "raw", work / "preprocessed"
    make_demo_dataset(raw, num_cases=num_cases, seed=0, shape_scale=0.4)
    preprocess_dataset(
        raw, pre, "900", configurations=(configuration,), num_processes=1,
        overrides=Overrides(patch_size={configuration: PATCH[configuration]},
                            batch_size={configuration: batch}),
        # CPU-sized plans by name, under the default identifier the trainer reads
        options=PlannerOptions(CPU_PLANNER, DEFAULT_PLANS),
    )  # fmt: skip
    return pre


def _run(pre: Path, results: Path, args: argparse.Namespace, num_gpus: int) -> dict:
    argv = [
        sys.executable, "-m", "trainer", "900", args.configuration, "0", "-device", args.device,
        "--epochs", str(args.epochs), "--iterations-per-epoch", str(args.iterations),
        "--val-iterations", "1", "--num-workers", "1", "--disable_checkpointing",
        "--preprocessed", str(pre), "--results", str(results),
    ]  # fmt: skip
    if num_gpus > 1:
        argv += ["-num_gpus", str(num_gpus)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"error: run with -num_gpus {num_gpus} failed:\n{done.stdout[-3000:]}")
    folder = run_dir(results, DEMO_DATASET, args.configuration, "0")
    lines = (folder / EVENTS_FILE).read_text().splitlines()
    epochs = [e for e in map(decode_event, lines) if e and e["kind"] == "epoch_ended"]
    steady = epochs[1:] or epochs
    step_s = statistics.median(1 / e["iterations_per_s"] for e in steady)
    return {"num_procs": num_gpus, "step_s": step_s, "wall_s": wall_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configuration", default="3d_fullres", choices=sorted(PATCH))
    parser.add_argument("--batch", type=int, default=4, help="global batch size (plans)")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--cases", type=int, default=6)
    parser.add_argument("-device", dest="device", default="auto", choices=("auto", "cuda", "cpu"))
    args = parser.parse_args()
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    counts = (1, 2)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        counts = (1,)  # -num_gpus 2 needs two GPUs
        print("note: one CUDA device visible; measuring one process only", file=sys.stderr)
    if args.batch < 2:
        print("error: --batch must be >= 2 to split it over 2 processes", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="nnui_bench_ddp_") as tmp:
        work = Path(tmp)
        pre = _prepare(work, args.configuration, args.batch, args.cases)
        rows = [_run(pre, work / f"results{n}", args, n) for n in counts]
    cores = len(os.sched_getaffinity(0))
    print(f"{args.configuration}, global batch {args.batch}, patch {PATCH[args.configuration]}, "
          f"{args.iterations} it/epoch x {args.epochs} epochs, {cores} cores, "
          f"{'nccl' if args.device == 'cuda' else 'gloo'} on {args.device}")  # fmt: skip
    print(f"{'processes':>9}  {'s/step':>8}  {'samples/s':>9}  {'wall s':>7}")
    for row in rows:
        samples_s = args.batch / row["step_s"]
        step_s, wall_s = row["step_s"], row["wall_s"]
        print(f"{row['num_procs']:>9}  {step_s:>8.3f}  {samples_s:>9.1f}  {wall_s:>7.1f}")
    if len(rows) == 2:
        print(f"speed-up of 2 processes: {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
