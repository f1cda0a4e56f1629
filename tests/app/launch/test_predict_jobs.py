"""Predictions as nnui jobs: `nnui predict` on several (simulated) GPUs, one part each, under
the supervisor; followed by `nnui status`, stopped after the current case by `nnui stop`,
completed by `nnui resume` (--continue_prediction); bad input refused before any job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from fake_trainer import cleanup_jobs, wait_until
from fold_checkpoint import write_checkpoint
from test_cli import nnui
from test_cli import status as rows

from app.services.jobs.case_progress import CaseProgress
from app.services.jobs.registry import PREDICT, Job, Registry
from app.services.jobs.views import JobTracker
from trainer.schema.events import encode_event, validate_event
from trainer.schema.tree import CONSOLE_FILE, EVENTS_FILE, IMAGE_ENDINGS, Roots

ROOT = Path(__file__).resolve().parents[3]
CASES = ("demo_000", "demo_001", "demo_002", "demo_003")
GATED_PREDICT = Path(__file__).resolve().parents[2] / "gated_predict.py"


@pytest.fixture(scope="module")
def trained(demo_preprocessed, tmp_path_factory):
    """A 2d fold 0 checkpoint and an input folder with four demo images."""
    root = tmp_path_factory.mktemp("predict_jobs")
    results = root / "results"
    write_checkpoint(demo_preprocessed, results, "2d", "0", seed=0)
    images = root / "imagesTs"
    images.mkdir()
    raw = demo_preprocessed.raw / demo_preprocessed.dataset_name / "imagesTr"
    for case in CASES:
        shutil.copy(raw / f"{case}_0000.nii.gz", images)
    return {"demo": demo_preprocessed, "results": results, "images": images}


@pytest.fixture
def env(trained, tmp_path):
    values = {**os.environ}
    values.pop("CUDA_VISIBLE_DEVICES", None)
    values.update({
        "NNUI_STATE_DIR": str(tmp_path / "state"),
        "nnUNet_raw": str(trained["demo"].raw),
        "nnUNet_preprocessed": str(trained["demo"].preprocessed),
        "nnUNet_results": str(trained["results"]),
        "PYTHONPATH": str(ROOT),
    })  # fmt: skip
    try:
        yield values
    finally:
        cleanup_jobs(tmp_path / "state")


def predict(env: dict, trained: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return nnui(env, "predict", "-i", str(trained["images"]), "-o", str(out), "-d", "900",
                "-c", "2d", "-f", "0", "--disable_tta", *extra)  # fmt: skip


def job_ids(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line.split()[0] for line in result.stdout.splitlines() if " predict part " in line]


def events(state: Path, job_id: str) -> list[dict]:
    path = state / "predictions" / job_id / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def predicted_cases(state: Path, job_id: str) -> list[str]:
    return [e["case"] for e in events(state, job_id) if e["kind"] == "case_predicted"]


def outputs(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name != "nnui_prediction.json")


@pytest.mark.slow
def test_two_gpus_two_parts_every_case_once(env, trained, tmp_path) -> None:
    out = tmp_path / "out"
    result = predict(env, trained, out, "--simulate-gpus", "2", "--gpus", "0,1")
    first, second = job_ids(result)
    state = Path(env["NNUI_STATE_DIR"])
    assert wait_until(lambda: all(r["exit_code"] is not None for r in rows(env).values()), 240)
    table = rows(env)
    for part_id, job_id in enumerate((first, second)):
        row = table[job_id]
        assert (row["kind"], row["state"], row["exit_code"]) == ("predict", "finished", 0)
        assert (row["part_id"], row["num_parts"], row["gpus"]) == (part_id, 2, [str(part_id)])
        assert (row["cases_done"], row["num_cases"]) == (2, 2)
        job = Registry(state).get(job_id)
        assert job.argv[job.argv.index("-num_parts") + 1] == "2"
        assert job.argv[job.argv.index("-part_id") + 1] == str(part_id)
        assert "-device" in job.argv and job.argv[job.argv.index("-device") + 1] == "cpu"
        assert "CUDA_VISIBLE_DEVICES" not in job.env  # simulated GPUs run on the CPU
    done = predicted_cases(state, first) + predicted_cases(state, second)
    assert sorted(done) == sorted(CASES)  # every case exactly once, over both parts
    assert outputs(out) == sorted(f"{c}.nii.gz" for c in CASES)
    assert not list(out.glob("*events*")) and not (out / CONSOLE_FILE).exists()
    text = nnui(env, "status").stdout
    assert "predict 1/2" in text and "2/2 cases" in text


@pytest.mark.slow
def test_stop_ends_after_the_current_case_and_resume_does_the_rest(env, trained, tmp_path):
    out, gate = tmp_path / "out", tmp_path / "gate"
    env.update({"NNUI_PREDICT_SCRIPT": str(GATED_PREDICT), "NNUI_TEST_GATE": str(gate)})
    (job_id,) = job_ids(predict(env, trained, out, "--simulate-gpus", "1", "--gpus", "0"))
    # The predictor holds after writing its first case: the stop arrives mid-prediction.
    assert wait_until(lambda: len(list(out.glob("*.nii.gz"))) == 1, 240)
    assert wait_until(lambda: rows(env)[job_id]["state"] == "running", 120)
    stop = nnui(env, "stop", job_id, "--yes")
    assert stop.returncode == 0, stop.stderr
    assert "SIGUSR1 to" in stop.stdout and "current case" in stop.stdout
    state = Path(env["NNUI_STATE_DIR"])
    sent = [s for s in Registry(state).get(job_id).signals if s.result == "sent"]
    # The predictor itself (the supervisor's child) got it, nothing else.
    assert [s.pid for s in sent] == [Registry(state).get(job_id).process("trainer").pid]
    gate.touch()
    assert wait_until(lambda: rows(env)[job_id]["exit_code"] is not None, 240)
    row = rows(env)[job_id]
    assert (row["state"], row["exit_code"]) == ("stopped", 0)
    done = predicted_cases(state, job_id)
    assert 1 <= len(done) < len(CASES)  # the case begun was finished, the rest left
    assert outputs(out) == sorted(f"{c}.nii.gz" for c in done)  # whole files only
    stopped = [e for e in events(state, job_id) if e["kind"] == "stopped"]
    assert stopped and stopped[0]["num_done"] == len(done)

    resumed = nnui(env, "resume", job_id)
    (again,) = job_ids(resumed)
    assert wait_until(lambda: rows(env)[again]["exit_code"] is not None, 240)
    assert (rows(env)[again]["state"], rows(env)[again]["exit_code"]) == ("finished", 0)
    assert "--continue_prediction" in Registry(state).get(again).argv
    assert sorted(done + predicted_cases(state, again)) == sorted(CASES)
    started = next(e for e in events(state, again) if e["kind"] == "prediction_started")
    assert started["num_skipped"] == len(done)
    assert outputs(out) == sorted(f"{c}.nii.gz" for c in CASES)


def _bad_inputs(trained: dict, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    images, out = str(trained["images"]), str(tmp_path / "out")
    theirs = tmp_path / "nnunet_predictions"  # an nnUNetv2_predict output folder
    theirs.mkdir()
    (theirs / "predict_from_raw_data_args.json").write_text("{}")
    base = ["-d", "900", "-c", "2d", "--simulate-gpus", "2", "--gpus", "0,1"]
    return {
        "missing input": (["-i", str(tmp_path / "nope"), "-o", out, *base], "does not exist"),
        "empty input": (["-i", str(empty), "-o", out, *base], "holds no images"),
        "out is in": (["-i", images, "-o", images, *base], "is the input folder"),
        "no checkpoint": (["-i", images, "-o", out, *base, "-f", "0", "3"], "fold 3 has no"),
        "bad fold": (["-i", images, "-o", out, *base, "-f", "7"], "folds are 0-4"),
        "unknown gpu": (
            [
                "-i",
                images,
                "-o",
                out,
                "-d",
                "900",
                "-c",
                "2d",
                "--simulate-gpus",
                "2",
                "--gpus",
                "0,5",
            ],
            "GPU 5 does not exist",
        ),
        "no dataset": (["-i", images, "-o", out, "-d", "901", "-c", "2d", "--cpu"], "901"),
        "nnU-Net's output": (["-i", images, "-o", str(theirs), *base], "nnU-Net's files"),
    }


def test_bad_input_is_refused_with_exit_2_and_no_job(env, trained, tmp_path) -> None:
    for name, (args, words) in _bad_inputs(trained, tmp_path).items():
        result = nnui(env, "predict", *args)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], name
        assert "Traceback" not in result.stderr
    assert Registry(Path(env["NNUI_STATE_DIR"])).list() == []
    assert not (tmp_path / "out").exists()
    assert [p.name for p in (tmp_path / "nnunet_predictions").iterdir()] == [
        "predict_from_raw_data_args.json"
    ]


def test_a_second_prediction_into_a_busy_folder_is_refused(trained, tmp_path) -> None:
    from app.services.jobs.registry import ProcessRecord
    from app.services.launch import prediction
    from app.services.machine.procs import process_identity

    registry = Registry(tmp_path / "state")
    ticks, created = process_identity(os.getpid())  # a live "supervisor": this test
    out = tmp_path / "out"
    record = ProcessRecord(os.getpid(), created or time.time(), "supervisor", None, ticks)
    registry.add(_job(tmp_path, output_dir=str(out), processes=[record], created_at=0.0))
    demo = trained["demo"]
    roots = Roots(demo.raw, demo.preprocessed, trained["results"])
    request = prediction.PredictRequest(trained["images"], out, "900", "2d", ("0",), ("0",),
                                        device="cpu", simulated=True)  # fmt: skip
    checks = prediction.check_prediction(request, roots, registry)
    assert checks.usage_errors == [] and "j1 is already predicting into" in checks.errors[0]
    plans = prediction.plan_prediction(request, roots, registry, checks.dataset_name)
    with pytest.raises(prediction.claims.ClaimRefused, match="already predicting"):
        prediction.start_prediction(plans, registry)
    assert [j.job_id for j in registry.list()] == ["j1"]  # nothing of the second started


def test_dry_run_prints_one_command_per_part_and_starts_nothing(env, trained, tmp_path):
    result = predict(env, trained, tmp_path / "out", "--simulate-gpus", "3", "--gpus", "0,2",
                     "--dry-run", "--", "-step_size", "0.75")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    for part_id, line in enumerate(lines):
        assert f"-num_parts 2 -part_id {part_id}" in line and "-step_size 0.75" in line
        assert "--events" in line and str(tmp_path / "out") in line
    assert Registry(Path(env["NNUI_STATE_DIR"])).list() == []


# ---- units: the registry record and the view of a prediction job ----------------------


def _job(tmp_path: Path, **changes) -> Job:
    folder = tmp_path / "predictions" / "j1"
    fields = dict(
        job_id="j1", created_at=time.time() - 60, dataset="Dataset900_NnuiDemo",
        configuration="2d", fold="0", mode="single", device="cpu", gpus=["0"],
        simulated=True, argv=["python"], env={}, run_dir=str(folder),
        console_path=str(folder / "console.log"), kind=PREDICT, part_id=1, num_parts=2,
        output_dir="/o",
    )  # fmt: skip
    fields.update(changes)
    return Job(**fields)


def test_prediction_fields_round_trip_and_old_records_read_as_trainings(tmp_path) -> None:
    job = _job(tmp_path)
    assert Job.from_dict(json.loads(json.dumps(job.to_dict()))) == job
    old = {k: v for k, v in job.to_dict().items()
           if k not in ("kind", "part_id", "num_parts", "output_dir")}  # fmt: skip
    assert Job.from_dict(old).kind == "train"
    for key, value in (("kind", "infer"), ("part_id", -1), ("num_parts", 0)):
        with pytest.raises(ValueError, match=key):
            Job.from_dict({**job.to_dict(), key: value})


def test_view_of_a_stopped_prediction_has_cases_speed_and_state(tmp_path) -> None:
    registry = Registry(tmp_path / "state")
    job = _job(tmp_path, exit_code=0, ended_at=time.time())
    registry.add(job)
    t = job.created_at + 1
    records = [
        ("prediction_started", {"num_cases": 4, "num_skipped": 1, "part_id": 1, "num_parts": 2}),
        ("topology", {"ranks": [{"pid": 4242, "global_rank": 0}]}),
        ("case_predicted", {"case": "a", "index": 1, "num_cases": 4, "seconds": 9.0}),
        ("case_predicted", {"case": "b", "index": 2, "num_cases": 4, "seconds": 9.0}),
        ("case_predicted", {"case": "c", "index": 3, "num_cases": 4, "seconds": 9.0}),
        ("stop_requested", {"num_done": 3}),
        ("stopped", {"num_done": 3, "num_cases": 4, "reason": "SIGUSR1"}),
    ]
    folder = Path(job.run_dir)
    folder.mkdir(parents=True)
    lines = [encode_event(kind, t=t + 2 * i, **f) for i, (kind, f) in enumerate(records)]
    (folder / EVENTS_FILE).write_text("".join(lines))
    (view,) = JobTracker(registry).refresh()
    assert view.state == "stopped"
    assert (view.cases_done, view.num_cases) == (4, 5)  # the one skipped counts as done
    assert view.seconds_per_case == pytest.approx(2.0)  # between cases, not the 9 s each
    assert view.eta_s is None  # ended: nothing left to wait for


def test_case_progress_eta_is_cases_left_times_the_pace() -> None:
    progress = CaseProgress()
    progress.absorb({"kind": "prediction_started", "t": 0.0, "num_cases": 10, "num_skipped": 2})
    assert (progress.num_done, progress.num_cases, progress.eta_s()) == (2, 12, None)
    for index, t in enumerate((5.0, 8.0, 11.0), start=1):
        progress.absorb({"kind": "case_predicted", "t": t, "case": f"c{index}", "index": index,
                         "seconds": 4.5})  # fmt: skip
    assert progress.seconds_per_case == pytest.approx(3.0)
    assert progress.eta_s() == pytest.approx((12 - 5) * 3.0)


def test_the_apps_image_endings_are_the_trainers() -> None:
    from trainer.data.image_io import SUPPORTED_ENDINGS

    assert IMAGE_ENDINGS == SUPPORTED_ENDINGS


def test_sigusr1_in_process_writes_the_current_case_then_stops_with_events(
    trained, tmp_path, monkeypatch, capsys
) -> None:
    import signal

    from trainer import stop
    from trainer.inference import engine
    from trainer.inference.predict import main as predict_main

    real_write = engine.write_prediction

    def write_then_signal(*args, **kwargs):
        real_write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGUSR1)  # as `nnui stop` would, during the run

    monkeypatch.setattr(engine, "write_prediction", write_then_signal)
    out, events_file = tmp_path / "out", tmp_path / "job" / EVENTS_FILE
    argv = ["-i", str(trained["images"]), "-o", str(out), "-d", "900", "-c", "2d", "-f", "0",
            "--disable_tta", "-device", "cpu", "--preprocessed", str(trained["demo"].preprocessed),
            "--results", str(trained["results"]), "--events", str(events_file)]  # fmt: skip
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert predict_main(argv) == 0
    finally:
        stop.clear()
        signal.signal(signal.SIGUSR1, previous)
    records = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert all(validate_event(r) is None for r in records)
    kinds = [r["kind"] for r in records]
    assert kinds[:2] == ["prediction_started", "topology"] and kinds[-1] == "stopped"
    rank = records[1]["ranks"][0]
    assert rank["pid"] == os.getpid() and rank["sigusr1_handler"]
    done = [r["case"] for r in records if r["kind"] == "case_predicted"]
    assert 1 <= len(done) < len(CASES) and records[-1]["num_done"] == len(done)
    assert outputs(out) == sorted(f"{c}.nii.gz" for c in done)
    assert "stopped (SIGUSR1) after" in capsys.readouterr().out
