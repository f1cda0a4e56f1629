"""Folds on SLURM without a cluster: `nnui launch --slurm` (fake sbatch), the --requeue block
of the job script (its decision run in bash with fake SLURM clients), `nnui stop|kill|resume
slurm:JOB` (fake scontrol/scancel/sbatch/squeue that log their arguments) and a cluster
fold's row on the board (its run folder in the shared results tree).

The real cluster: tests/e2e/test_slurm_launch_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.services.jobs.slurm_jobs import SlurmJob, restarts_of, trains_in, with_job
from app.services.nnunet.runs import TrainArgs
from app.services.slurm import folds
from app.services.slurm.requeue import requeue_parts, stop_mark
from app.services.slurm.script import JobSpec, render_script
from trainer.schema.status import State
from trainer.schema.tree import DEFAULT_PLANS, DEFAULT_TRAINER

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nnui_cli import run_nnui

ROOT = Path(__file__).resolve().parents[2]

# A fake SLURM client: logs its argv to $FAKE_LOG, answers from $FAKE_DIR/<tool>-<arg1>.out
# (else <tool>.out) with the exit code in the matching .rc file (else 0).
FAKE = """#!/bin/bash
echo "$(basename "$0") $*" >> "$FAKE_LOG"
name="$FAKE_DIR/$(basename "$0")-$1"
[ -f "$name.out" ] || name="$FAKE_DIR/$(basename "$0")"
[ -f "$name.out" ] && cat "$name.out"
exit "$(cat "$name.rc" 2>/dev/null || echo 0)"
"""


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, str]:
    """PATH with fake sbatch, scancel, scontrol and squeue; the env for a subprocess."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for tool in ("sbatch", "scancel", "scontrol", "squeue"):
        (bin_dir / tool).write_text(FAKE)
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_DIR": str(bin_dir),
            "FAKE_LOG": str(tmp_path / "calls.log"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "PYTHONPATH": str(ROOT)}  # fmt: skip


def _answer(env: dict[str, str], tool: str, text: str, rc: int = 0) -> None:
    Path(env["FAKE_DIR"], f"{tool}.out").write_text(text)
    Path(env["FAKE_DIR"], f"{tool}.rc").write_text(str(rc))


def _calls(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_LOG"])
    return path.read_text().splitlines() if path.exists() else []


def test_expand_folds() -> None:
    assert folds.expand_folds("0-4") == ["0", "1", "2", "3", "4"]
    assert folds.expand_folds("1-2,4,1") == ["1", "2", "4", "1"]  # refused: fold 1 twice
    assert folds.expand_folds("all") == ["all"]
    assert folds.expand_folds("3-1") == ["3-1"]  # refused later as no fold


# ---- --requeue: the decision after the training step, run in bash --------------------------


def _after_step(tmp_path: Path, env: dict[str, str], heard_left: str, **extra: str) -> str:
    """Run the --requeue prelude and after-step block (lead 120 s, window 180 s) with the
    training step replaced by `rc=0` and a checkpoint_latest written (or not) meanwhile."""
    folder = tmp_path / "fold_0"
    folder.mkdir(exist_ok=True)
    script = tmp_path / "out" / "job.sbatch"
    latest = folder / "checkpoint_latest.x"
    names = ("checkpoint_final.safetensors", latest.name)
    _, prelude, _, after = requeue_parts(True, script, folder, names, 120)
    wrote = "sleep 1.1; touch " + str(latest) if extra.pop("progress", "1") == "1" else ":"
    text = f"{prelude}\n{wrote}\nheard_left={heard_left}\nrc=0\n{after}"
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60,
                          env={**env, "SLURM_JOB_ID": "41", **extra})  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_requeue_submits_itself_at_the_lead_and_moves_dependents(tmp_path, fakes) -> None:
    _answer(fakes, "sbatch", "42\n")
    _answer(fakes, "squeue", "50|afterok:41(unfulfilled),afterok:39(unfulfilled)\n51|afterok:7\n")
    log = _after_step(tmp_path, fakes, "150", NNUI_RESTARTS="2")
    assert "requeued as job 42 (restart 3)" in log, log
    (sbatch,) = [c for c in _calls(fakes) if c.startswith("sbatch")]
    assert "--dependency=afterany:41" in sbatch and "NNUI_RESTARTS=3" in sbatch
    assert "--comment=nnui-restarts=3" in sbatch and sbatch.endswith("job.sbatch")
    updates = [c for c in _calls(fakes) if c.startswith("scontrol update")]
    assert updates == ["scontrol update JobId=50 Dependency=afterok:42,afterok:39"]


@pytest.mark.parametrize(
    ("heard_left", "extra", "why"),
    [
        ("", {}, "no USR1: the step ended by itself"),
        ("400", {}, "USR1 long before the limit: a user's stop"),
        ("150", {"mark": "1"}, "nnui stop left its mark"),
        ("150", {"final": "1"}, "the fold finished"),
        ("150", {"progress": "0", "NNUI_IDLE": "2"}, "a third job in a row without an epoch"),
    ],
)
def test_requeue_does_not_resubmit(tmp_path, fakes, heard_left, extra, why) -> None:
    _answer(fakes, "sbatch", "42\n")
    if extra.pop("mark", None):
        (tmp_path / "out").mkdir()
        stop_mark(tmp_path / "out" / "job.sbatch", "41").write_text("1\n")
    if extra.pop("final", None):
        (tmp_path / "fold_0").mkdir()
        (tmp_path / "fold_0" / "checkpoint_final.safetensors").write_text("")
    _after_step(tmp_path, fakes, heard_left or '""', **extra)
    assert not [c for c in _calls(fakes) if c.startswith("sbatch")], why


@pytest.mark.parametrize(
    ("heard_left", "epochs", "time_left", "mark", "relayed"),
    [
        ("", 0, 1000, False, True),  # no lead heard: a user's stop, at once
        ("400", 0, 1000, False, True),  # long before the limit: a user's stop
        ("150", 0, 150, False, False),  # the lead during the start-up: wait for an epoch
        ("150", 1, 150, False, True),  # an epoch trained in this job: now
        ("150", 0, 50, False, True),  # less than half the lead left: now
        ("150", 0, 150, True, True),  # nnui stop's mark: a stop, at once
    ],
)  # fmt: skip
def test_a_lead_usr1_waits_for_the_jobs_first_epoch(
    tmp_path, fakes, heard_left, epochs, time_left, mark, relayed
) -> None:
    folder = tmp_path / "fold_0"
    folder.mkdir()
    script = tmp_path / "job.sbatch"
    _, prelude, may_stop, _ = requeue_parts(True, script, folder, ("f", "l"), 120)
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + time_left))
    _answer(fakes, "scontrol", f"JobId=41 JobState=RUNNING EndTime={end} Partition=x\n")
    if mark:
        stop_mark(script, "41").write_text("1\n")
    epoch = '{"v":1,"t":1,"kind":"epoch_ended","epoch":0}\n'
    text = (f"{prelude}\n" + f"echo '{epoch.strip()}' >> {folder}/events.jsonl\n" * epochs
            + f"heard_left={heard_left or chr(34) * 2}\ntrue{may_stop}")  # fmt: skip
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, timeout=60,
                          env={**fakes, "SLURM_JOB_ID": "41"})  # fmt: skip
    assert (done.returncode == 0) == relayed, done.stderr


def test_requeue_script_is_valid_bash_and_plain_without_it(tmp_path) -> None:
    spec = JobSpec(dataset="900", configuration="2d", fold="0", nodes=1, gpus_per_node=0,
                   time_limit="00:30:00", procs_per_node=1, output_dir=tmp_path,
                   run_folder=tmp_path / "fold_0")  # fmt: skip
    plain = render_script(spec)
    assert "NNUI_RESTARTS" not in plain and "trap 'stop=1' USR1" in plain
    text = render_script(replace(spec, requeue=True))
    path = tmp_path / "r.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "heard_left=$(nnui_time_left)" in text and "-le 660 ]" in text
    with pytest.raises(ValueError, match="--requeue needs the fold's run folder"):
        replace(spec, requeue=True, run_folder=None).validate()


# ---- nnui launch --slurm ---------------------------------------------------------------------


def _demo_tree(tmp_path: Path) -> Path:
    """A preprocessed root with Dataset900_Demo's 2d plans (what the launch checks)."""
    pre = tmp_path / "pre"
    (pre / "Dataset900_Demo").mkdir(parents=True)
    plans = {"configurations": {"2d": {}, "3d_fullres": {}}}
    (pre / "Dataset900_Demo" / "nnuiPlans.json").write_text(json.dumps(plans))
    return pre


def _launch(env, tmp_path: Path, *args: str):
    return run_nnui(env, "launch", "900", "2d", "--preprocessed", str(_demo_tree(tmp_path)),
                    "--results", str(tmp_path / "res"), "--slurm-output",
                    str(tmp_path / "out"), *args)  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--folds", "0", "--slurm"], "--slurm needs --time"),
        (["--folds", "0", "--slurm", "--time", "1:00:00", "--gpus", "0"], "--gpus is for this"),
        (["--folds", "7", "--slurm", "--time", "1:00:00"], "fold '7' is not one of"),
        (["--folds", "0-1,1", "--slurm", "--time", "1:00:00"], "fold 1 is given twice"),
        (["--folds", "0", "--slurm", "--time", "90"], "--time must look like"),
        (["--folds", "0", "--slurm", "--time", "1:00:00", "--cpu", "--gpus-per-node", "2"],
         "--cpu and --gpus-per-node"),
    ],
)  # fmt: skip
def test_launch_slurm_usage_errors(fakes, tmp_path, args, message) -> None:
    done = _launch(fakes, tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not _calls(fakes)


def test_launch_slurm_submits_one_job_per_fold(fakes, tmp_path) -> None:
    _answer(fakes, "sbatch", "77\n")
    done = _launch(fakes, tmp_path, "--folds", "0-1", "--slurm", "--time", "02:00:00",
                   "--partition", "gpu", "--gpus-per-node", "2", "--nodes", "2",
                   "--account", "lab", "--", "--epochs", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:3] for line in lines] == [["slurm:77", "fold", "0"],
                                                     ["slurm:77", "fold", "1"]]  # fmt: skip
    calls = [c for c in _calls(fakes) if c.startswith("sbatch")]
    assert len(calls) == 2 and all(c.startswith("sbatch --parsable /") for c in calls)
    script = (tmp_path / "out" / "nnui_900_2d_1.sbatch").read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --nodes=2", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --account=lab", "--nproc_per_node=2", "--epochs 3",
                 f"export nnUNet_results={tmp_path / 'res'}"):  # fmt: skip
        assert line in script, line
    record = json.loads((tmp_path / "state" / "nnui" / "slurm" / "77.json").read_text())
    assert record["script"].endswith("nnui_900_2d_1.sbatch")


def test_launch_slurm_dry_run_previews_the_exact_script(fakes, tmp_path) -> None:
    done = _launch(fakes, tmp_path, "--folds", "0", "--slurm", "--time", "02:00:00",
                   "--dry-run", "--requeue")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# fold 0: ") and "#SBATCH --time=02:00:00" in done.stdout
    assert "NNUI_RESTARTS" in done.stdout
    assert not _calls(fakes) and not (tmp_path / "out").exists()


def test_lowres_dependency(monkeypatch, tmp_path) -> None:
    spec = JobSpec(
        dataset="900",
        configuration="3d_cascade_fullres",
        fold="0",
        nodes=1,
        gpus_per_node=1,
        time_limit="01:00:00",
        procs_per_node=1,
        run_folder=tmp_path / "Dataset900_D" / "T__P__3d_cascade_fullres" / "fold_0",
    )
    monkeypatch.setattr(folds, "missing_at", lambda *a: ("3d_lowres", [1, 3], None))

    def job(job_id: str, fold: str, configuration: str = "3d_lowres") -> SlurmJob:
        return SlurmJob(job_id, "RUNNING", "n", "None", "n1",
                        TrainArgs("900", configuration, fold))  # fmt: skip

    queued = [job("5", "1"), job("6", "3"), job("7", "2"), job("8", "1", "3d_fullres")]
    assert folds.lowres_dependency(spec, tmp_path, queued) == "afterok:5:6"
    with pytest.raises(ValueError, match=r"3d_lowres fold\(s\) 3 first"):
        folds.lowres_dependency(spec, tmp_path, queued[:1])


# ---- stop, kill, resume slurm:JOB -------------------------------------------------------------


def _job(env, tmp_path: Path, state: str, script_text: str) -> Path:
    script = tmp_path / "out" / "job.sbatch"
    script.parent.mkdir(exist_ok=True)
    script.write_text(script_text)
    _answer(env, "scontrol", f"JobId=41 JobState={state} Reason=None NodeList=n7 "
                             f"Command={script}\n")  # fmt: skip
    _answer(env, "scontrol-write", script_text)  # `scontrol write batch_script 41 -`
    return script


NNUI_SCRIPT = "#!/bin/bash\n# Written by nnui sbatch. Submit again to resume (--c)\n"


def test_stop_nnui_script_signals_its_batch_shell(fakes, tmp_path) -> None:
    script = _job(fakes, tmp_path, "RUNNING", NNUI_SCRIPT)
    done = run_nnui(fakes, "stop", "slurm:41", "--yes")
    assert done.returncode == 0, done.stderr
    assert "scancel --signal=USR1 --batch 41" in _calls(fakes)
    assert stop_mark(script, "41").exists()  # a --requeue script: a stop, not a time limit


def test_stop_own_script_without_relay_is_refused(fakes, tmp_path) -> None:
    _job(fakes, tmp_path, "RUNNING", "#!/bin/bash\nsrun python -m trainer 900 2d 0\n")
    done = run_nnui(fakes, "stop", "slurm:41", "--yes", "--results", str(tmp_path / "res"))
    assert done.returncode == 1, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert "not nnui's" in line and "nnui stop on the node that trains it (n7)" in line
    assert not [c for c in _calls(fakes) if c.startswith("scancel")]


def test_kill_cancels_and_pending_stop_cancels(fakes, tmp_path) -> None:
    _job(fakes, tmp_path, "RUNNING", NNUI_SCRIPT)
    assert run_nnui(fakes, "kill", "slurm:41", "--yes").returncode == 0
    _job(fakes, tmp_path, "PENDING", NNUI_SCRIPT)
    done = run_nnui(fakes, "stop", "slurm:41", "--yes")
    assert done.returncode == 0 and "cancelled pending" in done.stdout, done.stderr
    assert [c for c in _calls(fakes) if c.startswith("scancel")] == ["scancel 41", "scancel 41"]


def test_resume_submits_the_same_script(fakes, tmp_path) -> None:
    script = _job(fakes, tmp_path, "COMPLETED", NNUI_SCRIPT)
    _answer(fakes, "sbatch", "43\n")
    done = run_nnui(fakes, "resume", "slurm:41")
    assert done.returncode == 0 and done.stdout.startswith("slurm:43"), done.stderr
    assert f"sbatch --parsable {script}" in _calls(fakes)
    _answer(fakes, "squeue", f"43|{script}\n")  # already queued again: nothing to do
    done = run_nnui(fakes, "resume", "slurm:41")
    assert done.returncode == 3 and "slurm:43 already runs" in done.stdout
    _job(fakes, tmp_path, "RUNNING", NNUI_SCRIPT)
    assert run_nnui(fakes, "resume", "slurm:41").returncode == 3


def test_resume_refuses_a_script_that_is_not_nnuis(fakes, tmp_path) -> None:
    _job(fakes, tmp_path, "COMPLETED", "#!/bin/bash\nsrun python -m trainer 900 2d 0\n")
    done = run_nnui(fakes, "resume", "slurm:41")
    assert done.returncode == 1 and "not nnui's script" in done.stderr, done.stderr


# ---- the board: a fold on another node is the row of its run folder ---------------------------


def test_trains_in_matches_the_run_folder(tmp_path) -> None:
    folder = str(tmp_path / "Dataset900_Demo" / "nnuiTrainer__nnuiPlans__2d" / "fold_1")
    nnui = {"trainer": DEFAULT_TRAINER, "plans": DEFAULT_PLANS}  # what nnui-train's parse gives
    assert trains_in(TrainArgs("900", "2d", "1", **nnui), folder)
    assert trains_in(TrainArgs("Dataset900_Demo", "2d", "1", results=str(tmp_path), **nnui), folder)
    assert not trains_in(TrainArgs("900", "2d", "1"), folder)  # nnU-Net's trainer and plans
    assert not trains_in(TrainArgs("900", "2d", "0", **nnui), folder)
    assert not trains_in(TrainArgs("901", "2d", "1", **nnui), folder)
    assert not trains_in(TrainArgs("900", "3d_fullres", "1", **nnui), folder)
    assert not trains_in(TrainArgs("900", "2d", "1", results="/elsewhere", **nnui), folder)
    assert restarts_of("nnui-restarts=3") == 3 and restarts_of("(null)") == 0


def test_a_fold_running_on_another_node_is_one_row(tmp_path) -> None:
    from app.services.jobs.registry import Job
    from app.services.jobs.views import JobView

    job = Job(job_id="run:9", created_at=time.time(), dataset="Dataset900_Demo",
              configuration="2d", fold="1", mode="torchrun", device="cpu", gpus=[],
              simulated=False, argv=[], env={}, run_dir=str(tmp_path / "fold_1"),
              console_path=os.devnull, ended_at=time.time())  # fmt: skip
    view = JobView(job=job, state=State.LOST, epoch=4, num_epochs=10, train_loss=None,
                   val_loss=None, mean_dice=None, ema_dice=None, it_per_s=None, eta_s=None,
                   alerts=(), topology=None, history=(), console_tail=(), exit_code=None,
                   mean_epoch_time_s=30.0)  # fmt: skip
    entry = SlurmJob("55", "RUNNING", "nnui_900_2d_1", "None", "gpu[3-4]",
                     TrainArgs("900", "2d", "1"), "nnui-restarts=2")  # fmt: skip
    row = with_job(view, entry, remote=True)
    assert (row.job.job_id, row.state, row.slurm_state) == ("slurm:55", State.RUNNING, "RUNNING")
    assert row.eta_s == 180.0 and len(row.job.restarts) == 2 and "gpu[3-4]" in row.job.note
    pending = with_job(replace(view, state=State.STOPPED), replace(entry, state="PENDING"), True)
    assert pending.state == State.QUEUED and pending.job.ended_at is None
