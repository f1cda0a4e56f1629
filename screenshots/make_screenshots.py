"""Make the README screenshots from real runs on simulated GPUs.

Starts nnui (4 simulated GPUs) in a scratch folder, launches folds through the fold board
with Pilot (fold 0 on GPU 0 with fold 3 queued after it, fold 1 on GPU 1, fold 2 as a
-num_gpus DDP group on GPUs 2+3), lets them train, and saves
screenshots/{fold_board,dashboard,job_detail,stop_confirm}.svg. Every process it started is
ended by pid at the end.

The trainer: the real one (`python -m trainer`, tiny flags, on a small synthetic dataset
made with nnui-demo-data + nnui-preprocess) when it is there and works, else
tests/fake_trainer.py (`--trainer fake` forces it).

    python screenshots/make_screenshots.py [--trainer auto|real|fake] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.screens.seam import TuiConfig  # noqa: E402
from app.tui import make_app  # noqa: E402
from trainer.schema.tree import Roots  # noqa: E402

OUT = ROOT / "screenshots"
SIZE = (160, 48)
FAKE_FLAGS = "--epochs 60 --epoch-time 0.5"
REAL_FLAGS = "--epochs 30 --iterations-per-epoch 2 --val-iterations 1"
log = logging.getLogger("screenshots")


def prepare_fake(roots: Roots) -> str:
    folder = roots.preprocessed / "Dataset900_Demo"
    folder.mkdir(parents=True)
    plans = {
        "configurations": {
            "3d_fullres": {"patch_size": [32, 64, 64], "batch_size": 2},
            "2d": {"patch_size": [64, 64], "batch_size": 12},
        }
    }
    (folder / "nnuiPlans.json").write_text(json.dumps(plans))
    os.environ["NNUI_TRAINER_SCRIPT"] = str(ROOT / "tests" / "fake_trainer.py")
    return FAKE_FLAGS


def prepare_real(roots: Roots) -> str:
    """A small synthetic dataset, preprocessed; raises if the real trainer is not usable."""
    if not (ROOT / "trainer" / "run.py").exists():
        raise RuntimeError("trainer/run.py does not exist yet")
    py = sys.executable
    steps = [
        [py, "-m", "trainer.demo", "--cases", "10", "--out", str(roots.raw),
         "--shape-scale", "0.5"],
        [py, "-m", "trainer.planning.preprocess", "900", "-c", "3d_fullres",
         "--raw", str(roots.raw), "--preprocessed", str(roots.preprocessed), "--batch-size", "2",
         # CPU-sized plans by name, under the default identifier the screens show
         "-pl", "nnuiCPUPlanner", "-overwrite_plans_name", "nnuiPlans"],
    ]  # fmt: skip
    for step in steps:
        subprocess.run(step, check=True, cwd=ROOT, capture_output=True, timeout=300)
    os.environ.pop("NNUI_TRAINER_SCRIPT", None)
    return REAL_FLAGS


def end_job_processes(state_dir: Path) -> None:
    """End every live process of every job in this registry through the product's own kill
    (verified identities, SIGTERM then SIGKILL, by pid only)."""
    from app.services.jobs.registry import Registry
    from app.services.signals import send as signals

    registry = Registry(state_dir)
    for job in registry.list():
        signals.kill(job, registry, grace_s=3.0)


def _holds(condition) -> bool:
    from textual.css.query import NoMatches

    try:
        return bool(condition())
    except NoMatches:  # not mounted yet
        return False


async def until(condition, pilot, timeout_s: float) -> bool:
    """Until `condition()` holds; `timeout_s` only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not _holds(condition):
        if time.monotonic() > deadline:
            return False
        await pilot.pause(0.1)
    return True


async def drive(app, flags: str, min_epochs: int, timeout_s: float) -> None:
    async with app.run_test(size=SIZE) as pilot:
        await until(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot, 60)
        await until(lambda: app.screen.id == "dashboard" and app.screen.is_mounted, pilot, 60)
        await pilot.press("l")
        await until(lambda: app.screen.id == "launch" and app.screen.is_mounted, pilot, 60)
        screen = app.screen
        await until(lambda: screen.query_one("#picker").choices, pilot, 60)
        # fold 0 -> GPU 0; fold 1 -> GPU 1; fold 2 -> GPUs 2+3 (DDP); fold 3 -> GPU 0 after 0
        await pilot.press("space", "down", "right", "space", "down", "right", "space")
        await pilot.press("right", "space", "down", "left", "left", "left", "space")
        await pilot.press("f", *flags, "enter")
        await until(lambda: screen.query_one("#flags").value == flags, pilot, 60)
        await until(lambda: len(screen.query_one("#board").model.assignments) == 4, pilot, 60)
        await until(screen.plan_is_current, pilot, 60)
        if screen.problems:
            raise RuntimeError(f"launch refused: {screen.problems}")
        app.save_screenshot("fold_board.svg", str(OUT))
        await pilot.press("g")

        def trained() -> bool:
            running = [v for v in app.views if v.state == "running"]
            return len(running) >= 3 and all((v.epoch or 0) >= min_epochs for v in running)

        if not await until(trained, pilot, timeout_s):
            log.warning("runs slower than expected: %s", [(v.state, v.epoch) for v in app.views])
        table = app.screen.query_one("#jobs")
        await until(lambda: table.row_count == len(app.views), pilot, 60)
        app.save_screenshot("dashboard.svg", str(OUT))

        # The DDP job: its process tree shows supervisor, launcher and both ranks.
        order = [v.job.job_id for v in app.views]
        ddp = next(v for v in app.views if v.job.fold == "2")
        table.move_cursor(row=order.index(ddp.job.job_id))
        await pilot.press("enter")
        await until(lambda: app.screen.id == "job-detail" and app.screen.is_mounted, pilot, 60)
        tree = app.screen.query_one("#tree")
        await until(lambda: "rank 1" in (tree._shown or ""), pilot, 60)  # both ranks drawn
        app.save_screenshot("job_detail.svg", str(OUT))
        await pilot.press("escape")
        await until(lambda: app.screen.id == "dashboard", pilot, 60)
        await pilot.press("s")
        await until(lambda: app.screen.id == "stop-confirm" and app.screen.is_mounted, pilot, 60)
        app.save_screenshot("stop_confirm.svg", str(OUT))
        await pilot.press("n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("auto", "real", "fake"), default="auto")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path(tempfile.mkdtemp(prefix="nnui_screens_"))
    roots = Roots(work / "raw", work / "preprocessed", work / "results")
    for path in (roots.raw, roots.preprocessed, roots.results):
        path.mkdir(parents=True)
    state = work / "state"
    for name, value in (("nnUNet_raw", roots.raw), ("nnUNet_preprocessed", roots.preprocessed),
                        ("nnUNet_results", roots.results), ("NNUI_STATE_DIR", state)):  # fmt: skip
        os.environ[name] = str(value)
    flags, min_epochs, timeout_s = None, 6, 60.0
    if options.trainer in ("auto", "real"):
        try:
            flags, min_epochs, timeout_s = prepare_real(roots), 3, 420.0
            log.info("trainer: real (python -m trainer)")
        except (RuntimeError, subprocess.SubprocessError, OSError) as error:
            if options.trainer == "real":
                print(f"error: real trainer not usable: {error}", file=sys.stderr)
                return 2
            shutil.rmtree(roots.preprocessed)
            roots.preprocessed.mkdir()
            log.info("trainer: fake (%s)", error)
    if flags is None:
        flags = prepare_fake(roots)
    app = make_app(TuiConfig(simulate_gpus=4, roots=roots, state_dir=state, jobs_interval_s=0.5))
    try:
        asyncio.run(drive(app, flags, min_epochs, timeout_s))
    finally:
        end_job_processes(state)
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)
    for name in ("fold_board", "dashboard", "job_detail", "stop_confirm"):
        print(OUT / f"{name}.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())
