"""The launch form shows a configuration's estimated GPU memory beside the chosen GPUs'
free memory, asks before starting one that does not fit, and launches a dataset that has
only the CPU plans (nnuiCPUPlans)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from test_tui_board import open_board, settled
from tui_fixtures import DATASET, make_roots, tui_app, use_fake_trainer, wait_for

from app.services.launch.catalog import ConfigurationInfo, memory_check, read_configurations

GIB = 1024**3


def _snapshot(free_gb: dict[str, float]) -> SimpleNamespace:
    gpus = {
        g: SimpleNamespace(memory_used_bytes=int((80 - f) * GIB), memory_total_bytes=80 * GIB)
        for g, f in free_gb.items()
    }
    return SimpleNamespace(gpu=lambda index: gpus.get(str(index)))


def test_memory_check_puts_the_estimate_beside_the_free_memory_and_names_misfits():
    config = ConfigurationInfo("3d_fullres", (128, 128, 128), 4, gpu_memory_gb=20.0)
    line, misfit = memory_check(config, ["0"], _snapshot({"0": 30.0}))
    assert line == (
        "3d_fullres needs about 20.0 GB per GPU (nnU-Net's estimate, batch 4); GPU 0 30.0 GB free"
    )
    assert misfit is None
    # DDP over two GPUs: half the batch each; GPU 1 has too little.
    line, misfit = memory_check(config, ["0", "1"], _snapshot({"0": 30.0, "1": 8.0}))
    assert "needs about 10.0 GB per GPU" in line
    assert misfit == "3d_fullres needs about 10.0 GB per GPU but GPU 1 has 8.0 GB free"
    assert memory_check(ConfigurationInfo("2d", (64, 64), 2), ["0"], None) == (None, None)
    assert memory_check(config, [], None) == (None, None)  # CPU: nothing to compare


def test_catalog_reads_the_estimate_and_the_cascade_entry(tmp_path: Path):
    plans = {"configurations": {
        "3d_fullres": {"patch_size": [64, 64, 64], "batch_size": 2, "gpu_memory_estimate_gb": 7.5},
        "3d_cascade_fullres": {"inherits_from": "3d_fullres", "previous_stage": "3d_lowres"},
    }}  # fmt: skip
    (tmp_path / "nnuiPlans.json").write_text(json.dumps(plans))
    assert read_configurations(tmp_path) == (
        ConfigurationInfo("3d_fullres", (64, 64, 64), 2, gpu_memory_gb=7.5),
        # nnU-Net's cascade entry: 3d_fullres's data and network, after 3d_lowres's folds
        ConfigurationInfo("3d_cascade_fullres", (64, 64, 64), 2, "3d_lowres", 7.5),
    )


async def test_a_cpu_plans_only_dataset_launches_and_a_misfit_is_asked_first(
    tmp_path: Path, monkeypatch
) -> None:
    roots = make_roots(tmp_path)
    folder = roots.preprocessed / DATASET
    (folder / "nnuiPlans.json").unlink()  # preprocessed only with -pl nnuiCPUPlanner
    block = {"patch_size": [32, 64, 64], "batch_size": 2, "gpu_memory_estimate_gb": 500.0}
    plans = {"plans_name": "nnuiCPUPlans", "configurations": {"3d_fullres": block}}
    (folder / "nnuiCPUPlans.json").write_text(json.dumps(plans))
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        assert screen.query_one("#picker").current.plans == "nnuiCPUPlans"
        await pilot.press("space")
        await settled(screen, pilot, {"0": ["0"]})
        await wait_for(lambda: screen.memory_lines, pilot)
        assert screen.problems == [] and len(screen.plans) == 1
        assert "-p nnuiCPUPlans" in screen.preview_text
        [line] = screen.memory_lines
        assert line.startswith("3d_fullres needs about 500.0 GB per GPU") and "GPU 0 " in line
        assert any("needs about 500.0 GB per GPU but GPU 0 has" in c for c in screen.confirmations)


async def test_the_form_queues_a_cascade_fold_after_the_lowres_folds(tmp_path: Path, monkeypatch):
    """3d_cascade_fullres picked on the form: its jobs wait for the 3d_lowres folds' inputs,
    as `nnui launch ... --after-lowres` (the preview says so)."""
    roots = make_roots(tmp_path)
    path = roots.preprocessed / DATASET / "nnuiPlans.json"
    plans = json.loads(path.read_text())
    full = plans["configurations"]["3d_fullres"]
    plans["configurations"]["3d_lowres"] = {**full, "next_stage": "3d_cascade_fullres"}
    plans["configurations"]["3d_cascade_fullres"] = {
        "inherits_from": "3d_fullres", "previous_stage": "3d_lowres"}  # fmt: skip
    path.write_text(json.dumps(plans))
    use_fake_trainer(monkeypatch, roots, tmp_path / "state")
    app = tui_app(roots, tmp_path / "state")
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        picker = screen.query_one("#picker")
        row = next(i for i, c in enumerate(picker.choices)
                   if c.configuration == "3d_cascade_fullres")  # fmt: skip
        picker.move_cursor(row=row)
        await wait_for(lambda: picker.current.configuration == "3d_cascade_fullres", pilot)
        await pilot.press("space")
        await settled(screen, pilot, {"0": ["0"]})
        await wait_for(lambda: screen.plans, pilot)
        assert all(p.schedule.after_previous_stage for p in screen.plans)
        assert "previous stage's folds wrote its inputs" in screen.preview_text
