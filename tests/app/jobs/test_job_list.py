"""The job list after weeks: one row per run folder (a resume continues its row), grouped by
dataset x configuration x trainer, filter and sort (CLI and dashboard), `nnui forget`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tui_fixtures import make_roots, tui_app, wait_for, write_frozen_runs

from app.main import main
from app.screens.dashboard import DashboardScreen
from app.services.jobs import listing as job_list
from app.services.jobs.registry import Job, ProcessRecord, Registry
from app.services.jobs.views import JobTracker
from app.services.machine.procs import proc_info
from app.widgets.job_table import JobTable
from trainer.schema.events import encode_event

NOW = time.time()
_ME = proc_info(os.getpid())
ALIVE = ProcessRecord(_ME.pid, _ME.create_time, "supervisor", None, _ME.start_ticks)


def add_job(registry: Registry, tmp: Path, job_id: str, fold: str, **changes) -> Job:
    trainer = changes.pop("trainer", "nnuiTrainer")
    dataset = changes.pop("dataset", "Dataset004_Demo")
    folder = tmp / "results" / dataset / f"{trainer}__nnuiPlans__3d_fullres" / f"fold_{fold}"
    folder.mkdir(parents=True, exist_ok=True)
    values = dict(
        job_id=job_id, created_at=NOW - 1000, dataset=dataset, configuration="3d_fullres",
        fold=fold, mode="single", device="cpu", gpus=[], simulated=False, argv=[], env={},
        run_dir=str(folder), console_path=str(folder / f"{job_id}.log"), exit_code=0,
        ended_at=NOW - 10,
    )  # fmt: skip
    values.update(changes)
    job = Job(**values)
    registry.add(job)
    return job


def ema_epoch(t: float, ema: float) -> str:
    return encode_event("epoch_ended", t=t, epoch=0, train_loss=0.5, ema_fg_dice=ema)


def jobs_of_weeks(tmp: Path) -> Registry:
    """Two datasets, two trainers, a fold stopped and resumed in its own folder."""
    registry = Registry(tmp / "state")
    add_job(registry, tmp, "a-f1", "1", created_at=NOW - 900)
    add_job(registry, tmp, "a-f0", "0", created_at=NOW - 800)
    add_job(registry, tmp, "a-f0-resumed", "0", created_at=NOW - 500, continue_training=True)
    add_job(registry, tmp, "b-f0", "0", created_at=NOW - 700, trainer="nnUNetTrainer_nnui")
    add_job(registry, tmp, "c-f0", "0", created_at=NOW - 600, dataset="Dataset003_Liver")
    for job_id, ema in (("a-f1", 0.9), ("a-f0-resumed", 0.7), ("b-f0", 0.8)):
        with open(Path(registry.get(job_id).run_dir) / "events.jsonl", "a") as handle:
            handle.write(encode_event("run_started", t=NOW - 400, num_epochs=2))
            handle.write(ema_epoch(NOW - 300, ema))
    return registry


def ids(views) -> list[str]:
    return [v.job.job_id for v in views]


def test_one_row_per_run_folder_grouped_sorted_and_filtered(tmp_path: Path) -> None:
    views = JobTracker(jobs_of_weeks(tmp_path)).refresh()
    assert len(views) == 5
    rows, earlier = job_list.one_row_per_run_folder(views)
    assert earlier["a-f0-resumed"] == ["a-f0"] and "a-f0" not in ids(rows)
    # Groups: (dataset, configuration, trainer); inside them folds in order by default.
    assert ids(job_list.arrange(views)) == ["c-f0", "b-f0", "a-f0-resumed", "a-f1"]
    assert ids(job_list.arrange(views, sort="Dice")) == ["c-f0", "b-f0", "a-f1", "a-f0-resumed"]
    assert ids(job_list.arrange(views, sort="newest"))[2:] == ["a-f0-resumed", "a-f1"]
    assert ids(job_list.arrange(views, "demo fold 1")) == ["a-f1"]
    assert ids(job_list.arrange(views, "NNUNETTRAINER")) == ["b-f0"]
    assert ids(job_list.arrange(views, "liver finished")) == ["c-f0"]
    assert job_list.next_sort(job_list.SORTS[-1]) == job_list.SORTS[0]


def test_a_filter_on_a_job_id_follows_the_fold_when_it_is_resumed(tmp_path: Path) -> None:
    """The filter typed the first job's id; the fold was resumed (a new job id): the row,
    now showing the resumed job, still matches. Without collapsing, only the job typed."""
    views = JobTracker(jobs_of_weeks(tmp_path)).refresh()
    assert ids(job_list.arrange(views, "a-f0")) == ["a-f0-resumed"]
    assert ids(job_list.arrange(views, "a-f0 0.7")) == []  # every word must match
    assert ids(job_list.arrange(views, "a-f0", collapse=False)) == ["a-f0", "a-f0-resumed"]
    assert ids(job_list.arrange(views, "a-f1")) == ["a-f1"]


def test_rows_of_two_results_trees_never_share_a_group(tmp_path: Path) -> None:
    """The same dataset, configuration, trainer and fold in two trees: two rows, each in
    its own tree's group (not interleaved by fold)."""
    registry = Registry(tmp_path / "state")
    add_job(registry, tmp_path, "a-f0", "0")
    add_job(registry, tmp_path, "a-f1", "1")
    add_job(registry, tmp_path / "projB", "b-f0", "0")
    views = JobTracker(registry).refresh()
    assert ids(job_list.arrange(views)) in (["a-f0", "a-f1", "b-f0"], ["b-f0", "a-f0", "a-f1"])
    groups = {job_list.group_key(v.job) for v in views}
    assert len(groups) == 2


def test_overlaid_folds_are_the_newest_of_the_same_trainer(tmp_path: Path) -> None:
    from app.screens.job_detail import fold_views

    registry = jobs_of_weeks(tmp_path)
    add_job(registry, tmp_path, "a-f2", "2", created_at=NOW - 50)
    views = JobTracker(registry).refresh()
    job = registry.get("a-f1")
    overlay = {label: v.job.job_id for label, v in fold_views(views, job, True).items()}
    # b-f0 is another trainer's fold 0; a-f0 was continued by a-f0-resumed
    assert overlay == {"fold 0": "a-f0-resumed", "fold 1": "a-f1", "fold 2": "a-f2"}


def test_the_new_keys_are_in_help_footer_and_palette() -> None:
    from app.screens.help import help_text
    from app.screens.keys import DASHBOARD_VIEW, DETAIL_NAV
    from app.screens.palette import COMMANDS

    for readonly in (False, True):
        text = help_text(readonly).plain
        assert "Filter" in text and "Sort" in text and "Smoothing" in text
    assert {"filter", "sort", "filter-clear"} <= {b.id for b in DASHBOARD_VIEW}
    assert any(b.key == "m" and b.action == "smooth" for b in DETAIL_NAV)
    assert {"filter", "sort"} <= {action for _, _, action, _ in COMMANDS}


def test_status_shows_a_resumed_fold_as_one_row_and_json_keeps_every_job(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    jobs_of_weeks(tmp_path)
    assert main(["status", "--results", str(tmp_path / "results")]) == 0
    table = capsys.readouterr().out
    assert "a-f0-resumed" in table and "a-f0 " not in table
    assert main(["status", "--all", "--results", str(tmp_path / "results")]) == 0
    assert "a-f0 " in capsys.readouterr().out  # --all: every job on its own row
    assert main(["status", "--json", "--results", str(tmp_path / "results")]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 5


def test_forget_hides_ended_jobs_keeps_results_and_refuses_running_ones(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("NNUI_STATE_DIR", str(tmp_path / "state"))
    registry = jobs_of_weeks(tmp_path)
    add_job(registry, tmp_path, "live-f2", "2", exit_code=None, ended_at=None, processes=[ALIVE])
    results = sorted(p.relative_to(tmp_path) for p in (tmp_path / "results").rglob("*"))

    def listed(*flags: str) -> set[str]:
        capsys.readouterr()  # what earlier commands printed
        assert main(["status", "--json", *flags, "--results", str(tmp_path / "results")]) == 0
        return {row["id"] for row in json.loads(capsys.readouterr().out)}

    assert main(["forget", "live-f2"]) == 1  # still running: stop it first
    assert "stop it first" in capsys.readouterr().err
    assert main(["forget", "a-f0-resumed"]) == 0  # the row: the resume and the earlier run
    assert "a-f0-resumed" in capsys.readouterr().out
    assert registry.get("a-f0").forgotten_at is not None
    assert listed() == {"a-f1", "b-f0", "c-f0", "live-f2"}
    assert listed("--all") >= {"a-f0", "a-f0-resumed"}
    assert main(["status", "--json", "--all", "--results", str(tmp_path / "results")]) == 0
    forgotten = {r["id"] for r in json.loads(capsys.readouterr().out) if r["forgotten"]}
    assert forgotten == {"a-f0", "a-f0-resumed"}
    hidden = JobTracker(registry, include_forgotten=False).refresh()  # what the TUI reads
    assert set(ids(hidden)) == {"a-f1", "b-f0", "c-f0", "live-f2"}
    assert main(["forget", "a-f0-resumed"]) == 3  # already forgotten
    assert main(["forget", "nope"]) == 2
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "results").rglob("*")) == results
    assert main(["forget", "a-f0-resumed", "--undo"]) == 0
    assert "a-f0" in listed()
    capsys.readouterr()


async def test_dashboard_filter_sort_and_forgotten_rows(tmp_path: Path) -> None:
    roots = make_roots(tmp_path)
    state_dir = tmp_path / "state"
    frozen = write_frozen_runs(roots, state_dir)  # folds 0 finished, 1 stopped, 2 failed
    app = tui_app(roots, state_dir)
    async with app.run_test(size=(160, 45)) as pilot:
        await wait_for(lambda: app.screen.query_one(JobTable).row_count == 3, pilot)
        screen = app.screen
        assert isinstance(screen, DashboardScreen)
        table = screen.query_one(JobTable)

        def order() -> list[str]:
            return [row.key.value for row in table.ordered_rows]

        assert order() == frozen
        await pilot.press("o", "o")  # fold -> newest -> state: failed, stopped, finished
        await wait_for(lambda: order() == [frozen[2], frozen[1], frozen[0]], pilot)
        assert "sort: state" in str(table.border_title)
        await pilot.press("slash", *"stopped", "enter")
        await wait_for(lambda: order() == [frozen[1]], pilot)
        assert app.focused is table and "filter: 'stopped'" in str(table.border_title)
        await pilot.press("escape")
        await wait_for(lambda: len(order()) == 3, pilot)
        Registry(state_dir).update(frozen[0], forgotten_at=time.time())  # nnui forget
        await wait_for(lambda: order() == [frozen[2], frozen[1]], pilot)
