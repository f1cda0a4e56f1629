"""nnui TUI benchmark: start-up to first frame, CPU use while 8 jobs train (one epoch per 30 s
each, the issue's realistic rate; --epoch-s 0.5 is a stress test),
key-to-screen and event-to-screen latency, resident memory.

The jobs are real processes (tests/fake_trainer.py through the launcher, supervisors
included) on 8 simulated GPUs; the app runs headless in this process (Textual's test
driver: it composes every frame but writes no terminal output, so a real terminal costs
somewhat more). Every process started is ended by pid.

    python bench/tui.py [--seconds 60] [--jobs 8] [--epoch-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROBE_CODE = """
import time, asyncio
t0 = time.perf_counter()
from app.tui import TuiConfig, make_app
from trainer.schema import Roots
from pathlib import Path
import sys
d = Path(sys.argv[1])
app = make_app(TuiConfig(simulate_gpus=8, roots=Roots(d, d, d), state_dir=d / "state"))
async def main():
    async with app.run_test(size=(160, 48)) as pilot:
        first = time.perf_counter() - t0
        first_cpu = time.process_time()  # load-independent: CPU spent until the first frame
        while app.num_jobs_messages == 0 or app.num_machine_messages == 0:
            await pilot.pause(0.005)
        await pilot.pause(0)
        print(f"{first:.3f} {time.perf_counter() - t0:.3f} {first_cpu:.3f}")
asyncio.run(main())
"""


def startup_s(work: Path) -> tuple[float, float, float, float]:
    """Seconds: whole process until the first frame with data; in-process until the first
    frame; in-process until the first frame with data; CPU time until the first frame."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE_CODE, str(work)],
        capture_output=True, text=True, cwd=ROOT, check=True, timeout=60,
    )  # fmt: skip
    first_s, data_s, cpu_first_s = (float(v) for v in out.stdout.strip().splitlines()[-1].split())
    return time.perf_counter() - t0, first_s, data_s, cpu_first_s


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_jobs(roots, state: Path, num_jobs: int, epoch_s: float) -> list[str]:
    from app.services.jobs.registry import Registry
    from app.services.launch import launcher
    from app.services.launch import request as launch_request

    registry = Registry(state)
    ids = []
    configurations = ["3d_fullres", "2d"]
    for i in range(num_jobs):
        request = launch_request.LaunchRequest(
            dataset="Dataset900_Bench", configuration=configurations[i % 2],
            folds=[str(i // 2 % 5)], gpus=[str(i % 8)], mode="per_gpu", device="cpu",
            trainer_args=["--epochs", "100000", "--epoch-time", str(epoch_s)], simulated=True,
        )  # fmt: skip
        plans, problems = launcher.plan_launch(request, roots, 2)
        assert not problems, problems
        ids += [launcher.start(plan, registry).job_id for plan in plans]
    return ids


def add_probe_job(roots, state: Path) -> Path:
    """A job whose events this benchmark writes itself (to time event -> screen)."""
    from app.services.jobs.registry import Job, ProcessRecord, Registry
    from app.services.machine.procs import process_identity

    folder = roots.results / "probe"
    folder.mkdir(parents=True)
    ticks, created = process_identity(os.getpid())
    Registry(state).add(
        Job(
            job_id="probe", created_at=created, dataset="Dataset900_Bench",
            configuration="probe", fold="0", mode="single", device="cpu", gpus=[],
            simulated=True, argv=[], env={}, run_dir=str(folder),
            console_path=str(folder / "console.log"),
            processes=[ProcessRecord(os.getpid(), created, "trainer", None, ticks)],
        )
    )  # fmt: skip
    from trainer.schema.events import Kind, encode_event

    events = folder / "events.jsonl"
    events.write_text(encode_event(Kind.RUN_STARTED, num_epochs=100, fold="0", world_size=1))
    return events


def end_job_processes(state_dir: Path) -> None:
    """SIGKILL every live process of every job in this registry: the recorded pids whose
    command line or environment names the job, and their descendants. (By pid only; this
    does not rely on create_time, which drifts on VMs whose clock is adjusted.)"""
    import psutil

    from app.services.jobs.registry import Registry

    for job in Registry(state_dir).list():
        doomed: list[psutil.Process] = []
        for pid in {p.pid for p in job.processes} - {os.getpid()}:
            try:
                proc = psutil.Process(pid)
                named = job.job_id in proc.cmdline() or (
                    proc.environ().get("NNUI_JOB_ID") == job.job_id
                )
                if named:
                    doomed += [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
        for proc in doomed:
            with contextlib.suppress(psutil.Error):
                proc.kill()


async def measure(app, probe_events: Path, seconds: float, num_jobs: int, epoch_s: float) -> dict:
    from trainer.schema.events import Kind, encode_event

    figures: dict = {}
    async with app.run_test(size=(160, 48)) as pilot:
        deadline = time.perf_counter() + 60 + 3 * epoch_s
        while sum(bool(v.epoch) for v in app.views) < num_jobs:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"jobs did not start: {[(v.state, v.epoch) for v in app.views]}")
            await pilot.pause(0.1)
        table = app.screen.query_one("#jobs")
        updates0, cpu0, t0 = table.num_cell_updates, cpu_s(), time.perf_counter()
        await pilot.pause(seconds)
        busy_s, wall_s = cpu_s() - cpu0, time.perf_counter() - t0
        figures["cpu_percent_of_one_core"] = 100 * busy_s / wall_s
        figures["cpu_s"] = busy_s
        figures["cell_updates_per_s"] = (table.num_cell_updates - updates0) / wall_s
        figures["measured_s"] = wall_s

        # Key -> the table's cursor moved -> the next frame painted.
        painted: list[float] = []

        def moved(_old: object, _new: object) -> None:
            app.call_after_refresh(lambda: painted.append(time.perf_counter()))

        app.screen.watch(table, "cursor_coordinate", moved, init=False)
        keys = []
        for i in range(20):
            key = "down" if i % 2 == 0 else "up"
            count = len(painted)
            t = time.perf_counter()
            await pilot.press(key)
            while len(painted) == count:
                await pilot.pause(0.001)
            keys.append(painted[-1] - t)
        figures["key_to_screen_ms_median"] = 1000 * statistics.median(keys)
        figures["key_to_screen_ms_max"] = 1000 * max(keys)

        latencies = []
        with open(probe_events, "a") as handle:
            for epoch in range(8):
                loss = 0.5 + epoch / 1000 + 0.0001
                record = encode_event(
                    Kind.EPOCH_ENDED, epoch=epoch, train_loss=loss, val_loss=loss,
                    dice_per_class=[0.5], mean_fg_dice=0.5, ema_fg_dice=0.5, lr=0.01,
                    epoch_time_s=1.0, iterations_per_s=1.0,
                )  # fmt: skip
                t = time.perf_counter()
                handle.write(record)
                handle.flush()
                want = f"{loss:.4f}"
                while str(table.get_cell("probe", "train")) != want:
                    await pilot.pause(0.01)
                latencies.append(time.perf_counter() - t)
                await pilot.pause(0.37)  # de-phase from the refresh timer
        figures["event_to_screen_ms_median"] = 1000 * statistics.median(latencies)
        figures["event_to_screen_ms_max"] = 1000 * max(latencies)
        import psutil

        figures["rss_mib"] = psutil.Process().memory_info().rss / 2**20
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--epoch-s", type=float, default=30.0, help="seconds per fake epoch")
    options = parser.parse_args()
    if options.seconds <= 0 or options.epoch_s <= 0 or not 1 <= options.jobs <= 10:
        print("error: --seconds and --epoch-s must be > 0, --jobs between 1 and 10",
              file=sys.stderr)  # fmt: skip
        return 2
    from app.screens.seam import TuiConfig
    from app.tui import make_app
    from trainer.schema.tree import Roots

    work = Path(tempfile.mkdtemp(prefix="nnui_bench_"))
    roots = Roots(work / "raw", work / "preprocessed", work / "results")
    (roots.preprocessed / "Dataset900_Bench").mkdir(parents=True)
    plans = {c: {"patch_size": [32, 32, 32], "batch_size": 2} for c in ("3d_fullres", "2d")}
    (roots.preprocessed / "Dataset900_Bench" / "nnuiPlans.json").write_text(
        json.dumps({"configurations": plans})
    )
    roots.raw.mkdir()
    roots.results.mkdir()
    state = work / "state"
    for name, value in (("nnUNet_raw", roots.raw), ("nnUNet_preprocessed", roots.preprocessed),
                        ("nnUNet_results", roots.results), ("NNUI_STATE_DIR", state),
                        ("NNUI_TRAINER_SCRIPT", ROOT / "tests" / "fake_trainer.py")):  # fmt: skip
        os.environ[name] = str(value)

    whole_s, first_s, data_s, cpu_first_s = startup_s(work / "empty")
    try:
        start_jobs(roots, state, options.jobs, options.epoch_s)
        probe = add_probe_job(roots, state)
        app = make_app(TuiConfig(simulate_gpus=8, roots=roots, state_dir=state))
        figures = asyncio.run(measure(app, probe, options.seconds, options.jobs, options.epoch_s))
    finally:
        end_job_processes(state)
    print(f"start-up: first frame {first_s:.2f} s, with GPU and job data {data_s:.2f} s "
          f"(after interpreter start; whole process {whole_s:.2f} s; "
          f"CPU time to first frame {cpu_first_s:.2f} s)")  # fmt: skip
    print(
        f"CPU while {options.jobs} jobs train (one epoch per {options.epoch_s:g} s each): "
        f"{figures['cpu_percent_of_one_core']:.2f} % of one core over "
        f"{figures['measured_s']:.0f} s ({figures['cpu_s']:.2f} CPU-s; "
        f"{figures['cell_updates_per_s']:.1f} cell updates/s, "
        f"{os.getloadavg()[0]:.1f} 1-min load at the end)"
    )
    print(
        f"key to screen: median {figures['key_to_screen_ms_median']:.1f} ms, "
        f"max {figures['key_to_screen_ms_max']:.1f} ms"
    )
    print(
        f"event to screen: median {figures['event_to_screen_ms_median']:.0f} ms, "
        f"max {figures['event_to_screen_ms_max']:.0f} ms (jobs refresh every 1 s)"
    )
    print(f"resident memory: {figures['rss_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
