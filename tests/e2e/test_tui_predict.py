"""Pilot test of the prediction form: p on the fold board (folds and GPUs marked) opens it
prefilled, enter shows the exact argv of every part, y starts one job per GPU, the jobs
table shows them as predictions and s stops one after its current case."""

from __future__ import annotations

from pathlib import Path

import pytest
from tui_fixtures import (
    DATASET,
    ROOT,
    kill_started_jobs,
    make_roots,
    record_toasts,
    screen_of,
    tui_app,
    use_fake_trainer,
    wait_for,
)

from app.screens.confirm import LaunchConfirmScreen, StopConfirmScreen
from app.screens.dashboard import DashboardScreen
from app.screens.job_detail import JobDetailScreen
from app.screens.launch import LaunchScreen
from app.screens.predict_form import PredictScreen
from app.services.jobs.registry import PREDICT, Registry
from trainer.schema.tree import checkpoint_file, run_dir

FAKE_PREDICT = ROOT / "tests" / "fake_predict.py"


def trained_tree(roots) -> None:
    """What the form's checks look at: CASE_0000 images and folds 0, 1 with checkpoints."""
    images = roots.raw / DATASET / "imagesTs"
    images.mkdir(parents=True)
    for case in ("c1", "c2", "c3"):
        (images / f"{case}_0000.nii.gz").write_bytes(b"")
    for configuration in ("2d", "3d_fullres"):
        for fold in ("0", "1"):
            folder = run_dir(roots.results, DATASET, configuration, fold)
            folder.mkdir(parents=True)
            (folder / checkpoint_file("final")).write_bytes(b"")


async def open_form(app, pilot) -> PredictScreen:
    await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
    await screen_of(app, pilot, DashboardScreen)
    await pilot.press("l")
    board = await screen_of(app, pilot, LaunchScreen)
    await wait_for(lambda: board.query_one("#picker").choices, pilot)
    toasts = record_toasts(app)
    await pilot.press("p")  # nothing marked yet: it says what to do, no form
    await wait_for(lambda: any("mark the folds" in t for t in toasts), pilot)
    assert app.screen is board
    await pilot.press("space", "down", "right", "space")  # fold 0 on GPU 0, fold 1 on GPU 1
    await wait_for(lambda: len(board.query_one("#board").model.assignments) == 2, pilot)
    await pilot.press("p")
    return await screen_of(app, pilot, PredictScreen)


@pytest.mark.slow
async def test_form_starts_one_part_per_gpu_and_s_stops_one(tmp_path: Path, monkeypatch):
    roots = make_roots(tmp_path)
    trained_tree(roots)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    monkeypatch.setenv("NNUI_PREDICT_SCRIPT", str(FAKE_PREDICT))
    app = tui_app(roots, state)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            form = await open_form(app, pilot)
            d = form.defaults
            assert (d.folds, d.gpus) == (("0", "1"), ("0", "1"))
            assert d.input_dir == roots.raw / DATASET / "imagesTs"
            assert d.output_dir.is_relative_to(roots.results / DATASET)
            await pilot.press("ctrl+n")  # save probabilities on
            await wait_for(lambda: form.query_one("#pf-npz").value, pilot)
            await pilot.press("enter")
            confirm = await screen_of(app, pilot, LaunchConfirmScreen)
            preview = confirm.query_one("#launch-preview-text").render().plain
            for part_id in (0, 1):
                assert f"-num_parts 2 -part_id {part_id}" in preview
            assert "-device cpu" in preview and "--save_probabilities" in preview
            assert str(d.output_dir) in preview
            await pilot.press("y")
            await screen_of(app, pilot, DashboardScreen)
            await wait_for(lambda: len(Registry(state).list()) == 2, pilot)
            jobs = Registry(state).list()
            assert {j.kind for j in jobs} == {PREDICT}
            assert sorted((j.part_id, tuple(j.gpus)) for j in jobs) == [(0, ("0",)), (1, ("1",))]
            ids = [j.job_id for j in jobs]
            await wait_for(lambda: all(app.view_of(i).state == "running" for i in ids), pilot)
            table = app.screen.query_one("#jobs")
            await wait_for(lambda: "0/3 cases" in str(table.get_cell(ids[0], "epoch")), pilot)
            assert str(table.get_cell(ids[0], "fold")).startswith("predict 0,1 [")

            table.move_cursor(row=table.get_row_index(ids[0]))
            await pilot.press("s")
            dialog = await screen_of(app, pilot, StopConfirmScreen)
            text = dialog.query_one("#stop-plan").render().plain
            assert "writes the case it is predicting" in text
            await pilot.press("y")
            # The stopped event comes before the supervisor records the exit code.
            await wait_for(
                lambda: (v := app.view_of(ids[0])).state == "stopped" and v.exit_code is not None,
                pilot,
            )
            assert app.view_of(ids[0]).exit_code == 0
            assert app.view_of(ids[1]).state == "running"  # only the chosen part stopped

            await pilot.press("enter")  # its detail: what it predicts into, no epoch curves
            detail = await screen_of(app, pilot, JobDetailScreen)
            await wait_for(
                lambda: (
                    f"predict -> {d.output_dir}" in str(detail.query_one("#detail-header").render())
                ),
                pilot,
            )
    finally:
        kill_started_jobs(state)
