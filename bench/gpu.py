"""GPU readiness in one command: is nnui right on this GPU machine?

    python bench/gpu.py --check [--work DIR] [--epochs 3] [--iterations 40]
                        [--configuration 3d_fullres] [--device cuda] [--no-results]

Runs, in this order, each with a time limit so that the whole stays under 10 minutes:

1. the `gpu`-marked tests (pytest -m gpu);
2. a short real training of the demo dataset on GPU 0 (`python -m trainer`);
3. the same on GPUs 0 and 1 under torchrun with NCCL (needs 2 GPUs, else "skip");
4. the stop protocol under torchrun with NCCL: SIGUSR1 to every rank after the first
   epoch; pass = all ranks exit 0 after a checkpoint, status "stopped" (needs 2 GPUs);
5. prediction: nnui-predict with check 2's trained fold over 4 held-out demo cases on GPU 0
   (cases/s over the whole run, GPU busy % while it ran); and, where nnunetv2 is installed,
   one BraTS-sized four-channel case by nnui's engine and by nnUNetv2_predict with the same
   weights on the same GPU, with and without mirroring (bench/predict_whole.py --device
   cuda: nnU-Net's 3d_fullres plan), each with cases/s and GPU busy % (else "skip").

and prints one table: it/s (median over the epochs after the first), GPU busy % (mean NVML
utilisation of the run's GPUs while training iterations run), data wait % (share of the
training time the step loop waited for a batch), peak GPU memory of the run's processes
(NVML), wall time and pass/fail per check; the table is appended to bench/history.md
(not with --no-results). Exit 0 when nothing failed. Without a GPU it says so in one line
and exits 2. `--device cpu` runs the same checks on the CPU (gloo, no NVML figures, no
gpu-marked tests) to check the script itself.

Plans: the demo is preprocessed with the planner and plans named below (PLANNER, PLANS),
passed explicitly; on a GPU these are the default ones. On the lent H200 machine the image
has torch but not blosc2, nibabel or pytest (the gpu-marked tests; textual for the app's):
carry their wheels (see the device notes) and run
`PYTHONPATH=.:/tmp/site python3 bench/gpu.py --check`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO))

DATASET = "Dataset900_NnuiDemo"
# The demo's preprocessing, by name: nnU-Net's default planner and nnui's plans file for it.
# (CPU-sized plans are a named choice where they exist: -pl nnuiCPUPlanner, -p nnuiCPUPlans.)
PLANNER, PLANS = "ExperimentPlanner", "nnuiPlans"
TRAINER = "nnuiTrainer"
# Each check's own limit: typically the whole stays under 10 min (limits add up to more).
LIMITS_S = {"tests": 120, "train": 90, "stop": 90, "predict": 120}
NO_GPU = "error: no CUDA GPU present (torch sees none): the GPU check needs one; " \
    "`--device cpu` checks the script itself"  # fmt: skip


@dataclass
class Row:
    check: str
    result: str  # pass | FAIL | skip
    wall_s: float = float("nan")
    it_per_s: float = float("nan")
    busy_percent: float = float("nan")
    data_wait_percent: float = float("nan")
    peak_gib: float = float("nan")
    note: str = ""


class GpuSampler:
    """NVML utilisation of `devices` and the GPU memory of a process tree, every 0.1 s."""

    def __init__(self, root_pid: int, devices: list[int], enabled: bool) -> None:
        self.root_pid, self.devices, self.enabled = root_pid, devices, enabled
        self.samples: list[tuple[float, float, int]] = []  # (t, mean util %, tree bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        import psutil
        import pynvml  # nvidia-ml-py

        try:
            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.devices]
        except pynvml.NVMLError as exc:
            print(f"NVML not available ({exc}); GPU figures are n/a", file=sys.stderr)
            return
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.root_pid)
                tree = {root.pid, *(c.pid for c in root.children(recursive=True))}
            except psutil.Error:
                tree = set()
            utils = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
            used = sum(
                p.usedGpuMemory or 0
                for h in handles
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                if p.pid in tree
            )
            self.samples.append((time.time(), statistics.fmean(utils), used))
            self._stop.wait(0.1)

    def busy_percent(self, windows: list[tuple[float, float]]) -> float:
        inside = [u for t, u, _ in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(inside) if inside else float("nan")

    def peak_gib(self) -> float:
        return (
            max((m for _, _, m in self.samples), default=0) / 2**30
            if self.samples
            else float("nan")
        )


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def prepare(work: Path, configuration: str) -> Path:
    """The demo dataset, preprocessed with PLANNER into PLANS (once per --work)."""
    raw, pre = work / "raw", work / "preprocessed"
    if not (pre / DATASET / f"{PLANS}.json").is_file():
        from trainer.demo import make_demo_dataset

        make_demo_dataset(raw, 20, seed=0)
        argv = [sys.executable, "-m", "trainer.planning.preprocess", "900", "-c", configuration,
                "-pl", PLANNER, "--raw", str(raw), "--preprocessed", str(pre)]  # fmt: skip
        subprocess.run(argv, check=True, cwd=REPO)
    return pre


def train_argv(args: argparse.Namespace, pre: Path, results: Path, gpus: int, epochs: int) -> list:
    launch = [sys.executable]
    if gpus > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    return [*launch, "-m", "trainer", "900", args.configuration, "0", "-device", args.device,
            "-p", PLANS, "--epochs", str(epochs), "--iterations-per-epoch", str(args.iterations),
            "--val-iterations", "3", "--preprocessed", str(pre), "--raw", str(pre.parent / "raw"),
            "--results", str(results)]  # fmt: skip


def run_folder(results: Path, configuration: str) -> Path:
    return results / DATASET / f"{TRAINER}__{PLANS}__{configuration}" / "fold_0"


def events_of(folder: Path) -> list[dict]:
    try:
        lines = (folder / "events.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(x) for x in lines if x.strip()]


def figures(row: Row, events: list[dict], iterations: int, sampler: GpuSampler) -> Row:
    later = [e for e in events if e["kind"] == "epoch_ended"][1:]  # the first one warms up
    if not later:
        return row
    train_s = [iterations / e["iterations_per_s"] for e in later]
    windows = [(e["t"] - e["epoch_time_s"], e["t"] - e["epoch_time_s"] + s)
               for e, s in zip(later, train_s, strict=True)]  # fmt: skip
    row.it_per_s = statistics.median(e["iterations_per_s"] for e in later)
    row.data_wait_percent = 100 * sum(e["data_wait_s"] for e in later) / sum(train_s)
    row.busy_percent = sampler.busy_percent(windows)
    row.peak_gib = sampler.peak_gib()
    return row


def _env(gpus: int) -> dict:
    visible = ",".join(str(i) for i in range(gpus))
    return dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=visible)


def check_training(args: argparse.Namespace, pre: Path, gpus: int) -> Row:
    name = f"train {gpus} GPU" + (f" (torchrun, {_backend(args)})" if gpus > 1 else "")
    results = args.work / f"results_{gpus}gpu"
    argv = train_argv(args, pre, results, gpus, args.epochs)
    started = time.time()
    with open(args.work / f"train_{gpus}gpu.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=_env(gpus), start_new_session=True)  # fmt: skip
        with GpuSampler(proc.pid, list(range(gpus)), args.device == "cuda") as sampler:
            code = _wait(proc, LIMITS_S["train"])
    row = Row(name, "pass" if code == 0 else "FAIL", time.time() - started)
    row.note = "" if code == 0 else f"exit {code}, see {out.name}"
    return figures(row, events_of(run_folder(results, args.configuration)), args.iterations,
                   sampler)  # fmt: skip


def _wait(proc: subprocess.Popen, limit_s: float) -> int:
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the whole run
        proc.wait()
        return -signal.SIGKILL


def check_stop(args: argparse.Namespace, pre: Path) -> Row:
    """nnui's stop under torchrun: SIGUSR1 to every rank once an epoch ended."""
    results = args.work / "results_stop"
    argv = train_argv(args, pre, results, 2, 1000)
    folder = run_folder(results, args.configuration)
    started = time.time()
    with open(args.work / "stop.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=_env(2), start_new_session=True)  # fmt: skip
        ranks = _ranks_after_first_epoch(proc, folder, started + LIMITS_S["stop"])
        for pid in ranks:
            os.kill(pid, signal.SIGUSR1)
        code = _wait(proc, max(1.0, started + LIMITS_S["stop"] - time.time()))
    status = _status(folder)
    ok = bool(ranks) and code == 0 and status == "stopped"
    note = "" if ok else f"ranks {ranks or 'never seen'}, exit {code}, status {status}"
    name = f"stop (torchrun, {_backend(args)})"
    return Row(name, "pass" if ok else "FAIL", time.time() - started, note=note)


def check_predict(args: argparse.Namespace, pre: Path, trained: Row) -> list[Row]:
    rows = [_predict_demo(args, pre)] if trained.result == "pass" else [
        Row("predict nnui (demo)", "skip", note="no trained fold (check 2 failed)")]  # fmt: skip
    try:
        import nnunetv2  # noqa: F401 - only whether it is installed
    except ImportError:
        note = "nnunetv2 not installed: nnui vs nnU-Net on one case skipped"
        return [*rows, Row("predict nnui vs nnU-Net", "skip", note=note)]
    if args.device != "cuda":  # a BraTS-sized case takes minutes on a CPU
        return [*rows, Row("predict nnui vs nnU-Net", "skip", note="on a GPU only")]
    return [*rows, *_predict_beside_nnunet(args)]


def _timed_on_gpu(
    args: argparse.Namespace, argv: list, log: Path, env: dict | None = None
) -> tuple[int, float, float]:
    """(exit code, wall s, mean GPU 0 busy % over the run) of one prediction."""
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env or _env(1), start_new_session=True)  # fmt: skip
        with GpuSampler(proc.pid, [0], args.device == "cuda") as sampler:
            code = _wait(proc, LIMITS_S["predict"])
    ended = time.time()
    return code, ended - started, sampler.busy_percent([(started, ended)])


def _predict_demo(args: argparse.Namespace, pre: Path) -> Row:
    from trainer.demo import make_demo_dataset

    held_out = args.work / "held_out"
    images = held_out / DATASET / "imagesTs"
    if not images.is_dir():
        make_demo_dataset(held_out, 20, 0, num_test_cases=4)
    out = args.work / "predict_nnui"
    argv = [sys.executable, "-m", "trainer.predict", "-i", str(images), "-o", str(out),
            "-d", "900", "-c", args.configuration, "-f", "0", "-tr", TRAINER, "-p", PLANS,
            "-device", args.device, "--preprocessed", str(pre),
            "--results", str(args.work / "results_1gpu")]  # fmt: skip
    code, wall_s, busy = _timed_on_gpu(args, argv, args.work / "predict_nnui.log")
    cases = len(list(out.glob("*.nii.gz"))) if out.is_dir() else 0
    ok = code == 0 and cases == 4
    note = f"{cases / wall_s:.2f} cases/s, whole run"
    return Row("predict nnui (demo, 4 cases)", "pass" if ok else "FAIL", wall_s,
               busy_percent=busy, note=note)  # fmt: skip


def _predict_beside_nnunet(args: argparse.Namespace) -> list[Row]:
    """One BraTS-sized case, both predictors, same weights (bench/predict_whole.py)."""
    sys.path.insert(0, str(BENCH_DIR))
    import predict_whole

    case = predict_whole.CASES["brats"]
    work = args.work / "predict_brats"
    paths = predict_whole.setup(case, work, 1)
    opts = argparse.Namespace(work=work, device=args.device, npp=3, nps=3, threads=4)
    rows = []
    for tta in (False, True):
        for side in ("nnU-Net", "nnui"):
            out = work / "out" / f"{side}_{tta}"
            shutil.rmtree(out, ignore_errors=True)
            argv = predict_whole.side_argv(side, case, paths, opts, tta, out)
            env = dict(paths["env"], PYTHONPATH=str(REPO), CUDA_DEVICE_ORDER="PCI_BUS_ID",
                       CUDA_VISIBLE_DEVICES="0")  # fmt: skip
            code, wall_s, busy = _timed_on_gpu(args, argv, work / f"{side}_{tta}.log", env)
            done = len(list(out.glob("*.nii.gz"))) if out.is_dir() else 0
            rows.append(Row(f"predict {side} (BraTS-like, TTA {'on' if tta else 'off'})",
                            "pass" if code == 0 and done == 1 else "FAIL", wall_s,
                            busy_percent=busy, note=f"{done / wall_s:.3f} cases/s"))  # fmt: skip
    return rows


def _backend(args: argparse.Namespace) -> str:
    return "NCCL" if args.device == "cuda" else "gloo"


def _ranks_after_first_epoch(proc: subprocess.Popen, folder: Path, deadline: float) -> list:
    while time.time() < deadline and proc.poll() is None:
        events = events_of(folder)
        topology = [e for e in events if e["kind"] == "topology"]
        if topology and any(e["kind"] == "epoch_ended" for e in events):
            return [r["pid"] for r in topology[-1]["ranks"]]
        time.sleep(0.2)
    return []


def _status(folder: Path) -> str | None:
    try:
        return json.loads((folder / "status.json").read_text()).get("state")
    except (OSError, ValueError):
        return None


def check_gpu_tests(args: argparse.Namespace) -> Row:
    if args.device != "cuda":
        return Row("gpu-marked tests", "skip", note="--device cpu")
    started = time.time()
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]
    with open(args.work / "gpu_tests.log", "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        code = _wait(proc, LIMITS_S["tests"])
    tail = (args.work / "gpu_tests.log").read_text().strip().splitlines()[-1:] or [""]
    return Row("gpu-marked tests", "pass" if code == 0 else "FAIL", time.time() - started,
               note=tail[0][:60])  # fmt: skip


def table(rows: list[Row]) -> list[str]:
    def num(value: float, fmt: str) -> str:
        return "n/a" if value != value else format(value, fmt)  # NaN: not measured

    head = f"{'check':<30}{'result':<8}{'it/s':>8}{'GPU busy %':>12}{'data wait %':>13}" \
        f"{'peak GiB':>10}{'wall s':>8}  note"  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.check:<30}{r.result:<8}{num(r.it_per_s, '.2f'):>8}{num(r.busy_percent, '.0f'):>12}"
            f"{num(r.data_wait_percent, '.1f'):>13}{num(r.peak_gib, '.2f'):>10}"
            f"{num(r.wall_s, '.0f'):>8}  {r.note}"
        )
    return lines


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", required=True, help="run the checks")
    p.add_argument("--work", default="/tmp/nnui-gpu", help="data and runs (reused)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--iterations", type=int, default=40, help="iterations per epoch")
    p.add_argument("--configuration", default="3d_fullres", choices=("2d", "3d_fullres"))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--no-results", action="store_true", help="do not append to history.md")
    args = p.parse_args(argv)
    args.work = Path(args.work).absolute()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.epochs < 2 or args.iterations < 1:
        print("error: need --epochs >= 2 and --iterations >= 1", file=sys.stderr)
        return 2
    gpus = gpu_count() if args.device == "cuda" else 2
    if gpus == 0:
        print(NO_GPU, file=sys.stderr)
        return 2
    started = time.time()
    args.work.mkdir(parents=True, exist_ok=True)
    pre = prepare(args.work, args.configuration)
    two = "needs 2 GPUs, this machine has 1"
    rows = [
        check_gpu_tests(args),
        check_training(args, pre, 1),
        check_training(args, pre, 2) if gpus >= 2 else Row("train 2 GPU", "skip", note=two),
        check_stop(args, pre) if gpus >= 2 else Row("stop (torchrun, NCCL)", "skip", note=two),
    ]
    rows += check_predict(args, pre, rows[1])
    lines = [f"{_machine(args)}; {args.configuration} demo, {args.epochs} epochs x "
             f"{args.iterations} iterations, plans {PLANS}; total {time.time() - started:.0f} s",
             *table(rows)]  # fmt: skip
    print("\n".join(lines))
    if not args.no_results:
        _record(lines, argv)
    return 0 if all(r.result != "FAIL" for r in rows) else 1


def _machine(args: argparse.Namespace) -> str:
    if args.device != "cuda":
        return "gpu: none (--device cpu: the script's own check)"
    import torch

    return f"gpu: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def _record(lines: list[str], argv: list[str] | None) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    command = " ".join(argv if argv is not None else sys.argv[1:])
    text = [f"\n## gpu check {stamp}\n", f"- command: `python bench/gpu.py {command}`", "",
            "```", *lines, "```", ""]  # fmt: skip
    with open(BENCH_DIR / "history.md", "a") as handle:
        handle.write("\n".join(text))


if __name__ == "__main__":
    raise SystemExit(main())
