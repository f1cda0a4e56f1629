"""The GPU check of issue 7: s/iteration, GPU busy % and data waits, one fold on 4 cores.

    python bench/gpu.py [--work DIR] [--cores 4] [--epochs 4] [--iterations 60]
                        [--val-iterations 5] [--device cuda] [--no-results]

One prepared run for a lent GPU machine, well inside 10 minutes: the demo dataset and its
3d_fullres preprocessing (made once under --work), then nnui-train on GPU 0 with its CPU
affinity cut to --cores cores (what one fold of a parallel cross-validation gets on a
shared 8-GPU box with few cores), NVML sampled every 0.1 s; then the same with
--recompute-norm on (its time cost on a GPU, where it is off by default). Printed and
appended to bench/RESULTS.md:

- s/iteration: median of 1 / iterations_per_s over the epochs after the first;
- GPU busy %: mean NVML utilisation while the training iterations run;
- data wait: share of the training time the step loop spent blocked on a batch
  (epoch_ended.data_wait_s); 0 means loading and augmentation stay hidden;
- peak GPU memory of the trainer process (NVML, all of its allocations).

On the lent H200 machine the image has torch but not blosc2 or nibabel: carry their wheels
(see the device notes; blosc2 needs ndindex and numexpr, nibabel needs packaging) and run
`PYTHONPATH=.:/tmp/site python3 bench/gpu.py`. --device cpu runs the same path on a CPU
(tiny schedule; no NVML figures) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

DATASET = "Dataset900_NnuiDemo"
CONFIG = "3d_fullres"


class GpuSampler:
    """NVML utilisation and this process tree's GPU memory, every period_s, in a thread."""

    def __init__(self, pid: int, period_s: float = 0.1):
        self.pid, self.period_s = pid, period_s
        self.samples: list[tuple[float, int, int]] = []  # (t, util %, process memory bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import pynvml  # nvidia-ml-py

        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except pynvml.NVMLError as exc:  # no driver (CPU check): no GPU figures
            print(f"NVML not available ({exc}); GPU figures are n/a", file=sys.stderr)
            return
        while not self._stop.is_set():
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
            used = sum(
                p.usedGpuMemory or 0
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == self.pid
            )
            self.samples.append((time.time(), util, used))
            self._stop.wait(self.period_s)

    def busy_percent(self, windows: list[tuple[float, float]]) -> float:
        inside = [u for t, u, _ in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(inside) if inside else float("nan")

    def peak_memory_bytes(self) -> int:
        return max((m for _, _, m in self.samples), default=0)


def prepare(work: Path) -> tuple[Path, Path]:
    """Demo data and its 3d_fullres preprocessing under work (once)."""
    raw, pre = work / "raw", work / "preprocessed"
    if not (pre / DATASET / "nnuiPlans.json").is_file():
        from trainer.demo import make_demo_dataset

        make_demo_dataset(raw, 20, seed=0)
        argv = [sys.executable, "-m", "trainer.preprocess", "900", "-c", CONFIG,
                "--raw", str(raw), "--preprocessed", str(pre)]  # fmt: skip
        subprocess.run(argv, check=True, cwd=REPO)
    return raw, pre


def run_once(args: argparse.Namespace, pre: Path, recompute: str) -> dict:
    results = args.work / f"results_{recompute}"
    argv = [sys.executable, "-m", "trainer", "900", CONFIG, "0", "-device", args.device,
            "--epochs", str(args.epochs), "--iterations-per-epoch", str(args.iterations),
            "--val-iterations", str(args.val_iterations), "--recompute-norm", recompute,
            "--preprocessed", str(pre), "--results", str(results),
            "--disable_checkpointing"]  # fmt: skip
    cores = sorted(os.sched_getaffinity(0))[: args.cores]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    started = time.time()
    with open(args.work / f"train_{recompute}.log", "w") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )  # fmt: skip
        with GpuSampler(proc.pid) as sampler:
            rc = proc.wait()
    run_dir = results / DATASET / f"nnuiTrainer__nnuiPlans__{CONFIG}" / "fold_0"
    events_path = run_dir / "events.jsonl"
    events = [json.loads(x) for x in events_path.read_text().splitlines()] if rc == 0 else []
    epochs = [e for e in events if e["kind"] == "epoch_ended"]
    train_s = [args.iterations / e["iterations_per_s"] for e in epochs]
    windows = [(e["t"] - e["epoch_time_s"], e["t"] - e["epoch_time_s"] + s)
               for e, s in zip(epochs, train_s, strict=True)][1:]  # fmt: skip
    later = epochs[1:]
    return {
        "recompute_norm": recompute,
        "exit_code": rc,
        "cores": len(cores),
        "s_per_iteration": statistics.median([1 / e["iterations_per_s"] for e in later])
        if later
        else float("nan"),
        "data_wait_share": sum(e["data_wait_s"] for e in later) / sum(train_s[1:])
        if later
        else float("nan"),
        "max_epoch_data_wait_s": max((e["data_wait_s"] for e in later), default=float("nan")),
        "gpu_busy_percent": sampler.busy_percent(windows),
        "peak_gpu_memory_gib": sampler.peak_memory_bytes() / 2**30,
        "wall_s": time.time() - started,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/nnui-gpu", help="data and runs (reused)")
    p.add_argument("--cores", type=int, default=4, help="CPU cores the fold may use")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--val-iterations", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--no-results", action="store_true", help="do not append to RESULTS.md")
    args = p.parse_args(argv)
    args.work = Path(args.work).absolute()
    if args.epochs < 2 or args.iterations < 1 or args.cores < 1:
        print("error: need --epochs >= 2, --iterations >= 1, --cores >= 1", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device here; use --device cpu to check the script", file=sys.stderr
            )
            return 2
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = "none (CPU check)"
    args.work.mkdir(parents=True, exist_ok=True)
    _, pre = prepare(args.work)
    runs = [run_once(args, pre, "off"), run_once(args, pre, "on")]
    lines = [f"gpu: {gpu}; {args.epochs} epochs x {args.iterations} iterations, 3d_fullres demo"]
    for r in runs:
        lines.append(
            f"recompute-norm {r['recompute_norm']}: {r['s_per_iteration']:.4f} s/iteration, "
            f"GPU busy {r['gpu_busy_percent']:.0f} %, data wait {100 * r['data_wait_share']:.1f} "
            f"% of training time (worst epoch {r['max_epoch_data_wait_s']:.3f} s), peak GPU "
            f"memory {r['peak_gpu_memory_gib']:.2f} GiB, {r['cores']} cores, exit {r['exit_code']}"
        )
    print("\n".join(lines))
    if not args.no_results:
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = " ".join(argv if argv is not None else sys.argv[1:])
        text = [f"\n## gpu {stamp}\n", f"- command: `python bench/gpu.py {command}`", "",
                "```", *lines, "```", "", "```", *[json.dumps(r) for r in runs], "```",
                ""]  # fmt: skip
        with open(BENCH_DIR / "RESULTS.md", "a") as handle:
            handle.write("\n".join(text))
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
