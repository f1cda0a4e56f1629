"""The launch board's cluster target (x): the form prefilled from the board, enter shows every
fold's exact job script, y submits one job per fold (a fake sbatch that logs its argv)."""

from __future__ import annotations

import os
from pathlib import Path

from tui_fixtures import make_roots, screen_of, tui_app, use_fake_trainer, wait_for

from app.screens.cluster_form import ClusterScreen
from app.screens.confirm import LaunchConfirmScreen
from app.screens.dashboard import DashboardScreen
from app.screens.launch import LaunchScreen
from app.services.slurm.script import JobSpec, render_script


async def test_x_submits_the_marked_folds_to_slurm(tmp_path: Path, monkeypatch) -> None:
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    fake_bin, log = tmp_path / "bin", tmp_path / "sbatch.log"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text(f'#!/bin/sh\necho "$*" >> {log}\necho 900$(wc -l < {log})\n')
    (fake_bin / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)  # the scripts go to ./nnui_slurm
    app = tui_app(roots, state, simulate_gpus=2)
    async with app.run_test(size=(150, 48)) as pilot:
        # l waits for the first GPU and the first jobs reading (a notice otherwise)
        await wait_for(lambda: app.snapshot is not None and app.num_jobs_messages >= 1, pilot)
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("l")
        board = await screen_of(app, pilot, LaunchScreen)
        await wait_for(lambda: board.query_one("#picker").choices, pilot)
        await pilot.press("space", "down", "space")  # folds 0 and 1
        await wait_for(lambda: len(board.query_one("#board").model.assignments) == 2, pilot)
        await pilot.press("x")
        form = await screen_of(app, pilot, ClusterScreen)
        assert form.defaults.folds == ("0", "1")
        form.query_one("#cl-partition").value = "gpu"
        form.query_one("#cl-time").value = "90"
        await pilot.press("enter")  # a bad time limit: one line, nothing submitted
        await wait_for(lambda: form.num_reviews == 1, pilot)
        assert "--time must look like" in str(form.query_one("#cl-problems").render())
        form.query_one("#cl-time").value = "2-00:00:00"
        await pilot.press("enter")
        confirm = await screen_of(app, pilot, LaunchConfirmScreen)
        preview = confirm.query_one("#launch-preview-text").render().plain
        for line in (
            "#SBATCH --partition=gpu",
            "#SBATCH --time=2-00:00:00",
            "#SBATCH --gpus-per-node=1",
            f"export nnUNet_results={roots.results}",
        ):
            assert line in preview, line
        assert preview.count("#!/bin/bash") == 2
        await pilot.press("y")
        await screen_of(app, pilot, DashboardScreen)
        await wait_for(lambda: form.submitted == ["9001", "9002"], pilot)
    calls = log.read_text().splitlines()
    assert [c.split()[-1] for c in calls] == [
        str(tmp_path / "nnui_slurm" / f"nnui_Dataset004_Demo_3d_fullres_{f}.sbatch") for f in "01"
    ]


FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> {log}
case "$(basename "$0") $1" in
  "squeue -h") echo "41|RUNNING|nnui_900_2d_0|None|n7|" ;;
  "scontrol write") cat {script} ;;
  "scontrol -o") echo "JobId=41 JobState=RUNNING Reason=None NodeList=n7 Command={script}" ;;
esac
"""


async def test_s_on_a_cluster_fold_sends_usr1_to_its_batch_shell(tmp_path: Path, monkeypatch):
    roots = make_roots(tmp_path)
    state = tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    fake_bin, log = tmp_path / "bin", tmp_path / "calls.log"
    fake_bin.mkdir()
    for tool in ("squeue", "scontrol", "scancel"):
        text = FAKE.format(log=log, script=tmp_path / "job.sbatch")
        (fake_bin / tool).write_text(text)
        (fake_bin / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    spec = JobSpec(dataset="900", configuration="2d", fold="0", nodes=1, gpus_per_node=0,
                   time_limit="01:00:00", procs_per_node=1)  # fmt: skip
    (tmp_path / "job.sbatch").write_text(render_script(spec))
    app = tui_app(roots, state, simulate_gpus=1)
    async with app.run_test(size=(150, 48)) as pilot:
        await wait_for(lambda: app.view_of("slurm:41") is not None, pilot)
        dashboard = await screen_of(app, pilot, DashboardScreen)
        table = dashboard.query_one("#jobs")
        table.move_cursor(row=table.get_row_index("slurm:41"))
        await pilot.press("s")
        confirm = await screen_of(app, pilot, LaunchConfirmScreen)
        assert "scancel --signal=USR1 --batch" in str(confirm.title_text)
        await pilot.press("y")
        await wait_for(lambda: "scancel --signal=USR1 --batch 41" in log.read_text(), pilot)
    assert (tmp_path / "job.sbatch.stop-41").exists()
