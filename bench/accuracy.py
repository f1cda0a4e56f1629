"""nnui vs the real nnU-Net v2 (2.8.1) on identical work, judged by the Dice of the final
validation (whole validation cases, raw geometry, each side's own summary.json).

    python bench/accuracy.py [--work DIR] [--cases 15] [--shape-scale 0.5]
                             [--configuration 2d] [--epochs 50] [--iterations 20]
                             [--val-iterations 1] [--folds 0,1,2,3,4] [--repeats 1]
                             [--num-workers 2] [--nnui-args "--recompute-norm off"]
    python bench/accuracy.py --raw DIR/DatasetNNN_Name [--patch 256,256] [--batch 2]
                             [--val-disable-tta] [the schedule and fold flags above]

--raw (issues #25, #32): each side plans the raw dataset with ITS OWN default planner
(nnUNetv2_plan_and_preprocess -> nnUNetPlans; nnui-preprocess -> nnuiPlans), and the output
says whether the planned configuration is equal field by field. Where the CPU forces a
smaller patch or batch, --patch/--batch writes the SAME values into both sides' plans files
in --work (never the user's; the network stays as planned) and the output says so. Then the
same folds and schedule as below; it prints Dice per fold, mean and sd of both sides and the
wall time of each stage (plan+preprocess, training, final validation).
bench/accuracy_data.py writes generated multi-channel and anisotropic raw datasets for it.

Without --raw (the demo): same raw cases, folds (one splits_final.json), plan, patch, batch
and network (nnU-Net's plan copied into nnui's plans, as bench/compare_nnunet.py does), same
schedule (epochs x
iterations); each side keeps its own augmentation, sampling, loss and optimiser. Folds run
alternated A B A B; --repeats R trains every fold R times per side, so a difference can be
set against the run-to-run spread. nnU-Net takes no seed: every run draws fresh weights.
nnui's run of fold f, repeat r gets --seed 12345 + 5 r + f: distinct weights in every run as
nnU-Net's, yet reproducible (one seed for all runs would count one initialisation, lucky or
not, once per fold: the plan fixes the network, so the seed fixes the weights), and the same
seed whether the folds run in one command or are split over several (--folds 0,1 and 2,3,4).
Both sides train with torch's threads = cores
(nnU-Net sets it on CPU, nnui per rank) and --num-workers data workers (nnU-Net:
nnUNet_n_proc_DA; nnui: loader threads); nnU-Net's final-validation export pool gets the
same count (nnUNet_def_n_proc).
The 1-minute load average before and after each run is kept (a shared box's load
inflates wall time, not CPU-s). Figures are appended to bench/history.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # compare_nnunet adds the repo

import accuracy_raw as rawmode
from _common import append_history_md, machine_line, parsed_or_exit_code, ratio, run_sampled
from accuracy_raw import RawDataset, stage_s
from compare_nnunet import (
    BENCH_DIR,
    DATASET,
    REPO,
    BenchArgs,
    ensure_demo_data,
    ensure_nnunet_venv,
    nnui_fold_dir,
    nnui_preprocess,
    nnui_train_argv,
    nnunet_fold_dir,
    nnunet_plan,
    nnunet_train,
    share_splits,
)

log = logging.getLogger("bench")
SIDES = ("nnU-Net", "nnui")
NNUI_SEED = 12345  # nnui-train's default --seed; see nnui_seed()


@dataclass(frozen=True)
class AccuracyArgs:
    work: Path
    cases: int
    shape_scale: float
    configuration: str
    epochs: int
    iterations: int
    val_iterations: int
    folds: list[str]
    repeats: int
    num_workers: int
    order: str  # "alternate" (A B A B) or "together" (both sides of a pair at once)
    nnui_args: list[str]  # execution flags that keep results (e.g. --recompute-norm off)
    raw: RawDataset | None = None  # --raw: each side plans this dataset for itself
    patch: list[int] | None = None  # --patch: the same override in both sides' plans
    batch: int | None = None  # --batch: likewise
    val_tta: bool = True  # mirroring in the final validation (both sides alike)

    @property
    def dataset(self) -> str:
        return self.raw.name if self.raw else DATASET

    def units(self) -> list[tuple[str, int]]:
        """(fold, repeat) pairs in run order; each one is trained once by each side."""
        return [(fold, r) for r in range(self.repeats) for fold in self.folds]

    def as_bench_args(self) -> BenchArgs:
        """compare_nnunet's arguments, for its data, plan and preprocessing steps."""
        return BenchArgs(
            self.work, self.cases, self.epochs, self.iterations, self.val_iterations, 1,
            self.configuration, self.num_workers, False, False,
        )  # fmt: skip


@dataclass
class FoldRun:
    """One side's training + final validation of one fold."""

    side: str
    fold: str
    repeat: int
    exit_code: int
    fg_dice: float  # validation/summary.json foreground_mean Dice (nan when missing)
    dice_per_label: dict[str, float]
    wall_s: float  # process start to exit: training and final validation
    tree_cpu_s: float
    pseudo_dice: list[float] = field(default_factory=list)  # per epoch, mean over labels
    load_avg: tuple[float, float] = (float("nan"), float("nan"))  # 1-min, before / after
    # {label: first epoch with pseudo Dice >= 0.5}: when each side learned each class
    learned_epoch: dict[str, int | None] = field(default_factory=dict)
    seed: int | None = None  # nnui's --seed; None: nnU-Net's own fresh draw
    final_val_s: float = float("nan")  # of wall_s: the final validation (the rest: training)


def read_summary(path: Path) -> tuple[float, dict[str, float]]:
    """(foreground_mean Dice, {label: mean Dice}) of a summary.json in nnU-Net's layout."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return float("nan"), {}
    labels = {k: float(v["Dice"]) for k, v in data.get("mean", {}).items() if "Dice" in v}
    fg = data.get("foreground_mean", {}).get("Dice")
    return (float(fg) if fg is not None else float("nan")), labels


def nnunet_pseudo_dice_per_label(fold_dir: Path) -> list[list[float]]:
    """Per-epoch pseudo Dice of each label from nnU-Net's training_log_*.txt."""
    curves = []
    for log_file in sorted(fold_dir.glob("training_log_*.txt")):
        for line in log_file.read_text().splitlines():
            if "Pseudo dice" in line:
                values = [float(v) for v in re.findall(r"\d+\.\d+(?:e-?\d+)?", line.split("[")[-1])]
                if values:
                    curves.append(values)
    return curves


def nnunet_pseudo_dice(fold_dir: Path) -> list[float]:
    """Per-epoch mean pseudo Dice from nnU-Net's training_log_*.txt ('Pseudo dice [...]')."""
    return [round(statistics.fmean(v), 3) for v in nnunet_pseudo_dice_per_label(fold_dir)]


def _epochs_ended(events_path: Path) -> list[dict]:
    if not events_path.is_file():
        return []
    lines = events_path.read_text().splitlines()
    return [
        json.loads(line) for line in lines if '"epoch_ended"' in line and line.strip().endswith("}")
    ]


def nnui_pseudo_dice(events_path: Path) -> list[float]:
    values = [e.get("mean_fg_dice") for e in _epochs_ended(events_path)]
    return [round(float(v), 3) for v in values if v is not None]


def nnui_pseudo_dice_per_label(events_path: Path) -> list[list[float]]:
    return [list(e["dice_per_class"]) for e in _epochs_ended(events_path) if "dice_per_class" in e]


def learned_epoch(curves: list[list[float]], threshold: float = 0.5) -> dict[str, int | None]:
    """{label: first epoch whose pseudo Dice reached threshold, None if none did}; label i+1
    is column i (background has no column)."""
    labels = max((len(c) for c in curves), default=0)
    first: dict[str, int | None] = {}
    for i in range(labels):
        hits = [e for e, c in enumerate(curves) if i < len(c) and c[i] >= threshold]
        first[str(i + 1)] = hits[0] if hits else None
    return first


def nnui_seed(fold: str, repeat: int) -> int:
    """nnui's --seed of one (fold, repeat): fixed by the unit, not by its place in the run."""
    return NNUI_SEED + 5 * repeat + int(fold)


def _unit_name(fold: str, repeat: int) -> str:
    return f"fold{fold}" + (f"_r{repeat}" if repeat else "")


def run_nnunet_fold(
    a: AccuracyArgs, venv: Path, roots: dict[str, str], fold: str, repeat: int = 0
) -> FoldRun:
    results = a.work / "nnunet_results" / _unit_name(fold, repeat)
    shutil.rmtree(results, ignore_errors=True)
    argv, env = nnunet_train(a.as_bench_args(), venv, roots, results, fold, a.dataset)
    env.update(
        nnUNet_n_proc_DA=str(a.num_workers),
        nnUNet_def_n_proc=str(a.num_workers),  # its final validation's export processes
        NNUI_BENCH_FINAL_VALIDATION="1",
        NNUI_BENCH_VAL_DISABLE_TTA="0" if a.val_tta else "1",
    )
    load_before = os.getloadavg()[0]
    run = run_sampled(argv, a.work / "logs" / f"nnunet_{_unit_name(fold, repeat)}.log", env=env)
    fold_dir = nnunet_fold_dir(a.as_bench_args(), results, fold, a.dataset)
    fg, labels = read_summary(fold_dir / "validation" / "summary.json")
    curve = nnunet_pseudo_dice(fold_dir)
    learned = learned_epoch(nnunet_pseudo_dice_per_label(fold_dir))
    stamps = fold_dir / "bench_timing.jsonl"
    final_val = stage_s(stamps, "event", "final_validation_start", "final_validation_end")
    return FoldRun(
        "nnU-Net", fold, repeat, run.exit_code, fg, labels, run.wall_s, run.tree_cpu_s, curve,
        (load_before, os.getloadavg()[0]), learned, None, final_val,
    )  # fmt: skip


def run_nnui_fold(
    a: AccuracyArgs, raw: Path, pre_root: Path, fold: str, repeat: int = 0
) -> FoldRun:
    results = a.work / "nnui_results" / _unit_name(fold, repeat)
    shutil.rmtree(results, ignore_errors=True)
    argv = nnui_train_argv(a.as_bench_args(), pre_root, results, fold, a.dataset)
    argv += ["--raw", str(raw), *([] if a.val_tta else ["--val_disable_tta"])]
    seed = nnui_seed(fold, repeat)
    argv += [*a.nnui_args, "--seed", str(seed)]
    log_path = a.work / "logs" / f"nnui_{_unit_name(fold, repeat)}.log"
    load_before = os.getloadavg()[0]
    run = run_sampled(argv, log_path, cwd=REPO, thread_name="nnui-loader")
    fold_dir = nnui_fold_dir(a.as_bench_args(), results, fold, a.dataset)
    fg, labels = read_summary(fold_dir / "validation" / "summary.json")
    curve = nnui_pseudo_dice(fold_dir / "events.jsonl")
    learned = learned_epoch(nnui_pseudo_dice_per_label(fold_dir / "events.jsonl"))
    events = fold_dir / "events.jsonl"
    final_val = stage_s(events, "kind", "validation_started", "validation_finished")
    return FoldRun(
        "nnui", fold, repeat, run.exit_code, fg, labels, run.wall_s, run.tree_cpu_s, curve,
        (load_before, os.getloadavg()[0]), learned, seed, final_val,
    )  # fmt: skip


# ---- report ---------------------------------------------------------------------------


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def _unit_label(fold: str, repeat: int, repeats: int) -> str:
    return f"fold {fold}" + (f" repeat {repeat}" if repeats > 1 else "")


def summarize(a: AccuracyArgs, runs: list[FoldRun]) -> list[str]:
    by = {(r.side, r.fold, r.repeat): r for r in runs}
    units = a.units()
    lines = []
    for fold, repeat in units:
        them, us = by[("nnU-Net", fold, repeat)], by[("nnui", fold, repeat)]
        name = _unit_label(fold, repeat, a.repeats)
        lines.append(
            f"{name}: foreground Dice nnU-Net {them.fg_dice:.3f} {_labels(them)}  "
            f"nnui {us.fg_dice:.3f} {_labels(us)}  difference {us.fg_dice - them.fg_dice:+.3f}"
        )
        lines.append(
            f"{name}: wall nnU-Net {them.wall_s:.0f} s nnui {us.wall_s:.0f} s; "
            f"CPU-s nnU-Net {them.tree_cpu_s:.0f} nnui {us.tree_cpu_s:.0f}; load "
            f"nnU-Net {_load(them)} nnui {_load(us)}"
        )
        lines.append(
            f"{name}: first epoch with pseudo Dice >= 0.5 per label: nnU-Net "
            f"{_learned(them)} nnui {_learned(us)} (nnui --seed {us.seed})"
        )
    dice = {s: [by[(s, *u)].fg_dice for u in units] for s in SIDES}
    diffs = [u - t for u, t in zip(dice["nnui"], dice["nnU-Net"], strict=True)]
    for side in SIDES:
        lines.append(
            f"{side}: mean foreground Dice {statistics.fmean(dice[side]):.3f} "
            f"(SD over folds and repeats {_spread(dice[side]):.3f})"
        )
    wall = {s: sum(by[(s, *u)].wall_s for u in units) for s in SIDES}
    cpu = {s: sum(by[(s, *u)].tree_cpu_s for u in units) for s in SIDES}
    lines.append(f"wall time: nnui {wall['nnui']:.0f} s  nnU-Net {wall['nnU-Net']:.0f} s")
    lines.append(f"CPU-s (process tree): nnui {cpu['nnui']:.0f}  nnU-Net {cpu['nnU-Net']:.0f}")
    lines.append(f"CPU-s ratio nnui/nnU-Net = {ratio(cpu['nnui'], cpu['nnU-Net']):.2f}")
    lines.append(
        f"Dice difference per run: {' '.join(f'{d:+.3f}' for d in diffs)} "
        f"(SD {_spread(diffs):.3f}, standard error {_spread(diffs) / len(diffs) ** 0.5:.3f})"
    )
    lines.append(f"mean foreground Dice difference nnui - nnU-Net = {statistics.fmean(diffs):+.3f}")
    lines.append(f"wall time ratio nnui/nnU-Net = {ratio(wall['nnui'], wall['nnU-Net']):.2f}")
    return lines


def _learned(run: FoldRun) -> str:
    return " ".join(f"{k}:{'never' if v is None else v}" for k, v in run.learned_epoch.items())


def _load(run: FoldRun) -> str:
    return f"{run.load_avg[0]:.1f}->{run.load_avg[1]:.1f}"


def _labels(run: FoldRun) -> str:
    return "(" + " ".join(f"{k}:{v:.3f}" for k, v in sorted(run.dice_per_label.items())) + ")"


def config_line(a: AccuracyArgs, plan: dict) -> str:
    arch = plan["architecture"]
    data = (
        f"raw {a.raw.folder}" if a.raw else f"{a.cases} demo cases at shape scale {a.shape_scale}"
    )
    return (
        f"{a.configuration}, {data}, folds "
        f"{','.join(a.folds)} (5-fold split) x {a.repeats} repeat(s), patch "
        f"{plan['patch_size']}, batch {plan['batch_size']}, features "
        f"{arch['features_per_stage']}, {a.epochs} epochs x {a.iterations} iterations "
        f"(+{a.val_iterations} val), torch threads = "
        f"{os.cpu_count()} both, {a.num_workers} data workers each (nnU-Net processes, nnui "
        f"threads), final validation {'with' if a.val_tta else 'WITHOUT'} mirroring on both; "
        "nnui flags: "
        f"{' '.join(a.nnui_args) or 'defaults'}"
    )


def append_results(argv: list[str], machine: str, config: str, lines: list[str], runs) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = [
        f"\n## accuracy {stamp}\n",
        f"- machine: {machine}",
        f"- command: `python bench/accuracy.py {' '.join(argv)}`",
        f"- work: {config}",
        "",
        "```",
        *lines,
        "```",
        "",
        "raw runs (pseudo_dice: per-epoch mean over labels of each side's own online estimate):",
        "",
        "```",
        *[json.dumps(asdict(r)) for r in runs],
        "```",
        "",
    ]
    append_history_md(text)


def parse_args(argv: list[str]) -> AccuracyArgs:
    p = argparse.ArgumentParser(prog="accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/acc-bench", help="venv, data, runs (reused)")
    # The defaults are the verdict's work (bench/history.md, ~50 min on 2 cores): long enough
    # that both sides learn the demo's small lesion, all five folds against the spread.
    p.add_argument("--cases", type=int, default=15)
    p.add_argument("--shape-scale", type=float, default=0.5, help="demo case size factor")
    p.add_argument("--configuration", default="2d", choices=("2d", "3d_fullres"))
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--iterations", type=int, default=20, help="training iterations per epoch")
    p.add_argument("--val-iterations", type=int, default=1, help="same for both sides")
    p.add_argument("--folds", default="0,1,2,3,4", help="comma-separated folds of the 5-fold split")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per fold and side (nnui: seed 12345 + 5 repeat + fold)",
    )
    p.add_argument("--num-workers", type=int, default=2, help="data workers of each side")
    p.add_argument(
        "--order",
        default="alternate",
        choices=("alternate", "together"),
        help="alternate: A B A B; together: both sides of each fold at the same time",
    )
    p.add_argument(
        "--nnui-args", default="", help="extra nnui-train flags, e.g. '--recompute-norm off'"
    )
    p.add_argument(
        "--raw",
        default=None,
        help="a DatasetNNN_Name raw folder: each side plans it with its own default planner",
    )
    p.add_argument("--patch", default=None, help="with --raw: e.g. 256,256 on both sides' plans")
    p.add_argument("--batch", type=int, default=None, help="with --raw: batch on both sides")
    p.add_argument(
        "--val-disable-tta", action="store_true", help="final validation without mirroring, both"
    )
    ns = p.parse_args(argv)
    override = rawmode.parse_raw_options(ns.raw, ns.patch, ns.batch)
    folds = [f.strip() for f in ns.folds.split(",") if f.strip()]
    if (
        ns.epochs < 1
        or ns.iterations < 1
        or ns.cases < 5
        or ns.repeats < 1
        or not folds
        or any(f not in "01234" or len(f) != 1 for f in folds)
        or not 0.1 <= ns.shape_scale <= 2.0
    ):
        print(
            "error: need --epochs >= 1, --iterations >= 1, --cases >= 5, --repeats >= 1, "
            "--folds among 0-4, --shape-scale in [0.1, 2]",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return AccuracyArgs(
        Path(ns.work).absolute(), ns.cases, ns.shape_scale, ns.configuration, ns.epochs,
        ns.iterations, ns.val_iterations, folds, ns.repeats, ns.num_workers, ns.order,
        shlex.split(ns.nnui_args), *override, not ns.val_disable_tta,
    )  # fmt: skip


def prepare(a: AccuracyArgs) -> tuple[Path, dict[str, str], dict]:
    """The nnU-Net venv, the raw data, both preprocessings and the shared splits."""
    raw, nnunet_pre = a.work / "raw", a.work / "nnunet_preprocessed"
    nnui_pre = a.work / "nnui_preprocessed"
    venv = ensure_nnunet_venv(a.work, BENCH_DIR / "nnunet_short_trainer.py")
    if ensure_demo_data(raw, a.cases, a.shape_scale):  # new raw data: older plans are stale
        shutil.rmtree(nnunet_pre / DATASET, ignore_errors=True)
        (nnunet_pre / f"{DATASET}.bench.json").unlink(missing_ok=True)
    roots = {"nnUNet_raw": str(raw), "nnUNet_preprocessed": str(nnunet_pre)}
    plan = nnunet_plan(venv, roots, a.as_bench_args())
    nnui_preprocess(a.as_bench_args(), raw, nnui_pre, plan)
    share_splits(nnunet_pre, nnui_pre)
    return venv, roots, plan


def train_all(a: AccuracyArgs, venv: Path, roots: dict[str, str]) -> list[FoldRun]:
    """Every (fold, repeat) by both sides: one after the other (A B A B), or with --order
    together both sides of a pair at once, so they share the same neighbours' load."""

    def one(side: str, fold: str, repeat: int) -> FoldRun:
        log.info("fold %s repeat %d: %s", fold, repeat, side)
        if side == "nnU-Net":
            run = run_nnunet_fold(a, venv, roots, fold, repeat)
        else:
            run = run_nnui_fold(a, a.work / "raw", a.work / "nnui_preprocessed", fold, repeat)
        log.info("%s", json.dumps(asdict(run)))
        return run

    runs: list[FoldRun] = []
    for fold, repeat in a.units():
        if a.order == "together":
            with ThreadPoolExecutor(len(SIDES)) as pool:
                runs += list(pool.map(one, SIDES, [fold] * 2, [repeat] * 2))
        else:  # A B A B: slow drift of the machine hits both sides alike
            runs += [one(side, fold, repeat) for side in SIDES]
    return runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # the command line in history.md
    a = parsed_or_exit_code(parse_args, argv)
    if isinstance(a, int):
        return a
    machine = machine_line()
    plan_report, prep_s = [], {}
    try:
        if a.raw:
            venv, roots, plan_report, prep_s = rawmode.prepare(
                a.work, a.raw, a.configuration, a.patch, a.batch
            )
            plan = rawmode.trained_plan(a.work, a.raw, a.configuration)
        else:
            venv, roots, plan = prepare(a)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = config_line(a, plan)
    log.info("config: %s", config)
    for line in plan_report:
        log.info("%s", line)
    runs = train_all(a, venv, roots)
    lines = plan_report + summarize(a, runs)
    if a.raw:
        by = {(r.side, r.fold, r.repeat): r for r in runs}
        lines += [*rawmode.fold_table(a.units(), by), rawmode.noise_line(a.units(), by)]
        lines += rawmode.stage_lines(prep_s, a.units(), by)
    print(f"config: {config}")
    print("\n".join(lines))
    append_results(argv, machine, config, lines, runs)
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
