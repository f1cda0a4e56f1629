"""Two results trees in one registry (an `nnui launch --results B` beside runs of the
current tree): the cross-validation view never merges their folds into one row, names the
other tree, and queues each row's folds in its own tree with its own trainer flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cross_validation import DATASET, FOLDS, add_fold
from tui_fixtures import T0, make_roots, screen_of, tui_app, wait_for

from app.screens.confirm import LaunchConfirmScreen
from app.screens.cross_validation import CrossValidationScreen
from app.screens.dashboard import DashboardScreen
from app.services.cross_validation import cv_rows, queue_launches
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from app.widgets.job_table import JobTable
from trainer.schema.tree import ROOT_ENVS

ROOT = Path(__file__).resolve().parents[2]
WEIGHTS = ("-pretrained_weights", "/weights/other_project.pth")
# Tree B: fold 0 failed, fold 1 finished with a Dice the default tree never reached.
B_FOLDS = {
    "0": ("failed", 3, ["1"], 60.0, None, None, True),
    "1": ("finished", 0, ["1"], 1800.0, 0.95, None, True),
}


@pytest.fixture
def two_trees(tmp_path: Path):
    roots = make_roots(tmp_path)
    other = make_roots(tmp_path / "projB")
    registry = Registry(tmp_path / "state")
    for fold in FOLDS:
        add_fold(registry, roots, fold)
    env = {ROOT_ENVS[name]: str(getattr(other, name)) for name in ROOT_ENVS}
    for fold, spec in B_FOLDS.items():  # newer than every job of the default tree
        add_fold(registry, other, fold, spec, tag="b", trainer_args=("--epochs", "10", *WEIGHTS),
                 env=env, t0=T0 + 100)  # fmt: skip
    return roots, other, registry


def _states(row) -> list[tuple[str, float | None]]:
    return [(c.state, c.dice) for c in row.folds]


def test_rows_never_mix_trees_and_queue_in_their_own(two_trees) -> None:
    roots, other, registry = two_trees
    rows = cv_rows(JobTracker(registry).refresh(), default_results=roots.results)
    assert [(r.results, r.label) for r in rows] == [
        (os.path.realpath(roots.results), ""),
        (os.path.realpath(other.results), "projB"),
    ]
    mine, theirs = rows
    assert _states(mine) == [("finished", 0.8), ("finished", 0.6), ("failed", None),
                             ("missing", None), ("failed", None)]  # fmt: skip
    assert _states(theirs) == [("failed", None), ("finished", 0.95), ("missing", None),
                               ("missing", None), ("missing", None)]  # fmt: skip
    assert theirs.mean_dice == pytest.approx(0.95) and mine.mean_dice == pytest.approx(0.7)
    for launch in queue_launches(mine, ["0", "1"]):
        assert "--results" not in launch.command() and WEIGHTS[0] not in launch.command()
        used = launch.request(roots).roots  # the default tree: the caller's roots
        assert used is None or os.path.realpath(used.results) == os.path.realpath(roots.results)
    launches = queue_launches(theirs, ["0", "1"])
    assert [q.folds for q in launches] == [("2", "3", "4"), ("0",)]
    for launch in launches:
        argv = launch.command()
        assert argv[argv.index("--results") + 1] == os.path.realpath(other.results)
        assert argv[argv.index("--preprocessed") + 1] == str(other.preprocessed)
        assert argv[-2:] == list(WEIGHTS)
        request = launch.request(roots)
        assert request.roots is not None and request.roots.results == other.results
        assert list(WEIGHTS) == request.trainer_args[-2:]


def test_nnui_cv_json_names_each_rows_tree(two_trees) -> None:
    roots, other, registry = two_trees
    env = {**os.environ, "NNUI_STATE_DIR": str(registry.state_dir),
           "nnUNet_results": str(roots.results), "nnUNet_preprocessed": str(roots.preprocessed),
           "nnUNet_raw": str(roots.raw)}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "app.main", "cv", *args], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    done = run("--json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["results"], r["tree"]) for r in rows] == [
        (os.path.realpath(roots.results), None),
        (os.path.realpath(other.results), "projB"),
    ]
    assert [f["state"] for f in rows[1]["folds"]][:2] == ["failed", "finished"]
    assert all("--results" in q for q in rows[1]["queue"])
    assert not any("--results" in q or WEIGHTS[0] in q for q in rows[0]["queue"])
    text = run().stdout
    queue = [line for line in text.splitlines() if "to queue" in line]
    assert any("[projB]" in line and f"--results {os.path.realpath(other.results)}" in line
               for line in queue), text  # fmt: skip
    assert f"{DATASET} [projB]" in text


async def test_the_cv_screen_labels_and_queues_the_other_tree(two_trees) -> None:
    roots, other, registry = two_trees
    app = tui_app(roots, registry.state_dir)
    async with app.run_test(size=(190, 48)) as pilot:
        await wait_for(lambda: len(app.views) == 6 and app.snapshot is not None, pilot)
        dashboard = await screen_of(app, pilot, DashboardScreen)
        jobs = dashboard.query_one(JobTable)
        await wait_for(lambda: jobs.row_count == 6, pilot)
        labelled = {j for j, cells in jobs._cells.items() if cells["dataset"].endswith("[projB]")}
        assert labelled == {"20260101-000000-f0b", "20260101-000001-f1b"}  # tree B's rows only
        await pilot.press("v")
        screen = await screen_of(app, pilot, CrossValidationScreen)
        await wait_for(lambda: len(screen.rows) == 2, pilot)
        table = screen.query_one("#cv-table")
        assert str(table.get_row_at(0)[0]) == DATASET
        assert str(table.get_row_at(1)[0]) == f"{DATASET} [projB]"
        await pilot.press("down")
        await wait_for(lambda: "--results" in str(screen.query_one("#cv-queue").render()), pilot)
        await pilot.press("m")
        dialog = await screen_of(app, pilot, LaunchConfirmScreen)
        text = dialog.query_one("#launch-preview-text").render().plain
        assert f"--results {os.path.realpath(other.results)}" in text
        assert all(q.request(roots).roots.results == other.results for q in screen.queued)
        assert str(other.results) in text  # the plans' run folders are in tree B
        await pilot.press("n")
        await screen_of(app, pilot, CrossValidationScreen)
        assert len(Registry(registry.state_dir).list()) == 6
