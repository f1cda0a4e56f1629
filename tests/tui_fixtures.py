"""Shared helpers for the TUI tests: a tiny preprocessed dataset, frozen run folders, an
app wired to a temporary registry, and clean-up of every process a test started.

(No tests here; the test_tui_* modules import from it.)
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from xml.etree import ElementTree

from rich.cells import cell_len
from rich.color import Color
from rich.terminal_theme import SVG_EXPORT_THEME
from textual import events
from textual.css.query import NoMatches
from textual.keys import _character_to_key

from app.screens.seam import TuiConfig
from app.tui import NnuiApp, make_app
from trainer.schema.atomic import atomic_write_text
from trainer.schema.events import Kind, encode_event
from trainer.schema.status import Status
from trainer.schema.tree import EVENTS_FILE, Roots, run_dir

ROOT = Path(__file__).resolve().parents[1]
FAKE_TRAINER = ROOT / "tests" / "fake_trainer.py"
DATASET = "Dataset004_Demo"
T0 = 1_780_000_000.0  # a fixed "now" for frozen folders
S = TypeVar("S")


def make_roots(tmp_path: Path, batch_size: int = 2) -> Roots:
    roots = Roots(tmp_path / "raw", tmp_path / "preprocessed", tmp_path / "results")
    folder = roots.preprocessed / DATASET
    folder.mkdir(parents=True)
    plans = {
        "configurations": {
            "3d_fullres": {"patch_size": [32, 64, 64], "batch_size": batch_size},
            "2d": {"patch_size": [64, 64], "batch_size": 12},
        }
    }
    (folder / "nnuiPlans.json").write_text(json.dumps(plans))
    roots.raw.mkdir()
    roots.results.mkdir()
    return roots


def use_fake_trainer(monkeypatch: Any, roots: Roots, state_dir: Path) -> None:
    """Children inherit these: the fake trainer resolves its roots from the environment."""
    monkeypatch.setenv("nnUNet_raw", str(roots.raw))
    monkeypatch.setenv("nnUNet_preprocessed", str(roots.preprocessed))
    monkeypatch.setenv("nnUNet_results", str(roots.results))
    monkeypatch.setenv("NNUI_STATE_DIR", str(state_dir))
    monkeypatch.setenv("NNUI_TRAINER_SCRIPT", str(FAKE_TRAINER))


def tui_app(roots: Roots, state_dir: Path, **config: Any) -> NnuiApp:
    config.setdefault("simulate_gpus", 2)
    config.setdefault("jobs_interval_s", 0.25)
    config.setdefault("cache_dir", state_dir.parent / "cache")  # never the user's own cache
    return make_app(TuiConfig(roots=roots, state_dir=state_dir, **config))


# Only a safety net against a hang: every wait ends when its condition holds, however busy
# the machine is. Never an assertion about speed.
SAFETY_NET_S = 120.0


def _holds(condition: Callable[[], Any]) -> bool:
    try:
        return bool(condition())
    except NoMatches:  # the widget it looks at is not mounted yet
        return False


async def wait_for(
    condition: Callable[[], Any], pilot: Any, timeout_s: float = SAFETY_NET_S
) -> None:
    """Let the app run until `condition()` holds (a query of a widget that is not mounted
    yet counts as "not yet")."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not _holds(condition):
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within the {timeout_s:.0f} s safety net")
        await pilot.pause(0.05)


async def screen_of(app: Any, pilot: Any, kind: type[S]) -> S:
    """The active screen once it is a mounted `kind` (composed, on_mount run)."""
    await wait_for(lambda: isinstance(app.screen, kind) and app.screen.is_mounted, pilot)
    return app.screen


def record_toasts(app: Any) -> list[str]:
    """Every toast the app is asked to show from now on, in order. The app's own list drops
    a toast once its timeout passes, which a test on a loaded machine can outlast."""
    said: list[str] = []
    notify = app.notify

    def record(message: Any, *args: Any, **kwargs: Any) -> Any:
        said.append(str(message))
        return notify(message, *args, **kwargs)

    app.notify = record
    return said


def burst(app: Any, *keys: str) -> None:
    """Queue key presses all at once, before the app handles the first: what a fast typist
    or a busy machine delivers (Pilot.press lets the app idle between keys)."""
    for key in keys:
        name = _character_to_key(key) if len(key) == 1 and not key.isalnum() else key
        char = key if len(key) == 1 else {"space": " "}.get(key)
        event = events.Key(name, char)
        event.set_sender(app)
        app.post_message(event)


# ---- the screen as drawn, through Textual's public SVG export ------------------------


@dataclass(frozen=True)
class Drawn:
    """A run of text as the terminal shows it: cell column, line, colours after reverse."""

    x: int
    y: int
    text: str
    fg: Color
    bg: Color
    bold: bool


_SVG = "{http://www.w3.org/2000/svg}"
_CELL_W, _LINE_H, _TEXT_Y, _RECT_Y = 20 * 0.61, 20 * 1.22, 20.0, 1.5  # Rich's SVG metrics


def _cell(value: str | None, base: float, step: float) -> int:
    return round((float(value or 0) - base) / step)


def drawn_runs(app: Any) -> list[Drawn]:
    """Every non-blank run of text on the current screen, read from `app.export_screenshot()`
    (the SVG Textual writes: line filters such as NO_COLOR applied, reverse resolved; a run
    without a background rectangle sits on the SVG's default background)."""
    svg = ElementTree.fromstring(app.export_screenshot())
    css = "".join(node.text or "" for node in svg.iter(f"{_SVG}style"))
    rules = dict(re.findall(r"\.([\w-]+) \{ (fill: #[0-9a-fA-F]{6}[^}]*)\}", css))
    backgrounds = {
        (_cell(r.get("x"), 0, _CELL_W), _cell(r.get("y"), _RECT_Y, _LINE_H)): r.get("fill")
        for r in svg.iter(f"{_SVG}rect")
        if r.get("shape-rendering") == "crispEdges"
    }
    default_bg = SVG_EXPORT_THEME.background_color.hex
    runs = []
    for node in svg.iter(f"{_SVG}text"):
        text = (node.text or "").replace("\xa0", " ")
        rule = rules.get(node.get("class", ""))
        if rule is None or not text.strip():
            continue  # the title, or a line's end
        x, y = _cell(node.get("x"), 0, _CELL_W), _cell(node.get("y"), _TEXT_Y, _LINE_H)
        fg, bg = Color.parse(rule[6:13]), Color.parse(backgrounds.get((x, y), default_bg))
        runs.append(Drawn(x, y, text, fg, bg, "font-weight: bold" in rule))
    return runs


def drawn_cells(app: Any) -> list[list[str]]:
    """The current screen cell by cell, a list per line (a wide character's second cell
    holds ""), so that a widget's columns are a slice."""
    width, height = app.size
    cells = [[" "] * width for _ in range(height)]
    for run in drawn_runs(app):
        x = run.x
        for char in run.text:
            for offset in range(cell_len(char)):
                if x + offset < width:
                    cells[run.y][x + offset] = "" if offset else char
            x += cell_len(char)
    return cells


def drawn_lines(app: Any) -> list[str]:
    """The current screen's lines as the terminal shows them."""
    return ["".join(line) for line in drawn_cells(app)]


def end_job_processes(state_dir: Path) -> None:
    """End every live process of every job in this registry through the product's own kill
    (verified identities, SIGTERM then SIGKILL, by pid only)."""
    from app.services.jobs.registry import Registry
    from app.services.signals import send as signals

    registry = Registry(state_dir)
    for job in registry.list():
        signals.kill(job, registry, grace_s=3.0)


kill_started_jobs = end_job_processes


# ---- frozen run folders (snapshot tests) --------------------------------------------


def _epoch(epoch: int, num_epochs: int, nan: bool = False) -> dict[str, Any]:
    loss = 1.2 / (1 + 0.5 * epoch)
    dice = 0.9 - 0.6 / (1 + epoch)
    return {
        "epoch": epoch,
        "train_loss": float("nan") if nan else loss,
        "val_loss": loss * 1.1,
        "dice_per_class": [dice],
        "mean_fg_dice": dice,
        "ema_fg_dice": dice * 0.95,
        "lr": 0.01 * (1 - epoch / num_epochs) ** 0.9,
        "epoch_time_s": 30.0 + (epoch % 3),
        "iterations_per_s": 8.3,
    }


def write_frozen_runs(roots: Roots, state_dir: Path) -> list[str]:
    """Three ended jobs (finished, stopped, failed) with deterministic files and registry."""
    from app.services.jobs.registry import Job, ProcessRecord, Registry

    registry = Registry(state_dir)
    specs = [
        ("0", "finished", 10, 0, None),
        ("1", "stopped", 6, 0, None),
        ("2", "failed", 4, 3, "RuntimeError: CUDA error: an illegal memory access"),
    ]
    ids = []
    for fold, state, epochs_done, exit_code, error in specs:
        folder = run_dir(roots.results, DATASET, "3d_fullres", fold)
        folder.mkdir(parents=True)
        t = T0 + int(fold) * 100
        lines = [
            encode_event(
                Kind.RUN_STARTED,
                t=t,
                dataset=DATASET,
                configuration="3d_fullres",
                fold=fold,
                num_epochs=10,
                iterations_per_epoch=250,
                world_size=1,
                launcher="single",
                host="gpubox",
                argv=["nnui-train"],
            ),
            encode_event(
                Kind.TOPOLOGY,
                t=t + 1,
                ranks=[
                    {
                        "global_rank": 0,
                        "local_rank": 0,
                        "host": "gpubox",
                        "pid": 4000 + int(fold),
                        "device": "cpu",
                        "batch_size": 2,
                        "oversample_foreground_percent": 0.33,
                        "sigusr1_handler": True,
                    }
                ],
            ),
        ]
        for epoch in range(epochs_done):
            lines.append(
                encode_event(Kind.EPOCH_ENDED, t=t + 31 * (epoch + 1), **_epoch(epoch, 10))
            )
        if state == "stopped":
            lines.append(encode_event(Kind.STOPPED, t=t + 500, epoch=epochs_done, reason="SIGUSR1"))
        elif state == "failed":
            lines.append(encode_event(Kind.FAILED, t=t + 500, message=error, traceback=""))
        else:
            lines.append(encode_event(Kind.FINISHED, t=t + 500))
        (folder / EVENTS_FILE).write_text("".join(lines))
        status = Status(state=state, epoch=epochs_done, num_epochs=10, updated_at=t + 500)
        atomic_write_text(folder / "status.json", status.to_json())
        console = [f"epoch {e} train loss {1.2 / (1 + 0.5 * e):.4f}" for e in range(epochs_done)]
        if error:
            console += ["Traceback (most recent call last):", '  File "loop.py", line 88', error]
        (folder / "console.log").write_text("\n".join(console) + "\n")
        job_id = f"20260101-00000{fold}-f{fold}"
        registry.add(
            Job(
                job_id=job_id, created_at=t, dataset=DATASET, configuration="3d_fullres",
                fold=fold, mode="single", device="cpu", gpus=[fold], simulated=True,
                argv=[sys.executable, "-m", "trainer", DATASET, "3d_fullres", fold],
                env={"NNUI_JOB_ID": job_id}, run_dir=str(folder),
                console_path=str(folder / "console.log"),
                processes=[ProcessRecord(pid=3000 + int(fold), create_time=t, role="trainer")],
                exit_code=exit_code, ended_at=t + 500,
            )
        )  # fmt: skip
        ids.append(job_id)
    return ids
