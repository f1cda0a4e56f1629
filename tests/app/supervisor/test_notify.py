"""Telling the user: the desktop notification the supervisor sends (a fake notify-send on
PATH records its argv) and the terminal bell of an open nnui (once per job and event)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_trainer import cleanup_jobs, fake_env, wait_until
from tui_fixtures import make_roots, tui_app, wait_for, write_frozen_runs

from app.services.jobs.bell import BellRule
from app.services.supervisor.announce import notify_argv

ROOT = Path(__file__).resolve().parents[3]
FAKE_NOTIFY = """#!{python}
import json, sys
with open({out!r}, "a") as out:
    out.write(json.dumps(sys.argv[1:]) + "\\n")
"""
EVENT = {"NNUI_EVENT": "failed", "NNUI_DATASET": "Dataset004_Demo", "NNUI_FOLD": "1",
         "NNUI_CONFIGURATION": "3d_fullres", "NNUI_JOB_ID": "j1", "NNUI_DICE": "",
         "NNUI_REASON": "exit 3"}  # fmt: skip


def fake_notify_send(folder: Path) -> Path:
    """A notify-send that appends its argv to folder/notes.jsonl; its folder (for PATH)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    script = bin_dir / "notify-send"
    script.write_text(FAKE_NOTIFY.format(python=sys.executable, out=str(folder / "notes.jsonl")))
    script.chmod(0o755)
    return bin_dir


def test_notification_only_where_a_desktop_is_reachable(tmp_path: Path) -> None:
    bin_dir = fake_notify_send(tmp_path)
    desktop = {"PATH": str(bin_dir), "DISPLAY": ":0"}
    assert notify_argv(EVENT, desktop) == [
        str(bin_dir / "notify-send"), "--app-name=nnui", "--urgency=critical",
        "nnui: Dataset004_Demo fold 1 failed", "3d_fullres · job j1 · exit 3",
    ]  # fmt: skip
    assert notify_argv(EVENT, {"PATH": str(bin_dir)}) is None  # no session: skipped
    assert notify_argv(EVENT, {"PATH": str(tmp_path), "DISPLAY": ":0"}) is None  # no program
    assert notify_argv(EVENT, {**desktop, "NNUI_NO_DESKTOP_NOTIFY": "1"}) is None
    assert notify_argv({**EVENT, "NNUI_EVENT": "stopped"}, desktop) is None  # the user's own


@pytest.mark.slow
def test_the_supervisor_notifies_the_desktop_when_a_job_finishes(tmp_path: Path) -> None:
    env = {**os.environ, **fake_env(tmp_path)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("NNUI_NO_DESKTOP_NOTIFY", None)
    env["NNUI_GPU_CLAIMS_DIR"] = str(tmp_path / "claims")
    env["PATH"] = f"{fake_notify_send(tmp_path)}{os.pathsep}{env['PATH']}"
    env["DISPLAY"] = ":99"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "app.main", "launch", "4", "3d_fullres", "--simulate-gpus",
             "1", "--folds", "0", "--gpus", "0", "--", "--epochs", "2", "--epoch-time", "0.1"],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        job_id = result.stdout.split()[0]
        notes = tmp_path / "notes.jsonl"
        assert wait_until(notes.exists, 120)
        (argv,) = [json.loads(line) for line in notes.read_text().splitlines()]
        assert argv[:3] == [
            "--app-name=nnui",
            "--urgency=normal",
            "nnui: Dataset004_Demo fold 0 finished",
        ]
        assert argv[3].startswith(f"3d_fullres · job {job_id} · Dice ")
    finally:
        cleanup_jobs(Path(env["NNUI_STATE_DIR"]))


def view(job_id: str, state: str, *alerts: str, watch_only: bool = False) -> SimpleNamespace:
    job = SimpleNamespace(job_id=job_id)
    return SimpleNamespace(job=job, state=state, alerts=alerts, watch_only=watch_only)


def test_the_bell_rings_once_per_job_and_event_never_for_the_past() -> None:
    rule = BellRule()
    assert rule.rings([view("old", "finished"), view("a", "running")]) == []  # when opened
    assert rule.rings([view("old", "finished"), view("a", "running")]) == []
    assert rule.rings([view("a", "running", "stalled: no event for 400 s")]) == [("a", "stalled")]
    assert rule.rings([view("a", "running", "stalled: no event for 400 s")]) == []
    assert rule.rings([view("a", "failed"), view("b", "finished")]) == [
        ("a", "failed"), ("b", "finished"),
    ]  # fmt: skip
    assert rule.rings([view("a", "failed"), view("b", "finished")]) == []
    assert rule.rings([view("w", "finished", watch_only=True)]) == []  # not nnui's job


@pytest.mark.parametrize("bell", [True, False], ids=["bell", "--no-bell"])
async def test_an_open_nnui_rings_when_a_job_ends(tmp_path: Path, bell: bool) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    app = tui_app(roots, state, bell=bell)
    rung: list[int] = []
    app.bell = lambda: rung.append(1)  # type: ignore[method-assign]
    async with app.run_test(size=(150, 48)) as pilot:
        await wait_for(lambda: app.num_jobs_messages >= 2, pilot)
        assert rung == []
        ids = write_frozen_runs(roots, state)  # finished, stopped, failed: after opening
        await wait_for(lambda: len(app.views) == 3, pilot)
        seen = app.num_jobs_messages
        await wait_for(lambda: app.num_jobs_messages >= seen + 2, pilot)
        dashboard = app.screen
        assert {(ids[0], "finished"), (ids[2], "failed")} <= dashboard._bell.seen
        assert bool(rung) == bell and len(rung) <= 2  # at most one ring per refresh
        rings, seen = len(rung), app.num_jobs_messages
        await wait_for(lambda: app.num_jobs_messages >= seen + 2, pilot)
        assert len(rung) == rings  # the same ends seen again: silent
