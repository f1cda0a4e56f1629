"""nnui vs the real nnU-Net v2 (2.8.1) on identical work: same cases, fold, patch, batch, network.

    python bench/compare_nnunet.py [--work DIR] [--cases N] [--epochs 5] [--iterations 20]
                                   [--repeats 2] [--configuration 3d_fullres]

Steps: a separate venv with nnunetv2==2.8.1 (reused when present; a constraints file keeps
the CPU torch), the demo dataset, nnU-Net's planning and preprocessing, nnui's
preprocessing with nnU-Net's patch, batch and network written into nnui's plans, one
splits_final.json for both, then short trainings alternated A B A B so drift cancels.
Figures are appended to bench/history.md. Method: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from _common import (  # noqa: E402
    TreeSampler,
    append_history_md,
    machine_line,
    median_or_nan,
    parsed_or_exit_code,
    ratio,
    run_logged,
    run_sampled,
    side_ratio_lines,
    terminate_tree,
)

log = logging.getLogger("bench")
NNUNET_VERSION = "2.8.1"
# The CPU torch of the main venv; torchvision pinned so pip does not swap in a CUDA torch.
CONSTRAINTS = "torch==2.13.0\ntorchvision==0.28.0\n"
NNUNET_TRAINER = "nnUNetTrainer_nnuiBench"
DATASET_ID = 900
DATASET = "Dataset900_NnuiDemo"
FOLD = "0"


@dataclass(frozen=True)
class BenchArgs:
    work: Path
    cases: int
    epochs: int
    iterations: int
    val_iterations: int
    repeats: int
    configuration: str
    num_workers: int
    skip_nnui: bool
    skip_nnunet: bool


@dataclass
class RunFigures:
    """One training run of one side; times in seconds, memory in bytes."""

    side: str
    repeat: int
    exit_code: int
    s_per_iteration: float  # median over epochs after the first, training iterations only
    s_per_iteration_epochs: list[float]
    # CPU-s of the whole process tree per training iteration (epochs after the first):
    # robust on a loaded machine, where wall-clock figures mostly measure the neighbours.
    tree_cpu_s_per_iteration: float
    first_epoch_start_s: float  # process start -> first training epoch begins
    peak_rss_bytes: int  # whole process tree, until training ends (final validation excluded)
    peak_pss_bytes: int
    # CPU of the data side between the end of epoch 0 and the end of the last epoch, per
    # training+validation sample consumed there: nnU-Net's worker processes, nnui's
    # "nnui-loader" threads (reading + augmenting on CPU).
    inrun_worker_cpu_s_per_sample: float
    data_samples: int
    wall_s: float


# ---- data and plans --------------------------------------------------------------------


def ensure_demo_data(raw_root: Path, cases: int, shape_scale: float = 1.0) -> bool:
    """The demo dataset under raw_root (kept when it has these cases at this scale); True
    when it was (re)written, so preprocessed copies of an older one are stale."""
    dataset_json = raw_root / DATASET / "dataset.json"
    stamp = raw_root / f"{DATASET}.bench.json"
    scale_ok = (json.loads(stamp.read_text()) if stamp.is_file() else {}).get("shape_scale", 1.0)
    if (
        dataset_json.is_file()
        and json.loads(dataset_json.read_text())["numTraining"] == cases
        and scale_ok == shape_scale
    ):
        return False
    from trainer.demo import make_demo_dataset

    shutil.rmtree(raw_root / DATASET, ignore_errors=True)
    make_demo_dataset(raw_root, cases, seed=0, shape_scale=shape_scale)
    stamp.write_text(json.dumps({"shape_scale": shape_scale}))
    return True


def nnui_preprocess(a: BenchArgs, raw_root: Path, pre_root: Path, plan: dict) -> None:
    """nnui's own preprocessing at nnU-Net's patch and batch, then nnU-Net's network."""
    patch = [str(v) for v in plan["patch_size"]]
    # fmt: off
    argv = [sys.executable, "-m", "trainer.planning.preprocess",
            str(DATASET_ID), "-c", a.configuration,
            "--raw", str(raw_root), "--preprocessed", str(pre_root), "-np", "2",
            "--patch-size", *patch, "--batch-size", f"{a.configuration}={plan['batch_size']}"]
    # fmt: on
    rc = run_logged(argv, a.work / "logs" / "nnui_preprocess.log")
    if rc != 0:
        raise RuntimeError(f"nnui preprocessing failed (exit {rc}); see {a.work}/logs")
    plans_path = pre_root / DATASET / "nnuiPlans.json"
    data = json.loads(plans_path.read_text())
    conf = data["configurations"][a.configuration]
    arch = plan["architecture"]
    conf["patch_size"] = list(plan["patch_size"])
    conf["batch_size"] = int(plan["batch_size"])
    conf["network"] = {
        "features_per_stage": list(arch["features_per_stage"]),
        "kernel_sizes": [list(k) for k in arch["kernel_sizes"]],
        "strides": [list(s) for s in arch["strides"]],
        "n_conv_per_stage_encoder": list(arch["n_conv_per_stage"]),
        "n_conv_per_stage_decoder": list(arch["n_conv_per_stage_decoder"]),
    }
    from trainer.planning.plans import plans_from_dict, plans_to_json

    plans_path.write_text(plans_to_json(plans_from_dict(data)))


def share_splits(nnunet_pre: Path, nnui_pre: Path, dataset: str = DATASET) -> None:
    """One splits_final.json (nnU-Net's layout, which nnui reads too) for both sides."""
    from trainer.planning.splits import create_splits

    case_ids = sorted(
        p.name[: -len(".b2nd")]
        for p in (nnui_pre / dataset).glob("*/*.b2nd")
        if not p.name.endswith("_seg.b2nd")
    )
    text = json.dumps(create_splits(case_ids), indent=1) + "\n"
    for root in (nnunet_pre, nnui_pre):
        (root / dataset / "splits_final.json").write_text(text)


# ---- nnU-Net side -----------------------------------------------------------------------


def ensure_nnunet_venv(work: Path, trainer_src: Path) -> Path:
    """work/venv with nnunetv2 (created once, ~1 min from the local wheels) + our trainer."""
    venv = work / "venv"
    py = venv / "bin" / "python"
    # safetensors: bench/nnunet_random_checkpoint.py reads nnui's checkpoints there.
    probe = "import safetensors, importlib.metadata as m; print(m.version('nnunetv2'))"
    check = [str(py), "-c", probe]
    ok = (
        py.exists()
        and subprocess.run(check, capture_output=True, text=True).stdout.strip() == NNUNET_VERSION
    )
    if not ok:
        log.info("creating %s with nnunetv2==%s (one time)", venv, NNUNET_VERSION)
        work.mkdir(parents=True, exist_ok=True)
        constraints = work / "constraints.txt"
        constraints.write_text(CONSTRAINTS)
        install_log = work / "logs" / "install.log"
        pip = [str(py), "-m", "pip", "install", "-c", str(constraints)]
        # fmt: off
        steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
                 [*pip, "torch==2.13.0"],
                 [*pip, f"nnunetv2=={NNUNET_VERSION}", "psutil", "safetensors"]]
        # fmt: on
        for step in steps:
            if run_logged(step, install_log) != 0:
                raise RuntimeError(f"installing nnU-Net failed; see {install_log}")
    where = subprocess.run(
        [str(py), "-c", "import nnunetv2, os; print(os.path.dirname(nnunetv2.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Top level of the trainer package: found before primus/, which needs torchvision.
    target = Path(where) / "training" / "nnUNetTrainer" / f"{NNUNET_TRAINER}.py"
    if not target.is_file() or target.read_text() != trainer_src.read_text():
        shutil.copyfile(trainer_src, target)
    return venv


def nnunet_plan(venv: Path, roots: dict[str, str], a: BenchArgs) -> dict:
    """nnU-Net's plan of the configuration (its own planning and preprocessing, cached)."""
    pre = Path(roots["nnUNet_preprocessed"])
    stamp = pre / f"{DATASET}.bench.json"
    want = {"cases": a.cases, "configuration": a.configuration}
    plans_path = pre / DATASET / "nnUNetPlans.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == want and plans_path.is_file()):
        shutil.rmtree(pre / DATASET, ignore_errors=True)
        # fmt: off
        argv = [str(venv / "bin" / "nnUNetv2_plan_and_preprocess"), "-d", str(DATASET_ID),
                "-c", a.configuration, "-np", "2", "-npfp", "2", "--verify_dataset_integrity"]
        # fmt: on
        started = time.time()
        env = dict(os.environ, **roots)
        if run_logged(argv, a.work / "logs" / "nnunet_preprocess.log", env=env) != 0:
            raise RuntimeError(f"nnU-Net planning/preprocessing failed; see {a.work}/logs")
        log.info("nnU-Net plan and preprocess: %.0f s", time.time() - started)
        stamp.write_text(json.dumps(want))
    conf = json.loads(plans_path.read_text())["configurations"][a.configuration]
    return {
        "patch_size": conf["patch_size"],
        "batch_size": conf["batch_size"],
        "architecture": conf["architecture"]["arch_kwargs"],
    }


@dataclass
class NnunetTiming:
    s_per_iteration: list[float]
    train_windows: list[tuple[float, float]]
    first_epoch_start_t: float
    window_t0: float  # end of epoch 0: data CPU is counted from here ...
    window_t1: float  # ... to the end of the last epoch
    data_samples: int
    training_done_t: float


def nnunet_timing(fold_dir: Path, iterations: int, val_iterations: int) -> NnunetTiming:
    """Figures from the stamps our trainer subclass writes (bench_timing.jsonl)."""
    stamps = [
        json.loads(x) for x in (fold_dir / "bench_timing.jsonl").read_text().splitlines() if x
    ]
    by = {}
    for s in stamps:
        by.setdefault(s["event"], []).append(s)
    starts, ends = by.get("train_start", []), by.get("train_end", [])
    val_ends = by.get("val_end", [])
    batch = by["dataloaders"][0]["batch_size"]
    per_iter = [(e["t"] - s["t"]) / iterations for s, e in zip(starts, ends, strict=False)]
    done = by.get("training_done", [{"t": float("inf")}])[0]["t"]
    return NnunetTiming(
        per_iter,
        [(s["t"], e["t"]) for s, e in zip(starts, ends, strict=False)],
        starts[0]["t"] if starts else float("nan"),
        val_ends[0]["t"] if val_ends else 0.0,
        val_ends[-1]["t"] if val_ends else 0.0,
        max(0, len(val_ends) - 1) * (iterations + val_iterations) * batch,
        done,
    )


# ---- nnui runs --------------------------------------------------------------------------


def _read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def _wait_for_training(proc: subprocess.Popen, events_path: Path) -> int:
    """Exit code, or 0 once the final checkpoint is written: the final sliding-window
    validation that follows is not part of the compared work (nnU-Net's side skips it)."""
    while proc.poll() is None:
        for e in _read_events(events_path):
            if e["kind"] == "checkpoint_saved" and e.get("checkpoint") == "final":
                return 0
        time.sleep(1.0)
    return proc.returncode


def nnui_train_argv(
    a: BenchArgs, pre_root: Path, results: Path, fold: str, dataset: str = DATASET
) -> list[str]:
    """nnui-train of the bench schedule on CPU (results under `results`)."""
    # fmt: off
    return [sys.executable, "-m", "trainer", dataset, a.configuration, fold,
            "-device", "cpu", "--epochs", str(a.epochs),
            "--iterations-per-epoch", str(a.iterations), "--val-iterations", str(a.val_iterations),
            "--num-workers", str(a.num_workers),
            "--preprocessed", str(pre_root), "--results", str(results)]
    # fmt: on


def nnui_fold_dir(a: BenchArgs, results: Path, fold: str, dataset: str = DATASET) -> Path:
    return results / dataset / f"nnuiTrainer__nnuiPlans__{a.configuration}" / f"fold_{fold}"


def run_nnui(a: BenchArgs, pre_root: Path, repeat: int) -> RunFigures:
    results = a.work / "nnui_results" / f"run{repeat}"
    shutil.rmtree(results, ignore_errors=True)
    argv = nnui_train_argv(a, pre_root, results, FOLD)
    log_path = a.work / "logs" / f"nnui_run{repeat}.log"
    fold_dir = nnui_fold_dir(a, results, FOLD)
    started = time.time()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        sampler = TreeSampler(proc.pid, thread_name="nnui-loader").start()
        try:
            rc = _wait_for_training(proc, fold_dir / "events.jsonl")
        finally:
            sampler.stop()
            terminate_tree(proc.pid)
            sampler.end_leftovers()
    wall_s = time.time() - started
    sampler.dump(a.work / "logs" / f"nnui_run{repeat}_sampler.json")
    events = _read_events(fold_dir / "events.jsonl")
    epochs = [e for e in events if e["kind"] == "epoch_ended"]
    topology = next((e for e in events if e["kind"] == "topology"), {"ranks": [{}]})
    batch = int(topology["ranks"][0].get("batch_size", 0))
    # iterations_per_s counts training iterations only (validation excluded), like the
    # train_start/train_end stamps of the nnU-Net side.
    per_iter = [1.0 / e["iterations_per_s"] for e in epochs]
    first_start = epochs[0]["t"] - epochs[0]["epoch_time_s"] if epochs else float("nan")
    windows = [
        (e["t"] - e["epoch_time_s"], e["t"] - e["epoch_time_s"] + x)
        for e, x in zip(epochs[1:], [p * a.iterations for p in per_iter[1:]], strict=True)
    ]
    tree_cpu = sum(sampler.tree_cpu_s(t0, t1) for t0, t1 in windows)
    end_t = epochs[-1]["t"] if epochs else None
    samples = (len(epochs) - 1) * (a.iterations + a.val_iterations) * batch
    cpu = 0.0
    if len(epochs) > 1:
        t0, t1 = epochs[0]["t"], epochs[-1]["t"]
        cpu = sampler.named_threads_cpu_s(t0, t1) + sampler.children_cpu_s(t0, t1)
    peak = sampler.peak(until_t=end_t)
    return RunFigures(
        "nnui",
        repeat,
        rc,
        median_or_nan(per_iter[1:]),
        [round(x, 3) for x in per_iter],
        ratio(tree_cpu, len(windows) * a.iterations),
        first_start - started,
        peak.rss_bytes if peak else 0,
        sampler.peak_pss_bytes(end_t),
        ratio(cpu, samples),
        samples,
        wall_s,
    )


def nnunet_train(
    a: BenchArgs,
    venv: Path,
    env_roots: dict[str, str],
    results: Path,
    fold: str,
    dataset: str = DATASET,
) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of nnUNetv2_train with the bench trainer's schedule."""
    env = dict(
        os.environ,
        **env_roots,
        nnUNet_results=str(results),
        NNUI_BENCH_EPOCHS=str(a.epochs),
        NNUI_BENCH_ITERATIONS=str(a.iterations),
        NNUI_BENCH_VAL_ITERATIONS=str(a.val_iterations),
    )
    train = str(venv / "bin" / "nnUNetv2_train")
    return [
        train,
        dataset,
        a.configuration,
        fold,
        "-tr",
        NNUNET_TRAINER,
        "-device",
        "cpu",
    ], env


def nnunet_fold_dir(a: BenchArgs, results: Path, fold: str, dataset: str = DATASET) -> Path:
    trained = f"{NNUNET_TRAINER}__nnUNetPlans__{a.configuration}"
    return results / dataset / trained / f"fold_{fold}"


def run_nnunet(a: BenchArgs, venv: Path, env_roots: dict[str, str], repeat: int) -> RunFigures:
    results = a.work / "nnunet_results" / f"run{repeat}"
    shutil.rmtree(results, ignore_errors=True)
    argv, env = nnunet_train(a, venv, env_roots, results, FOLD)
    run = run_sampled(argv, a.work / "logs" / f"nnunet_run{repeat}.log", env=env)
    rc, started, wall_s, sampler = run.exit_code, run.started_t, run.wall_s, run.sampler
    sampler.dump(a.work / "logs" / f"nnunet_run{repeat}_sampler.json")
    fold_dir = nnunet_fold_dir(a, results, FOLD)
    f = nnunet_timing(fold_dir, a.iterations, a.val_iterations)
    tree_cpu = sum(sampler.tree_cpu_s(t0, t1) for t0, t1 in f.train_windows[1:])
    cpu = sampler.children_cpu_s(f.window_t0, f.window_t1) if f.window_t1 > f.window_t0 else 0.0
    peak = sampler.peak(until_t=f.training_done_t)
    return RunFigures(
        "nnU-Net",
        repeat,
        rc,
        median_or_nan(f.s_per_iteration[1:]),
        [round(x, 3) for x in f.s_per_iteration],
        ratio(tree_cpu, max(0, len(f.train_windows) - 1) * a.iterations),
        f.first_epoch_start_t - started,
        peak.rss_bytes if peak else 0,
        sampler.peak_pss_bytes(f.training_done_t),
        ratio(cpu, f.data_samples),
        f.data_samples,
        wall_s,
    )


# ---- report ---------------------------------------------------------------------------


def summarize(runs: list[RunFigures]) -> tuple[list[str], dict[str, float]]:
    rows = [
        ("s/iteration", "s_per_iteration", "{:.3f} s"),
        ("CPU-s/iteration (process tree)", "tree_cpu_s_per_iteration", "{:.2f} CPU-s"),
        ("first-iteration", "first_epoch_start_s", "{:.1f} s"),
        ("peak-memory", "peak_rss_bytes", None),
        ("peak-memory (PSS)", "peak_pss_bytes", None),
    ]
    return side_ratio_lines(runs, rows)


def run_floor(a: BenchArgs, pre_root: Path) -> dict | None:
    """bench/floor.py: nnui's compute floor and its inline data cost (CPU-s/sample)."""
    out = a.work / "floor.json"
    argv = [sys.executable, str(BENCH_DIR / "floor.py"), str(DATASET_ID), a.configuration]
    argv += ["--preprocessed", str(pre_root), "--iterations", "3", "--json", str(out)]
    if run_logged(argv, a.work / "logs" / "floor.log") != 0:
        return None
    return json.loads(out.read_text())


def nnunet_data_cost(
    a: BenchArgs, venv: Path, roots: dict[str, str], threads: int | None = None
) -> float | None:
    """nnU-Net's loader + transforms run inline (see data_cost_main in the trainer file),
    with torch's default threads (as its augmentation workers run) or `threads`."""
    module = f"nnunetv2.training.nnUNetTrainer.{NNUNET_TRAINER}"
    env = dict(os.environ, **roots, nnUNet_results=str(a.work / "nnunet_results" / "datacost"))
    if threads:
        env["NNUI_BENCH_THREADS"] = str(threads)
    argv = [str(venv / "bin" / "python"), "-m", module, str(DATASET_ID), a.configuration, FOLD]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    (a.work / "logs" / "nnunet_datacost.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["data_cpu_s_per_sample"]


def append_results(
    a: BenchArgs,
    argv: list[str],
    machine: str,
    runs: list[RunFigures],
    lines: list[str],
    plan: dict | None,
) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        f"\n## compare_nnunet {stamp}\n",
        f"- machine: {machine}",
        f"- command: `python bench/compare_nnunet.py {' '.join(argv)}`",
    ]
    if plan:
        text.append(
            f"- work: patch {plan['patch_size']}, batch {plan['batch_size']}, features "
            f"{plan['architecture']['features_per_stage']}, {a.epochs} epochs x "
            f"{a.iterations} iterations (+{a.val_iterations} val), fold {FOLD}"
        )
    text += ["", "```", *lines, "```", "", "raw runs:", "", "```"]
    text += [json.dumps(asdict(r)) for r in runs] + ["```", ""]
    append_history_md(text)


def parse_args(argv: list[str]) -> BenchArgs:
    p = argparse.ArgumentParser(prog="compare_nnunet", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/nnui-bench", help="venv, data, runs (reused)")
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--iterations", type=int, default=20, help="training iterations per epoch")
    p.add_argument("--val-iterations", type=int, default=2, help="same for both sides")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--configuration", default="3d_fullres", choices=("3d_fullres", "2d"))
    p.add_argument("--num-workers", type=int, default=2, help="nnui loader workers")
    p.add_argument("--skip-nnui", action="store_true", help="only the nnU-Net side")
    p.add_argument("--skip-nnunet", action="store_true", help="only the nnui side")
    ns = p.parse_args(argv)
    if ns.epochs < 2 or ns.iterations < 1 or ns.repeats < 1 or ns.cases < 5:
        print(
            "error: need --epochs >= 2 (the first is excluded), --iterations >= 1, "
            "--repeats >= 1, --cases >= 5",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return BenchArgs(
        Path(ns.work).absolute(),
        ns.cases,
        ns.epochs,
        ns.iterations,
        ns.val_iterations,
        ns.repeats,
        ns.configuration,
        ns.num_workers,
        ns.skip_nnui,
        ns.skip_nnunet,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # the command line in history.md
    a = parsed_or_exit_code(parse_args, argv)
    if isinstance(a, int):
        return a
    machine = machine_line()
    raw, nnunet_pre, nnui_pre = (
        a.work / "raw",
        a.work / "nnunet_preprocessed",
        a.work / "nnui_preprocessed",
    )
    try:
        venv = ensure_nnunet_venv(a.work, BENCH_DIR / "nnunet_short_trainer.py")
        ensure_demo_data(raw, a.cases)
        roots = {"nnUNet_raw": str(raw), "nnUNet_preprocessed": str(nnunet_pre)}
        plan = nnunet_plan(venv, roots, a)
        log.info("nnU-Net plan: patch %s batch %s", plan["patch_size"], plan["batch_size"])
        if not a.skip_nnui:
            nnui_preprocess(a, raw, nnui_pre, plan)
            share_splits(nnunet_pre, nnui_pre)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sides = [s for s, skip in (("nnU-Net", a.skip_nnunet), ("nnui", a.skip_nnui)) if not skip]
    runs: list[RunFigures] = []
    for repeat in range(a.repeats):
        for side in sides:  # A B A B: slow drift of the machine hits both sides alike
            log.info("run %d: %s", repeat, side)
            r = (
                run_nnunet(a, venv, roots, repeat)
                if side == "nnU-Net"
                else run_nnui(a, nnui_pre, repeat)
            )
            log.info("%s", json.dumps(asdict(r)))
            runs.append(r)
    lines, _ = summarize(runs)
    floor = None if a.skip_nnui else run_floor(a, nnui_pre)
    theirs = None if a.skip_nnunet else nnunet_data_cost(a, venv, roots)
    theirs_1 = None if a.skip_nnunet else nnunet_data_cost(a, venv, roots, threads=1)
    ours = floor["data_cpu_s_per_sample"] if floor else None
    nan = float("nan")
    lines.append(
        f"data CPU-s/sample (loading + augmentation; nnui in its loader threads, nnU-Net "
        f"inline at its default threads): nnui {ours or nan:.4f}  nnU-Net {theirs or nan:.4f}"
        f" (nnU-Net at 1 thread {theirs_1 or nan:.4f})"
    )
    data_ratio = ratio(ours, theirs) if ours and theirs else nan
    lines.append(f"data CPU-s/sample ratio nnui/nnU-Net = {data_ratio:.2f}")
    inrun = {
        side: median_or_nan([r.inrun_worker_cpu_s_per_sample for r in runs if r.side == side])
        for side in ("nnui", "nnU-Net")
    }
    lines.append(
        f"data CPU-s/sample in the runs (nnui loader threads, nnU-Net worker processes): "
        f"nnui {inrun['nnui']:.4f}  nnU-Net {inrun['nnU-Net']:.4f}"
    )
    inrun_ratio = ratio(inrun["nnui"], inrun["nnU-Net"])
    lines.append(f"in-run data CPU-s/sample ratio nnui/nnU-Net = {inrun_ratio:.2f}")
    if floor:
        nnui_s = median_or_nan([r.s_per_iteration for r in runs if r.side == "nnui"])
        lines.append(
            f"floor (nnui step on a fixed batch): {floor['s_per_iteration']:.3f} s/iteration"
        )
        lines.append(f"nnui/floor = {ratio(nnui_s, floor['s_per_iteration']):.2f}")
        nnui_cpu = median_or_nan([r.tree_cpu_s_per_iteration for r in runs if r.side == "nnui"])
        lines.append(
            f"nnui/floor in CPU-s = {ratio(nnui_cpu, floor['cpu_s_per_iteration']):.2f} "
            f"(floor {floor['cpu_s_per_iteration']:.2f} CPU-s/iteration)"
        )
    print("\n".join(lines))
    append_results(a, argv, machine, runs, lines, plan)
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
