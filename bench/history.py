"""A lab's history: `nnui status --json --all`, `nnui cv` and the TUI's first job rows over
many finished runs in several results trees, plus a few live runs.

It generates (once, into --work) `--trees` results trees with `--runs` finished runs in all
(nnui jobs in the registry, and a share of runs started by hand that ended unseen), each of
`--epochs` epochs with the record shapes the trainer writes (run_started, topology, four
train_loss_running and one epoch_ended per epoch, checkpoint_saved, final validation,
finished; status.json, config.json), and `--live` runs whose writer appends an epoch per
`--live-epoch-s` seconds (1: a stress rate) with four running losses in it. Then, in fresh
processes, with the summary cache deleted first (cold) and then kept (warm), A B A B:

  - `nnui status --json --all`: wall s, CPU s, peak RSS (wait4 of the child);
  - `nnui cv`: the same;
  - the TUI: seconds from the process start to the first frame with job rows (Textual's
    headless driver, `App.run_test`, in a fresh process), CPU s and peak RSS then, and the
    idle CPU share over the next --idle-s seconds.

    python bench/history.py [--work /tmp/nnui-history] [--runs 500] [--epochs 1000]
                            [--trees 3] [--live 3] [--repeats 2] [--idle-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRAINER = "nnUNetTrainer__nnUNetPlans__3d_fullres"
HAND_SHARE = 5  # one run in this many was started by hand (no registry job)


def _line(kind: str, t: float, **fields: object) -> str:
    return json.dumps({"v": 1, "t": round(t, 3), "kind": kind, **fields}) + "\n"


def run_lines(dataset: str, fold: int, epochs: int, t0: float, pid: int) -> list[str]:
    """The events of one finished 1000-epoch-style run, as the trainer writes them."""
    rng = random.Random(hash((dataset, fold)) & 0xFFFF)
    argv = ["nnui-train", dataset, "3d_fullres", str(fold), "-device", "cuda"]
    out = [
        _line(
            "run_started",
            t0,
            dataset=dataset,
            configuration="3d_fullres",
            fold=fold,
            num_epochs=epochs,
            iterations_per_epoch=250,
            world_size=1,
            launcher="single",
            host="box",
            argv=argv,
            class_names=["liver", "tumour"],
        ),
        _line(
            "topology",
            t0 + 1,
            ranks=[
                {
                    "pid": pid,
                    "global_rank": 0,
                    "local_rank": 0,
                    "host": "box",
                    "device": "cuda:0",
                    "batch_size": 2,
                    "sigusr1_handler": True,
                }
            ],
        ),
    ]
    t = t0 + 2
    for epoch in range(epochs):
        for point in range(1, 5):
            out.append(_line("train_loss_running", t + point * 20, epoch=epoch,
                             iteration=point * 62, loss=round(-0.3 - rng.random() * 0.1, 5),
                             num_iterations=62))  # fmt: skip
        t += 90
        dice = [round(0.5 + rng.random() * 0.4, 4), round(0.3 + rng.random() * 0.4, 4)]
        mean = round(sum(dice) / 2, 4)
        out.append(
            _line(
                "epoch_ended",
                t,
                epoch=epoch,
                train_loss=-0.4 - rng.random() / 10,
                val_loss=-0.38 - rng.random() / 10,
                dice_per_class=dice,
                mean_fg_dice=mean,
                ema_fg_dice=mean,
                lr=round(0.01 * (1 - epoch / epochs) ** 0.9, 6),
                epoch_time_s=90.1,
                iterations_per_s=2.78,
                data_wait_s=0.4,
                data_wait_share=0.005,
            )
        )
        if epoch % 50 == 49:
            out.append(_line("checkpoint_saved", t + 1, checkpoint="latest", epoch=epoch,
                             path="checkpoint_latest.safetensors", write_time_s=0.8))  # fmt: skip
    out += [_line("checkpoint_saved", t + 2, checkpoint="final", epoch=epochs - 1),
            _line("validation_started", t + 3, epoch=epochs - 1, num_cases=20),
            *(_line("validation_case", t + 4 + i, index=i + 1, num_cases=20) for i in range(20)),
            _line("validation_finished", t + 30, mean_fg_dice=0.71, dice_per_class=[0.8, 0.62],
                  class_names=["liver", "tumour"], num_cases=20),
            _line("finished", t + 31, epoch=epochs - 1)]  # fmt: skip
    return out


def generate(work: Path, runs: int, epochs: int, trees: int) -> None:
    """The history under work/ (skipped when work/.done says the same sizes)."""
    stamp = work / ".done"
    wanted = f"{runs} {epochs} {trees}"
    if stamp.is_file() and stamp.read_text() == wanted:
        return
    shutil.rmtree(work, ignore_errors=True)
    from app.services.jobs.registry import Job, ProcessRecord, Registry

    registry = Registry(work / "state")
    t0 = time.time() - 400 * 86400
    for index in range(runs):
        tree = work / f"results_{index % trees}"
        dataset = f"Dataset{100 + index // (5 * trees):03d}_Lab"
        fold = (index // trees) % 5
        run_dir = tree / dataset / TRAINER / f"fold_{fold}"
        if (run_dir / "events.jsonl").exists():
            continue
        run_dir.mkdir(parents=True)
        start = t0 + index * 600
        lines = run_lines(dataset, fold, epochs, start, 10000 + index)
        (run_dir / "events.jsonl").write_text("".join(lines))
        end = json.loads(lines[-1])["t"]
        (run_dir / "status.json").write_text(json.dumps({
            "state": "finished", "epoch": epochs, "num_epochs": epochs, "pids": [],
            "last_checkpoint": "checkpoint_final.safetensors"}))  # fmt: skip
        (run_dir / "config.json").write_text(json.dumps({"dataset_name": dataset, "fold": fold}))
        if index % HAND_SHARE == 0:
            continue  # started by hand: no registry job, found under its tree
        registry.add(Job(
            job_id=f"0101-000000-f{fold}-{index:04x}", created_at=start - 1, dataset=dataset,
            configuration="3d_fullres", fold=str(fold), mode="single", device="cuda",
            gpus=[str(index % 4)], simulated=False, argv=["nnui-train"],
            env={"nnUNet_results": str(tree)}, run_dir=str(run_dir),
            console_path=str(run_dir / "console.log"),
            processes=[ProcessRecord(10000 + index, start, "trainer", None, 1)], exit_code=0,
            ended_at=end + 1))  # fmt: skip
    stamp.write_text(wanted)


LIVE_WRITER = """
import json, sys, time
path, epochs, epoch_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def line(kind, **f):
    return json.dumps({"v": 1, "t": time.time(), "kind": kind, **f}) + "\\n"
with open(path, "a") as out:
    out.write(line("run_started", num_epochs=epochs)); out.flush()
    for epoch in range(epochs):
        for point in range(1, 5):  # the trainer's four running losses per epoch
            time.sleep(epoch_s / 4)
            out.write(line("train_loss_running", epoch=epoch, iteration=point * 62,
                           num_iterations=250, loss=-0.3)); out.flush()
        out.write(line("epoch_ended", epoch=epoch, train_loss=-0.4, val_loss=-0.3,
                       mean_fg_dice=0.6, ema_fg_dice=0.6, epoch_time_s=epoch_s)); out.flush()
"""


def start_live(work: Path, count: int, epoch_s: float) -> list[subprocess.Popen]:
    """Writers appending an epoch per `epoch_s` seconds (and four running losses in it) to
    fresh run folders of the first tree."""
    procs = []
    for index in range(count):
        run_dir = work / "results_0" / "Dataset999_Live" / TRAINER / f"fold_{index}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        procs.append(subprocess.Popen([sys.executable, "-c", LIVE_WRITER,
                                       str(run_dir / "events.jsonl"), "100000",
                                       str(epoch_s)]))  # fmt: skip
    return procs


def _commit(code: Path) -> str:
    done = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or "not a git checkout"


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.partition(':')[2].strip()} x {os.cpu_count()}"
    return "?"


def measured(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """(wall s, CPU s, peak RSS MB, stdout) of one fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, cwd=env["PYTHONPATH"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out


TUI_PROBE = """
import asyncio, resource, sys, time
t0 = time.perf_counter()
from pathlib import Path
from app.screens.seam import TuiConfig
from app.tui import make_app
from app.widgets.job_table import JobTable
from trainer.schema.tree import Roots
work, idle_s = Path(sys.argv[1]), float(sys.argv[2])
tree = work / "results_0"
app = make_app(TuiConfig(simulate_gpus=4, roots=Roots(tree, tree, tree), state_dir=work / "state",
                         cache_dir=work / "gpu-cache"))
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
def rows():
    try:
        return app.screen.query_one(JobTable).row_count
    except Exception:  # the dashboard is not composed yet
        return 0
async def main():
    async with app.run_test(size=(160, 48)) as pilot:
        while rows() == 0:
            await pilot.pause(0.01)
        first, first_cpu = time.perf_counter() - t0, cpu()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        await pilot.pause(2)  # the first background reads settle
        c0, w0 = cpu(), time.perf_counter()
        await pilot.pause(idle_s)
        idle = (cpu() - c0) / (time.perf_counter() - w0)
        print(f"{first:.3f} {first_cpu:.3f} {rss:.1f} {idle:.4f}")
asyncio.run(main())
"""


def tui_probe(work: Path, env: dict[str, str], idle_s: float) -> tuple[float, ...]:
    """(first rows s, CPU s until then, RSS MB then, idle CPU share, peak RSS MB)."""
    _, _, peak, out = measured([sys.executable, "-c", TUI_PROBE, str(work), str(idle_s)], env)
    if len(out.split()) != 4:
        raise SystemExit(f"error: the TUI probe printed {out!r}; run it alone to see why")
    first, first_cpu, rss, idle = (float(v) for v in out.split())
    return first, first_cpu, rss, idle, peak


def cache_dir(work: Path) -> Path:
    return work / "state" / "cache"


def one_round(work: Path, env: dict[str, str], args: argparse.Namespace, label: str) -> None:
    """One measurement of each command; a cold round deletes the cache before each."""
    nnui = [sys.executable, "-m", "app.main"]
    tree = str(work / "results_0")
    cold = label.startswith("cold")
    if "status" in args.only:
        if cold:
            shutil.rmtree(cache_dir(work), ignore_errors=True)
        wall, cpu, peak, out = measured(
            [*nnui, "status", "--json", "--all", "--results", tree], env
        )
        rows = len(json.loads(out or "[]"))
        print(f"{label:5s} status --json --all  wall {wall:6.2f} s  CPU {cpu:6.2f} s"
              f"  peak RSS {peak:6.1f} MB  ({rows} rows)", flush=True)  # fmt: skip
    if "cv" in args.only:
        if cold:
            shutil.rmtree(cache_dir(work), ignore_errors=True)
        wall, cpu, peak, _ = measured([*nnui, "cv", "--results", tree], env)
        print(f"{label:5s} cv                   wall {wall:6.2f} s  CPU {cpu:6.2f} s"
              f"  peak RSS {peak:6.1f} MB", flush=True)  # fmt: skip
    if "tui" in args.only:
        if cold:
            shutil.rmtree(cache_dir(work), ignore_errors=True)
        first, first_cpu, rss, idle, peak = tui_probe(work, env, args.idle_s)
        print(f"{label:5s} TUI first job rows   {first:6.2f} s  CPU {first_cpu:6.2f} s  RSS then"
              f" {rss:6.1f} MB  peak {peak:6.1f} MB  idle {idle:.1%} of a core",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/nnui-history"))
    parser.add_argument("--runs", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--trees", type=int, default=3)
    parser.add_argument("--live", type=int, default=3)
    parser.add_argument("--live-epoch-s", type=float, default=1.0,
                        help="seconds per live epoch: 1 = a stress rate; a GPU epoch of "
                        "nnU-Net's default 250 iterations takes 30-200 s")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--generate-only", action="store_true")
    parser.add_argument("--only", default="status,cv,tui", help="what to measure (a list)")
    parser.add_argument("--warm-only", action="store_true", help="keep the cache (no cold rounds)")
    parser.add_argument(
        "--code", type=Path, default=ROOT, help="the nnui checkout measured (e.g. an older one)"
    )
    args = parser.parse_args()
    if args.runs < 1 and args.live < 1:  # the TUI probe waits for a first job row
        parser.error("nothing to measure: give --runs or --live of at least 1")
    t0 = time.perf_counter()
    generate(args.work, args.runs, args.epochs, args.trees)
    size = sum(p.stat().st_size for p in args.work.glob("results_*/*/*/*/events.jsonl"))
    print(
        f"history: {args.runs} runs x {args.epochs} epochs in {args.trees} trees, "
        f"{size / 1e6:.0f} MB of events.jsonl ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    if args.generate_only:
        return
    code = args.code.resolve()
    env = {**os.environ, "NNUI_STATE_DIR": str(args.work / "state"), "PYTHONPATH": str(code)}
    print(f"code: {code} ({_commit(code)}); CPU: {_cpu_model()}; load: {os.getloadavg()}")
    live = start_live(args.work, args.live, args.live_epoch_s)
    try:
        for repeat in range(args.repeats):
            if not args.warm_only:
                one_round(args.work, env, args, f"cold{repeat + 1}")
            one_round(args.work, env, args, f"warm{repeat + 1}")
    finally:
        for proc in live:  # our own writers, by pid
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    main()
