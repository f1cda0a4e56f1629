"""nnui-predict vs nnUNetv2_predict (2.8.1) on identical work: seconds per case, peak memory.

    python bench/predict.py [--work DIR] [--test-cases 3] [--repeats 2] [--tta on off]
                            [--npp 1] [--nps 1] [--threads N] [--precision auto fp32]
    python bench/predict.py --real [--blocks 2] [--windows 2] [--stages prep net export]
    python bench/predict.py --real --stages all --case brats|drive|ct [--tta off on]

--real --stages all --case brats|drive|ct: whole cases, raw files to segmentations on disk,
nnui vs nnUNetv2_predict with the same weights (bench/predict_whole.py).

--real: a generated 512x512x300 CT case, nnui vs nnU-Net stage by stage (read +
preprocess, network per window, resampling + export); see bench/predict_real.py.

Same cases (the demo dataset's held-out imagesTs), same network (nnU-Net's plan written
into nnui's plans by compare_nnunet's setup: 16.47 M parameters), same patch, step size
and mirroring axes, one fold, -device cpu, the same torch threads. The prediction cost does
not depend on the weights' values, so the checkpoint is nnui's cheapest (one training
iteration, ended once checkpoint_final is written), written for nnU-Net in its trainer's
checkpoint layout with the same tensors (bench/nnunet_random_checkpoint.py,
bench/nnunet_weights.py): both sides run the same model and their segmentations are
compared voxel by voxel. Runs alternate A B A B; figures and ratios are appended to
bench/history.md.

--precision: nnui-predict's --precision values to run, each a side of its own ("nnui" is
its default, auto: bf16 autocast on CPUs with AMX; "nnui fp32" computes in float32, as
nnUNetv2_predict does on CPU). With more than one, the segmentations of each nnui side are
compared voxel by voxel with those of the first.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from _common import (  # noqa: E402
    GIB,
    TreeSampler,
    machine_line,
    median_or_nan,
    parsed_or_exit_code,
    ratio,
    terminate_tree,
)
from compare_nnunet import (  # noqa: E402
    DATASET,
    DATASET_ID,
    FOLD,
    NNUNET_VERSION,
    BenchArgs,
    _wait_for_training,
    ensure_nnunet_venv,
    nnui_preprocess,
    nnunet_plan,
    share_splits,
)

log = logging.getLogger("bench.predict")
TRAINING_CASES = 20  # compare_nnunet's dataset: the plan (and network) it gives
STEP_SIZE = 0.5
GOAL_S_PER_CASE = 0.5
GOAL_MEMORY = 0.7


@dataclass(frozen=True)
class PredictArgs:
    work: Path
    test_cases: int
    repeats: int
    configuration: str
    tta_modes: tuple[bool, ...]
    npp: int
    nps: int
    threads: int
    shape_scale: float
    precisions: tuple[str, ...] = ("auto",)

    def nnui_sides(self) -> list[str]:
        return [nnui_side(p) for p in self.precisions]


def nnui_side(precision: str) -> str:
    return "nnui" if precision == "auto" else f"nnui {precision}"


@dataclass
class PredictRun:
    """One prediction process tree; seconds, CPU-seconds (user + system), bytes."""

    side: str
    tta: bool
    repeat: int
    exit_code: int
    cases: int
    wall_s: float  # process start to exit: imports, model loading, every case
    tree_cpu_s: float  # the whole tree over the whole run (wait4: exited children included)
    first_output_s: float  # process start to the first segmentation on disk
    steady_s_per_case: float  # between the first and last segmentation written, per case
    steady_cpu_s_per_case: float
    peak_rss_bytes: int  # largest sum over the tree (sampled every 0.2 s)
    peak_pss_bytes: int  # same with PSS (sampled every 2 s): shared pages counted once
    max_process_rss_bytes: int  # the largest single process (kernel's maxrss)


# ---- setup ------------------------------------------------------------------------------


def _bench_args(a: PredictArgs) -> BenchArgs:
    """compare_nnunet's arguments for its setup steps (plan, nnui preprocessing)."""
    return BenchArgs(
        a.work, TRAINING_CASES, 2, 1, 1, 1, a.configuration, 2, False, False
    )  # epochs, iterations, val iterations, repeats: unused by the setup


def nnunet_venv(a: PredictArgs) -> Path:
    """This interpreter's venv when it holds nnunetv2 2.8.1, else compare_nnunet's own."""
    try:
        if importlib.metadata.version("nnunetv2") == NNUNET_VERSION:
            return Path(sys.prefix)
    except importlib.metadata.PackageNotFoundError:
        pass
    return ensure_nnunet_venv(a.work, BENCH_DIR / "nnunet_short_trainer.py")


def ensure_data(raw: Path, test_cases: int, shape_scale: float) -> Path:
    """compare_nnunet's 20 training cases (seed 0, the plan and network it gives) and the
    input folder: `test_cases` held-out cases of the same generator, shapes scaled by
    `shape_scale` (full-size cases take ~10 min each with TTA on a loaded 2-core box)."""
    from trainer.demo import make_demo_dataset

    if not (raw / DATASET / "dataset.json").is_file():
        make_demo_dataset(raw, TRAINING_CASES, seed=0)
    held_out = raw.parent / f"held_out_x{shape_scale:g}"
    images_ts = held_out / DATASET / "imagesTs"
    have = len(list(images_ts.glob("*_0000.nii.gz"))) if images_ts.is_dir() else 0
    if have < test_cases:
        shutil.rmtree(held_out, ignore_errors=True)
        make_demo_dataset(held_out, TRAINING_CASES, 0, shape_scale, num_test_cases=test_cases)
    inputs = raw.parent / "inputs" / f"n{test_cases}_x{shape_scale:g}"
    shutil.rmtree(inputs, ignore_errors=True)
    inputs.mkdir(parents=True)
    for path in sorted(images_ts.glob("*_0000.nii.gz"))[:test_cases]:
        shutil.copyfile(path, inputs / path.name)
    return inputs


def nnunet_model(a: PredictArgs, venv: Path, roots: dict[str, str], nnui_results: Path) -> dict:
    """nnU-Net's model folder whose checkpoint_final.pth holds nnui's trained weights under
    nnU-Net's names (cached): both sides predict with the same model."""
    from trainer.schema.tree import checkpoint_file as schema_checkpoint_file
    from trainer.schema.tree import run_dir as schema_run_dir

    results = a.work / "nnunet_results"
    model = results / DATASET / f"nnUNetTrainer__nnUNetPlans__{a.configuration}"
    info_path = model / "bench_model.json"
    weights = schema_run_dir(nnui_results, DATASET, a.configuration, FOLD)
    weights = weights / schema_checkpoint_file("final")
    if (model / f"fold_{FOLD}" / "checkpoint_final.pth").is_file() and info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("weights") == str(weights):
            return info
    argv = [str(venv / "bin" / "python"), str(BENCH_DIR / "nnunet_random_checkpoint.py")]
    env = dict(os.environ, **roots, nnUNet_results=str(results))
    done = subprocess.run(
        [*argv, DATASET, a.configuration, FOLD, str(weights)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"writing nnU-Net's checkpoint failed: {done.stderr.strip()[-400:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    info["weights"] = str(weights)
    info_path.write_text(json.dumps(info))
    return info


def nnui_model(a: PredictArgs, pre_root: Path) -> Path:
    """nnui's checkpoint_final of one training iteration (the run is ended before its final
    validation, which is not part of the compared work)."""
    from trainer.schema.tree import checkpoint_file, run_dir

    results = a.work / "nnui_results"
    fold_dir = run_dir(results, DATASET, a.configuration, FOLD)
    if (fold_dir / checkpoint_file("final")).is_file():
        return results
    shutil.rmtree(results, ignore_errors=True)
    # fmt: off
    argv = [sys.executable, "-m", "trainer", str(DATASET_ID), a.configuration, FOLD,
            "-device", "cpu", "--epochs", "1", "--iterations-per-epoch", "1",
            "--val-iterations", "1", "--preprocessed", str(pre_root), "--results", str(results)]
    # fmt: on
    with open(a.work / "logs" / "nnui_train.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            rc = _wait_for_training(proc, fold_dir / "events.jsonl")
        finally:
            terminate_tree(proc.pid)
    if rc != 0 or not (fold_dir / checkpoint_file("final")).is_file():
        raise RuntimeError(f"nnui's short training failed (exit {rc}); see {a.work}/logs")
    return results


# ---- one timed prediction -----------------------------------------------------------------


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def nnui_argv(
    inputs: Path, a: PredictArgs, tta: bool, pre: Path, res: Path, precision: str, out: Path
) -> list:
    # fmt: off
    argv = [sys.executable, "-m", "trainer.predict", "-i", str(inputs), "-o", str(out),
            "-d", str(DATASET_ID), "-c", a.configuration, "-f", FOLD, "-device", "cpu",
            "-step_size", str(STEP_SIZE), "--preprocessed", str(pre), "--results", str(res),
            "--precision", precision]
    # fmt: on
    return argv if tta else [*argv, "--disable_tta"]


def nnunet_argv(inputs: Path, a: PredictArgs, tta: bool, venv: Path, out: Path) -> list:
    # fmt: off
    argv = [str(venv / "bin" / "nnUNetv2_predict"), "-i", str(inputs), "-o", str(out),
            "-d", str(DATASET_ID), "-c", a.configuration, "-f", FOLD, "-tr", "nnUNetTrainer",
            "-p", "nnUNetPlans", "-device", "cpu", "-step_size", str(STEP_SIZE),
            "-npp", str(a.npp), "-nps", str(a.nps), "--disable_progress_bar"]
    # fmt: on
    return argv if tta else [*argv, "--disable_tta"]


def timed_run(argv: list, env: dict, out: Path, log_path: Path) -> tuple:
    """(exit code, start t, wall s, rusage, sampler, segmentation mtimes) of one run."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler = TreeSampler(proc.pid).start()
        try:
            # wait4: CPU and maxrss of the process and every child it waited for.
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        finally:
            sampler.stop()
            sampler.end_leftovers()
    wall_s = time.time() - started
    done = sorted(p.stat().st_mtime for p in out.glob("*.nii.gz")) if out.is_dir() else []
    return proc.returncode, started, wall_s, usage, sampler, done


def prediction_dir(a: PredictArgs, side: str, tta: bool, repeat: int) -> Path:
    side_tag = side.lower().replace("-", "").replace(" ", "_")
    return a.work / "predictions" / f"{side_tag}_{'tta' if tta else 'notta'}_run{repeat}"


def measure(side: str, tta: bool, repeat: int, make_argv, env: dict, a: PredictArgs) -> PredictRun:
    """One run of one side; make_argv(output folder) gives its command."""
    tag = (
        f"{side.lower().replace('-', '').replace(' ', '_')}_{'tta' if tta else 'notta'}_run{repeat}"
    )
    out = a.work / "predictions" / tag
    argv = make_argv(out)
    rc, started, wall_s, usage, sampler, done = timed_run(
        argv, env, out, a.work / "logs" / f"predict_{tag}.log"
    )
    sampler.dump(a.work / "logs" / f"predict_{tag}_sampler.json")
    steady = len(done) >= 2
    between = len(done) - 1
    peak = sampler.peak()
    return PredictRun(
        side,
        tta,
        repeat,
        rc if len(done) == a.test_cases else (rc or 1),
        len(done),
        wall_s,
        usage.ru_utime + usage.ru_stime,
        done[0] - started if done else float("nan"),
        (done[-1] - done[0]) / between if steady else float("nan"),
        sampler.tree_cpu_s(done[0], done[-1]) / between if steady else float("nan"),
        peak.rss_bytes if peak else 0,
        sampler.peak_pss_bytes(),
        usage.ru_maxrss * 1024,
    )


# ---- report -------------------------------------------------------------------------------

FIGURES = (  # label, how one run gives it, unit
    ("s/case (whole run, wall)", lambda r: r.wall_s / r.cases, "s"),
    ("CPU-s/case (whole run, process tree)", lambda r: r.tree_cpu_s / r.cases, "CPU-s"),
    ("s/case (steady: first to last output)", lambda r: r.steady_s_per_case, "s"),
    ("CPU-s/case (steady, process tree)", lambda r: r.steady_cpu_s_per_case, "CPU-s"),
    ("start to first output", lambda r: r.first_output_s, "s"),
    ("peak memory (RSS sum)", lambda r: r.peak_rss_bytes / GIB, "GiB"),
    ("peak memory (PSS sum)", lambda r: r.peak_pss_bytes / GIB, "GiB"),
    ("largest process (maxrss)", lambda r: r.max_process_rss_bytes / GIB, "GiB"),
)


def summarize(runs: list[PredictRun], tta: bool, nnui_sides: list[str]) -> list[str]:
    """Medians over the repeats of one TTA mode, and each nnui side's ratio to nnU-Net."""
    lines = [f"TTA (mirroring) {'on' if tta else 'off'}:"]
    for nnui in nnui_sides:
        if len(nnui_sides) > 1:
            lines.append(f" {nnui}:")
        ratios = {}
        for label, figure, unit in FIGURES:
            med = {
                side: median_or_nan(
                    [
                        figure(r)
                        for r in runs
                        if r.side == side and r.tta == tta and r.exit_code == 0
                    ]
                )
                for side in (nnui, "nnU-Net")
            }
            ratios[label] = ratio(med[nnui], med["nnU-Net"])
            lines.append(
                f"  {label}: {nnui} {med[nnui]:.2f} {unit}  nnU-Net {med['nnU-Net']:.2f} {unit}"
                f"  ratio {nnui}/nnU-Net = {ratios[label]:.2f}"
            )
        speed = ratios["CPU-s/case (whole run, process tree)"]
        wall = ratios["s/case (whole run, wall)"]
        memory = ratios["peak memory (PSS sum)"]
        lines.append(
            f"  goal s/case <= {GOAL_S_PER_CASE}x: wall {wall:.2f} CPU-s {speed:.2f}"
            f" -> {'met' if max(wall, speed) <= GOAL_S_PER_CASE else 'missed'}; "
            f"peak memory <= {GOAL_MEMORY}x: PSS {memory:.2f} RSS "
            f"{ratios['peak memory (RSS sum)']:.2f} -> "
            f"{'met' if memory <= GOAL_MEMORY else 'missed'}"
        )
    return lines


def agreement(a: PredictArgs, tta: bool) -> list[str]:
    """Voxels where each nnui side's segmentation equals nnU-Net's (run 0: both sides run
    the same trained weights) and each further nnui side's equals the first's."""
    import nibabel as nib
    import numpy as np

    def folder(side: str) -> Path:
        return prediction_dir(a, side, tta, 0)

    first, lines = a.nnui_sides()[0], []
    pairs = [("nnU-Net", side) for side in a.nnui_sides()]
    pairs += [(first, other) for other in a.nnui_sides()[1:]]
    for first, other in pairs:
        same = total = 0
        for path in sorted(folder(first).glob("*.nii.gz")):
            x = np.asarray(nib.load(str(path)).dataobj)
            y = np.asarray(nib.load(str(folder(other) / path.name)).dataobj)
            same, total = same + int((x == y).sum()), total + x.size
        share = same / total if total else float("nan")
        lines.append(f"  segmentations {first} vs {other}: {100 * share:.3f} % of voxels equal")
    return lines


def case_shapes(inputs: Path) -> list[list[int]]:
    from trainer.data.image_io import image_shape

    return [list(image_shape(p)) for p in sorted(inputs.glob("*_0000.nii.gz"))]


def append_results(a: PredictArgs, argv: list[str], machine: str, config: list[str], body) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [f"\n## predict {stamp}\n", f"- machine: {machine}"]
    text += [f"- command: `{' '.join(['python bench/predict.py', *argv])}`", *config]
    text += ["", "```", *body[0], "```", "", "raw runs:", "", "```"]
    text += [json.dumps(asdict(r)) for r in body[1]] + ["```", ""]
    with open(BENCH_DIR / "history.md", "a") as handle:
        handle.write("\n".join(text))


def parse_args(argv: list[str]) -> PredictArgs:
    p = argparse.ArgumentParser(prog="bench/predict.py", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/nnui-pbench", help="data, models, runs (reused)")
    p.add_argument("--test-cases", type=int, default=2, help="held-out cases per run")
    p.add_argument("--shape-scale", type=float, default=0.6, help="of the held-out cases")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--configuration", default="3d_fullres", choices=("3d_fullres", "2d"))
    p.add_argument("--tta", nargs="+", default=["on"], choices=("on", "off"))
    p.add_argument("--npp", type=int, default=1, help="nnU-Net's preprocessing processes")
    p.add_argument("--nps", type=int, default=1, help="nnU-Net's export processes")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument(
        "--precision",
        nargs="+",
        default=["auto"],
        choices=("auto", "fp32", "bf16"),
        help="nnui-predict --precision values, one side each (default: auto)",
    )
    ns = p.parse_args(argv)
    if ns.test_cases < 2 or ns.repeats < 1 or ns.threads < 1 or not 0.05 <= ns.shape_scale <= 4:
        print(
            "error: need --test-cases >= 2, --repeats >= 1, --threads >= 1, "
            "--shape-scale within 0.05-4",
            file=sys.stderr,
        )
        raise SystemExit(2)
    modes = tuple(dict.fromkeys(m == "on" for m in ns.tta))
    work = Path(ns.work).absolute()
    return PredictArgs(
        work,
        ns.test_cases,
        ns.repeats,
        ns.configuration,
        modes,
        ns.npp,
        ns.nps,
        ns.threads,
        ns.shape_scale,
        tuple(dict.fromkeys(ns.precision)),
    )


def setup(a: PredictArgs) -> tuple:
    """(nnU-Net venv, roots, input folder, nnui results, nnU-Net model info)."""
    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    venv = nnunet_venv(a)
    raw, nnunet_pre, nnui_pre = a.work / "raw", a.work / "nnunet_preprocessed", a.work / "nnui_pre"
    inputs = ensure_data(raw, a.test_cases, a.shape_scale)
    roots = {"nnUNet_raw": str(raw), "nnUNet_preprocessed": str(nnunet_pre)}
    plan = nnunet_plan(venv, roots, _bench_args(a))
    if not (nnui_pre / DATASET / "nnuiPlans.json").is_file():
        nnui_preprocess(_bench_args(a), raw, nnui_pre, plan)
        share_splits(nnunet_pre, nnui_pre)
    nnui_results = nnui_model(a, nnui_pre)
    info = nnunet_model(a, venv, roots, nnui_results)
    info["plan"] = plan
    return venv, roots, inputs, nnui_pre, nnui_results, info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)  # also echoed into history.md
    if "--real" in argv and "all" in argv:  # whole cases (bench/predict_whole.py)
        from predict_whole import whole_main

        return whole_main([x for x in argv if x != "--real"])
    if "--real" in argv:  # one real-size case, stage by stage (bench/predict_real.py)
        from predict_real import real_main

        return real_main([x for x in argv if x != "--real"])
    a = parsed_or_exit_code(parse_args, argv)
    if isinstance(a, int):
        return a
    machine = machine_line()
    try:
        venv, roots, inputs, nnui_pre, nnui_results, info = setup(a)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    env = dict(os.environ, **_thread_env(a.threads))
    nnunet_env = dict(env, **roots, nnUNet_results=str(a.work / "nnunet_results"))
    nnui_env = dict(env, PYTHONPATH=str(REPO))
    runs: list[PredictRun] = []
    for tta in a.tta_modes:
        for repeat in range(a.repeats):  # A B A B: drift of the machine hits both sides
            for side, precision in [
                ("nnU-Net", ""),
                *zip(a.nnui_sides(), a.precisions, strict=True),
            ]:
                log.info("TTA %s run %d: %s", tta, repeat, side)
                if side != "nnU-Net":
                    make = partial(nnui_argv, inputs, a, tta, nnui_pre, nnui_results, precision)
                    r = measure(side, tta, repeat, make, nnui_env, a)
                else:
                    make = partial(nnunet_argv, inputs, a, tta, venv)
                    r = measure(side, tta, repeat, make, nnunet_env, a)
                log.info("%s", json.dumps(asdict(r)))
                runs.append(r)
    lines = [
        line
        for tta in a.tta_modes
        for line in [*summarize(runs, tta, a.nnui_sides()), *agreement(a, tta)]
    ]
    print("\n".join(lines))
    plan = info["plan"]
    config = [
        f"- work: {a.test_cases} held-out demo cases (shape scale {a.shape_scale:g}), raw "
        f"shapes {case_shapes(inputs)}; patch "
        f"{plan['patch_size']}, step {STEP_SIZE}, fold {FOLD}, -device cpu, "
        f"{info['parameters'] / 1e6:.2f} M parameters, nnU-Net mirror axes {info['mirror_axes']}",
        f"- threads: OMP_NUM_THREADS={a.threads} for both (nnUNetv2_predict also sets "
        f"torch.set_num_threads(cpu_count={os.cpu_count()})); nnU-Net -npp {a.npp} -nps "
        f"{a.nps} (its background processes), nnui one read and one write thread",
    ]
    append_results(a, argv, machine, config, (lines, runs))
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
