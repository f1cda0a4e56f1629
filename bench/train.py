"""Trainer figures on the demo dataset: s/iteration, samples/s, checkpoint write time, and
how long a graceful stop takes.

    python bench/train.py [--preprocessed ROOT] [--cases 10] [--iterations 10] [-device cpu]

Without --preprocessed it writes the demo dataset and preprocesses it (default plans) into
a temporary folder first. Every figure comes from real `python -m trainer` runs and their
events.jsonl: iterations/s of the second epoch (the first one includes warm-up),
checkpoint write times from `checkpoint_saved`, and for the stop: SIGUSR1 -> process exit,
and the part of it after the epoch boundary (the `epoch_ended` record) -> exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainer.demo import DEMO_DATASET, make_demo_dataset  # noqa: E402
from trainer.planning.plans import load_plans  # noqa: E402
from trainer.planning.preprocess import preprocess_dataset  # noqa: E402
from trainer.planning.rules import CPU_PLANNER, PlannerOptions  # noqa: E402
from trainer.schema.events import decode_event  # noqa: E402
from trainer.schema.tree import DEFAULT_PLANS, EVENTS_FILE, run_dir  # noqa: E402


def _events(run: Path) -> list[dict]:
    path = run / EVENTS_FILE
    if not path.exists():
        return []
    return [e for e in map(decode_event, path.read_text().splitlines()) if e]


def _trainer(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer", *args], cwd=ROOT, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def throughput(pre: Path, results: Path, config: str, batch: int, opts: argparse.Namespace) -> dict:
    args = [
        "900", config, "0", "-device", opts.device, "--epochs", "2",
        "--iterations-per-epoch", str(opts.iterations), "--val-iterations", "2",
        "--num-workers", str(opts.num_workers), "--preprocessed", str(pre),
        "--results", str(results), "--save-every", "1",
    ]  # fmt: skip
    started = time.perf_counter()
    proc = _trainer(args, results / f"{config}.log")
    rc = proc.wait()
    wall_s = time.perf_counter() - started
    if rc != 0:
        raise SystemExit(f"{config} run failed (exit {rc}); see {results / f'{config}.log'}")
    records = _events(run_dir(results, DEMO_DATASET, config, "0"))
    epochs = [e for e in records if e["kind"] == "epoch_ended"]
    its = epochs[-1]["iterations_per_s"]
    writes = [e["write_time_s"] for e in records if e["kind"] == "checkpoint_saved"]
    return {
        "configuration": config, "batch_size": batch, "s_per_iteration": 1 / its,
        "samples_per_s": its * batch, "first_epoch_s": epochs[0]["epoch_time_s"],
        "checkpoint_write_s_median": sorted(writes)[len(writes) // 2], "run_wall_s": wall_s,
    }  # fmt: skip


def stop_latency(pre: Path, results: Path, config: str, opts: argparse.Namespace) -> dict:
    args = [
        "900", config, "0", "-device", opts.device, "--epochs", "100",
        "--iterations-per-epoch", str(opts.iterations), "--val-iterations", "2",
        "--num-workers", str(opts.num_workers), "--preprocessed", str(pre),
        "--results", str(results / "stop"),
    ]  # fmt: skip
    run = run_dir(results / "stop", DEMO_DATASET, config, "0")
    proc = _trainer(args, results / "stop.log")
    try:
        # After epoch 0 the trainer writes checkpoint_best; once that is recorded it is
        # (nearly) inside epoch 1, so the stop waits for that epoch's end.
        while not any(e["kind"] == "checkpoint_saved" for e in _events(run)):
            if proc.poll() is not None:
                raise SystemExit(f"stop run exited early; see {results / 'stop.log'}")
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.time()
        proc.send_signal(signal.SIGUSR1)
        rc = proc.wait(timeout=600)
        exited = time.time()
    finally:
        if proc.poll() is None:
            proc.kill()
    records = _events(run)
    boundary = [e["t"] for e in records if e["kind"] == "epoch_ended"][-1:]
    latest = [e for e in records if e["kind"] == "checkpoint_saved" and e["checkpoint"] == "latest"]
    return {
        "exit_code": rc, "signal_to_exit_s": exited - sent,
        "stopped_after_epoch": [e["epoch"] for e in records if e["kind"] == "stopped"][-1:],
        "epoch_boundary_to_exit_s": exited - boundary[0] if boundary else None,
        "latest_write_s": latest[-1]["write_time_s"] if latest else None,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preprocessed", default=None, help="root holding Dataset900 (else a temp demo)"
    )
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=10, help="iterations per epoch")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("-device", dest="device", default="cpu")
    parser.add_argument("--configurations", nargs="+", default=["2d", "3d_fullres"])
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nnui-bench-train-"))
    if opts.preprocessed:
        pre = Path(opts.preprocessed)
    else:
        make_demo_dataset(work / "raw", num_cases=opts.cases, seed=0)
        pre = work / "preprocessed"
        # CPU-sized plans by name, under the default identifier the trainer reads
        preprocess_dataset(work / "raw", pre, "900", configurations=tuple(opts.configurations),
                           num_processes=2,
                           options=PlannerOptions(CPU_PLANNER, DEFAULT_PLANS))  # fmt: skip
    plans = load_plans(pre / DEMO_DATASET)
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; device {opts.device}")
    rows = []
    for config in opts.configurations:
        c = plans.configuration(config)
        results = work / f"results_{config}"
        results.mkdir(parents=True, exist_ok=True)
        row = throughput(pre, results, config, c.batch_size, opts)
        row["patch"] = "x".join(map(str, c.patch_size))
        row["features"] = f"{c.network.features_per_stage[0]}-{c.network.features_per_stage[-1]}"
        rows.append(row)
        print(
            f"{config:11s} patch {row['patch']:>10s} batch {c.batch_size:3d}: "
            f"{row['s_per_iteration']:.3f} s/iteration, {row['samples_per_s']:.2f} samples/s, "
            f"first epoch {row['first_epoch_s']:.1f} s, checkpoint write "
            f"{row['checkpoint_write_s_median'] * 1000:.0f} ms (median)"
        )
    stop = stop_latency(
        pre, work / f"results_{opts.configurations[0]}", opts.configurations[0], opts
    )
    print(
        f"graceful stop ({opts.configurations[0]}): exit {stop['exit_code']}, SIGUSR1 -> exit "
        f"{stop['signal_to_exit_s']:.2f} s, epoch boundary -> exit "
        f"{stop['epoch_boundary_to_exit_s']:.2f} s (latest written in {stop['latest_write_s']} s)"
    )
    print(json.dumps({"throughput": rows, "stop": stop}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
