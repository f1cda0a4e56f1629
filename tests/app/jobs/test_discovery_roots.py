"""Roots that explain themselves: a run started by hand belongs to the results tree of its
own environment and working folder (a relative `nnUNet_results`), found by `nnui status`
started anywhere, labelled with its tree; a command that finds nothing names the trees it
looked in and how to point elsewhere."""

from __future__ import annotations

import json
import os
import signal
import time

from test_discovery import (
    FAKE_PY,
    ROOT,
    _events,
    _fake_trainer,
    _fold,
    _nnui,
    _wait,
    started,  # noqa: F401 (the fixture)
)

from app.services.machine.procs import read_sigcgt_usr1


def test_a_hand_started_run_belongs_to_its_own_tree(started, tmp_path) -> None:  # noqa: F811
    project = tmp_path / "projA"
    project.mkdir()
    script = _fake_trainer(tmp_path)
    folder = _fold(project / "lab_tree", "0")  # its nnUNet_results, relative to its cwd
    run_env = {**os.environ, "nnUNet_results": "lab_tree"}
    run = started.start([FAKE_PY, str(script), "900", "2d", "0", "-device", "cpu"],
                        env=run_env, cwd=str(project))  # fmt: skip
    assert run.stdout is not None and run.stdout.readline().strip() == b"ready"
    _events(folder, time.time(), [run.pid])
    _wait(lambda: read_sigcgt_usr1(run.pid), "the stand-in's handler")
    default = tmp_path / "default" / "results"
    default.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNUI_STATE_DIR": str(tmp_path / "state"),
           "nnUNet_results": str(default), "NNUI_ADOPT_SCOPE": ""}  # fmt: skip
    done = _nnui("status", "--json", env=env)  # started in another folder, another tree
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in json.loads(done.stdout)}
    row = rows[f"run:{run.pid}"]
    assert row["run_dir"] == str(folder.resolve()) and row["run_dir_source"] == "argv"
    assert (row["results"], row["tree"]) == (str((project / "lab_tree").resolve()), "lab_tree")
    table = _nnui("status", env=env).stdout
    line = next(t for t in table.splitlines() if t.startswith(f"run:{run.pid}"))
    assert "Dataset900_NnuiDemo [lab_tree]" in line, table
    out = tmp_path / "curves"
    exported = _nnui("export", f"run:{run.pid}", "-o", str(out), env=env)  # 1: without the plot
    assert exported.returncode in (0, 1), exported.stderr  # extra, the CSV alone
    names = sorted(p.name for p in out.iterdir())
    assert f"run-{run.pid}_curves.csv" in names and not any(":" in n for n in names), names
    # Once it has ended, its folder is found again from anywhere: the tree was remembered.
    os.killpg(run.pid, signal.SIGKILL)  # our own stand-in's session
    run.wait()
    done = _nnui("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    ended = [r for r in json.loads(done.stdout) if r["run_dir"] == str(folder.resolve())]
    assert len(ended) == 1 and ended[0]["state"] not in ("running", "starting"), ended
    assert ended[0]["tree"] == "lab_tree"


def test_nothing_found_names_the_roots_looked_in(tmp_path) -> None:
    default = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NNUI_STATE_DIR": str(tmp_path / "state"),
           "nnUNet_results": str(default)}  # fmt: skip
    done = _nnui("export", "run:999999999", env=env)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    for part in (str(default), "--results", "nnUNet_results"):
        assert part in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
