"""nnui-preprocess vs nnUNetv2_plan_and_preprocess (2.8.1) on the same raw data.

    python bench/preprocess.py [--work DIR] [--cases 20] [--repeats 2] [-np 2]
                               [-c 2d 3d_fullres] [--no-nnunet-verify]

Both sides fingerprint, plan and preprocess the same demo cases for the same configurations
with the same process count (nnU-Net: -np N per configuration and -npfp N; nnui: -np N),
each into a fresh temporary preprocessed folder under --work (never a user's tree), runs
alternated A B A B. nnU-Net runs with --verify_dataset_integrity by default because nnui
always reads and checks every case before planning (--no-nnunet-verify leaves it out).
Figures: wall time, CPU-s of the whole process tree (wait4's rusage: every descendant that
was reaped), peak memory (RSS and PSS summed over the tree). Appended to bench/history.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(REPO))

from _common import (  # noqa: E402
    machine_line,
    parsed_or_exit_code,
    ratio,
    run_tree,
    side_ratio_lines,
)
from compare_nnunet import (  # noqa: E402
    DATASET,
    DATASET_ID,
    ensure_demo_data,
    ensure_nnunet_venv,
)

log = logging.getLogger("bench")
CONFIGURATIONS = ("2d", "3d_fullres")
WALL_GOAL = 0.5  # issue 15: nnui at most half of nnU-Net's wall time


@dataclass(frozen=True)
class PrepArgs:
    work: Path
    cases: int
    repeats: int
    num_processes: int
    configurations: tuple[str, ...]
    nnunet_verify: bool


@dataclass
class PrepFigures:
    side: str
    repeat: int
    exit_code: int
    wall_s: float
    cpu_s: float
    sampled_cpu_s: float
    peak_rss_bytes: int
    peak_pss_bytes: int
    num_cases_written: int  # per configuration, checked after the run


def _side_argv(side: str, a: PrepArgs, venv: Path) -> list[str]:
    n = str(a.num_processes)
    if side == "nnui":
        # fmt: off
        return [sys.executable, "-m", "trainer.planning.preprocess", str(DATASET_ID),
                "-c", *a.configurations, "-np", n]
        # fmt: on
    argv = [str(venv / "bin" / "nnUNetv2_plan_and_preprocess"), "-d", str(DATASET_ID)]
    argv += ["-c", *a.configurations, "-np", *[n] * len(a.configurations), "-npfp", n]
    return [*argv, "--verify_dataset_integrity"] if a.nnunet_verify else argv


def _cases_written(side: str, pre: Path, configurations: tuple[str, ...]) -> int:
    """The fewest images written over the configurations (0 when one is missing)."""
    prefix = "nnuiPlans" if side == "nnui" else "nnUNetPlans"
    counts = [
        sum(1 for p in (pre / DATASET / f"{prefix}_{c}").glob("*.b2nd") if "_seg" not in p.name)
        for c in configurations
    ]
    return min(counts, default=0)


def run_side(side: str, a: PrepArgs, venv: Path, repeat: int) -> PrepFigures:
    """One plan + preprocess of one side into its own temporary preprocessed folder."""
    tag = "nnui" if side == "nnui" else "nnunet"
    pre = Path(tempfile.mkdtemp(prefix=f"{tag}_pre_", dir=a.work))
    env = dict(
        os.environ,
        nnUNet_raw=str(a.work / "raw"),
        nnUNet_preprocessed=str(pre),
        nnUNet_results=str(a.work / "results_unused"),
        PYTHONPATH=str(REPO),
    )
    try:
        run, sampler = run_tree(
            _side_argv(side, a, venv), a.work / "logs" / f"{tag}_prep{repeat}.log", env, REPO
        )
        sampler.dump(a.work / "logs" / f"{tag}_prep{repeat}_sampler.json")
        written = _cases_written(side, pre, a.configurations)
    finally:
        shutil.rmtree(pre, ignore_errors=True)
    exit_code = run.exit_code if run.exit_code != 0 or written == a.cases else 3
    return PrepFigures(
        side,
        repeat,
        exit_code,
        run.wall_s,
        run.cpu_s,
        run.sampled_cpu_s,
        run.peak_rss_bytes,
        run.peak_pss_bytes,
        written,
    )


ROWS = [
    ("wall time", "wall_s", "{:.1f} s"),
    ("CPU-s (process tree)", "cpu_s", "{:.1f} CPU-s"),
    ("peak-memory", "peak_rss_bytes", None),
    ("peak-memory (PSS)", "peak_pss_bytes", None),
]


def append_results(a: PrepArgs, argv: list[str], machine: str, runs, lines) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    verify = "with" if a.nnunet_verify else "without"
    text = [
        f"\n## preprocess {stamp}\n",
        f"- machine: {machine}",
        f"- command: `python bench/preprocess.py {' '.join(argv)}`",
        f"- work: {a.cases} demo cases, configurations {' '.join(a.configurations)}, "
        f"{a.num_processes} processes each side, nnU-Net {verify} --verify_dataset_integrity",
        "",
        "```",
        *lines,
        "```",
        "",
        "raw runs:",
        "",
        "```",
        *[json.dumps(asdict(r)) for r in runs],
        "```",
        "",
    ]
    with open(BENCH_DIR / "history.md", "a") as handle:
        handle.write("\n".join(text))


def parse_args(argv: list[str]) -> PrepArgs:
    p = argparse.ArgumentParser(prog="preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/nnui-bench", help="venv and raw data (reused)")
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("-np", dest="num_processes", type=int, default=2, help="both sides")
    p.add_argument("-c", nargs="+", default=list(CONFIGURATIONS), choices=CONFIGURATIONS)
    p.add_argument("--no-nnunet-verify", action="store_true")
    ns = p.parse_args(argv)
    if ns.cases < 5 or ns.repeats < 1 or ns.num_processes < 1:
        print("error: need --cases >= 5, --repeats >= 1, -np >= 1", file=sys.stderr)
        raise SystemExit(2)
    return PrepArgs(
        Path(ns.work).absolute(),
        ns.cases,
        ns.repeats,
        ns.num_processes,
        tuple(ns.c),
        not ns.no_nnunet_verify,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)  # the command line in history.md
    a = parsed_or_exit_code(parse_args, argv)
    if isinstance(a, int):
        return a
    machine = machine_line()
    try:
        venv = ensure_nnunet_venv(a.work, BENCH_DIR / "nnunet_short_trainer.py")
        ensure_demo_data(a.work / "raw", a.cases)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs: list[PrepFigures] = []
    for repeat in range(a.repeats):
        for side in ("nnU-Net", "nnui"):  # A B A B: slow drift hits both sides alike
            log.info("run %d: %s", repeat, side)
            runs.append(run_side(side, a, venv, repeat))
            log.info("%s", json.dumps(asdict(runs[-1])))
    lines, ratios = side_ratio_lines(runs, ROWS)
    wall = ratios["wall time"]
    lines.append(
        f"goal wall time ratio <= {WALL_GOAL}: {'met' if wall <= WALL_GOAL else 'NOT met'}"
    )
    per_pair = [
        ratio(n.wall_s, u.wall_s)
        for u, n in zip(runs[0::2], runs[1::2], strict=True)
        if u.exit_code == 0 and n.exit_code == 0
    ]
    lines.append("wall time ratio per A B pair: " + " ".join(f"{x:.2f}" for x in per_pair))
    print("\n".join(lines))
    append_results(a, argv, machine, runs, lines)
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
