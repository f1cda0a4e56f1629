"""Launch plans (argv and environment per mode), the checks with their reasons, and real starts
under the supervisor (console.log, detached session, exit code, folds in turn on one GPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from fake_trainer import FAKE_TRAINER, cleanup_jobs, fake_env, make_preprocessed, wait_until

from app.services.jobs.registry import Registry
from app.services.launch import launcher
from app.services.launch import request as launch_request
from app.services.launch.launcher import plan_launch, preview
from app.services.launch.request import LaunchRequest, resume_request
from app.services.machine.gpus import GIB, GpuProcess, GpuSnapshot, MachineSnapshot
from app.services.machine.procs import proc_info
from trainer.schema.atomic import atomic_write_text
from trainer.schema.status import State, Status
from trainer.schema.tree import DEFAULT_PLANS, Roots, run_dir

ENTRY = ("-m", "trainer")


@pytest.fixture
def roots(tmp_path: Path) -> Roots:
    make_preprocessed(tmp_path / "pre", batch_size=4)
    return Roots(tmp_path / "raw", tmp_path / "pre", tmp_path / "res")


def request(**changes: object) -> LaunchRequest:
    values = dict(
        dataset="4", configuration="3d_fullres", folds=["0"], gpus=["0"], mode="per_gpu",
        device="cuda", trainer_args=[], simulated=False, trainer_entry=ENTRY,
    )  # fmt: skip
    values.update(changes)
    return LaunchRequest(**values)


PY = sys.executable
D, C = "Dataset004_Demo", "3d_fullres"

# (name, request changes, [(fold, argv tail after the python executable, CUDA_VISIBLE_DEVICES)])
ARGV_CASES = [
    ("one fold per GPU", dict(folds=["0", "1"], gpus=["0", "1"]), [
        ("0", ["-m", "trainer", D, C, "0", "-device", "cuda"], "0"),
        ("1", ["-m", "trainer", D, C, "1", "-device", "cuda"], "1"),
    ]),
    ("spawn group", dict(mode="spawn", gpus=["2", "3"]), [
        ("0", ["-m", "trainer", D, C, "0", "-device", "cuda", "-num_gpus", "2"], "2,3"),
    ]),
    ("torchrun group", dict(mode="torchrun", gpus=["0", "1"], trainer_args=["--epochs", "3"]), [
        ("0", ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "trainer", D, C, "0", "-device", "cuda", "--epochs", "3"], "0,1"),
    ]),
    ("cpu", dict(device="cpu", gpus=[], folds=["all"]), [
        ("all", ["-m", "trainer", D, C, "all", "-device", "cpu"], None),
    ]),
    ("simulated", dict(simulated=True, gpus=["1"]), [
        ("0", ["-m", "trainer", D, C, "0", "-device", "cpu"], None),
    ]),
    ("resume", dict(continue_training=True, trainer_args=["--epochs", "3"]), [
        ("0", ["-m", "trainer", D, C, "0", "-device", "cuda", "--epochs", "3", "--c"], "0"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "expected"), [c[1:] for c in ARGV_CASES], ids=[c[0] for c in ARGV_CASES]
)
def test_argv_and_env_per_mode(roots: Roots, changes: dict, expected: list) -> None:
    plans, problems = plan_launch(request(**changes), roots, 4)
    assert problems == []
    assert [(p.fold, p.argv[0], p.argv[1:]) for p in plans] == [(f, PY, a) for f, a, _ in expected]
    for plan, (fold, _, visible) in zip(plans, expected, strict=True):
        assert plan.env.get("CUDA_VISIBLE_DEVICES") == visible
        assert plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert plan.env["NNUI_JOB_ID"] == plan.job_id
        assert plan.env["nnUNet_results"] == str(roots.results)
        assert plan.run_dir == run_dir(roots.results, D, C, fold)
        assert plan.console_path == plan.run_dir / f"console.{plan.job_id}.1.log"
        assert isinstance(plan.argv, list)


def test_trainer_flags_choose_the_run_folder(roots: Roots) -> None:
    plans_file = roots.preprocessed / D / f"{DEFAULT_PLANS}.json"
    (roots.preprocessed / D / "MyPlans.json").write_text(plans_file.read_text())
    plans, _ = plan_launch(request(trainer_args=["-p", "MyPlans"]), roots, 4)
    assert plans[0].run_dir == run_dir(roots.results, D, C, "0", plans="MyPlans")


def test_sequential_folds_wait_for_each_other(roots: Roots) -> None:
    plans, problems = plan_launch(
        request(folds=["0", "1", "2"], gpus=["0", "1"], sequential=True), roots, 4
    )
    assert problems == []
    assert [(p.fold, p.gpus) for p in plans] == [("0", ["0"]), ("1", ["1"]), ("2", ["0"])]
    assert [p.after for p in plans] == [None, None, plans[0].job_id]
    assert plans[2].after and "after job" in preview(plans[2])


def test_sequential_ddp_group_queues_folds(roots: Roots) -> None:
    plans, problems = plan_launch(
        request(folds=["0", "1"], gpus=["0", "1"], mode="spawn", sequential=True), roots, 4
    )
    assert problems == [] and [p.after for p in plans] == [None, plans[0].job_id]


# (name, request changes, plans batch size, error fragment)
ERROR_CASES = [
    ("group larger than batch", dict(mode="spawn", gpus=["0", "1", "2", "3", "4"]), 4, "> global"),
    ("group does not divide batch", dict(mode="spawn", gpus=["0", "1", "2"]), 4, "not divisible"),
    ("group of one", dict(mode="torchrun", gpus=["0"]), 4, "at least 2"),
    ("two folds on one group", dict(mode="spawn", gpus=["0", "1"], folds=["0", "1"]), 4,
     "one fold at a time"),
    ("folds and GPUs do not pair", dict(folds=["0", "1", "2"], gpus=["0", "1"]), 4, "--sequential"),
    ("bad fold", dict(folds=["7"]), 4, "not one of"),
    ("unknown dataset", dict(dataset="9"), 4, "no dataset with id 009"),
    ("no GPU", dict(gpus=[]), 4, "no GPU chosen"),
    ("unknown mode", dict(mode="mpi"), 4, "unknown mode"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "batch", "fragment"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_refusals_with_reasons(roots: Roots, changes: dict, batch: int, fragment: str) -> None:
    plans, problems = plan_launch(request(**changes), roots, batch)
    assert plans == [] and any(fragment in p for p in problems), problems


def test_group_dividing_the_batch_is_fine(roots: Roots) -> None:
    plans, problems = plan_launch(request(mode="spawn", gpus=["0", "1", "2", "3"]), roots, 4)
    assert problems == [] and len(plans) == 1


def gpu(index: int, used_gib: int, util: int, users: tuple[str, ...] = ()) -> GpuSnapshot:
    processes = tuple(GpuProcess(100 + i, u, GIB, "python", False) for i, u in enumerate(users))
    return GpuSnapshot(index, "H100", f"GPU-{index}", used_gib * GIB, 80 * GIB, util, 40, 100.0,
                       processes)  # fmt: skip


def test_busy_and_foreign_gpus_are_warnings(roots: Roots) -> None:
    snapshot = MachineSnapshot(
        (gpu(0, 1, 5), gpu(1, 20, 0), gpu(2, 1, 50), gpu(3, 1, 0, ("alice",))), False, None, 0.0
    )
    checks = launch_request.check_request(
        request(folds=["0", "1", "2", "3"], gpus=["0", "1", "2", "3"]), roots, 4, snapshot
    )
    assert checks.errors == []
    assert [w.split(" is ")[0] for w in checks.warnings] == ["GPU 1", "GPU 2", "GPU 3"]
    assert "alice" in checks.warnings[2]
    missing = launch_request.check_request(request(gpus=["7"]), roots, 4, snapshot)
    assert any("not visible" in e for e in missing.errors)
    no_driver = MachineSnapshot((), False, "No NVIDIA driver found", 0.0)
    assert any(
        "--cpu" in e for e in launch_request.check_request(request(), roots, 4, no_driver).errors
    )


@pytest.mark.parametrize(
    ("state", "resume", "fragment"),
    [
        (State.STOPPED, False, "resume it"),
        (State.FAILED, False, "resume it"),
        (State.FINISHED, False, "already finished"),
        (State.STOPPED, True, None),
        (State.RUNNING, False, "already running"),  # pids alive: this test process
    ],
)
def test_fold_with_an_earlier_run(roots: Roots, state: str, resume: bool, fragment: str | None):
    folder = run_dir(roots.results, D, C, "0")
    folder.mkdir(parents=True)
    status = Status(state=state, epoch=3, pids=[os.getpid()])
    atomic_write_text(folder / "status.json", status.to_json())
    checks = launch_request.check_request(request(continue_training=resume), roots, 4)
    if fragment is None:
        assert checks.errors == []
    else:
        assert len(checks.errors) == 1 and fragment in checks.errors[0]
        assert (checks.resumable_folds == ["0"]) is (fragment == "resume it")


def test_resume_request_keeps_fold_gpus_and_mode(roots: Roots, tmp_path: Path) -> None:
    plans, _ = plan_launch(
        request(mode="torchrun", gpus=["2", "3"], trainer_args=["--c"]), roots, 4
    )
    registry = Registry(tmp_path / "state")
    from app.services.jobs.registry import Job

    job = Job(
        job_id=plans[0].job_id, created_at=0, dataset=D, configuration=C, fold="0",
        mode="torchrun", device="cuda", gpus=["2", "3"], simulated=False, argv=plans[0].argv,
        env=plans[0].env, run_dir="/r", console_path="/r/c", trainer_args=["--epochs", "3"],
    )  # fmt: skip
    registry.add(job)
    again = resume_request(registry.get(job.job_id))
    assert (again.folds, again.gpus, again.mode, again.continue_training) == (
        ["0"], ["2", "3"], "torchrun", True,
    )  # fmt: skip
    assert again.trainer_args == ["--epochs", "3"]


# ---- real starts ----------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    values = fake_env(tmp_path)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    try:
        yield values
    finally:
        cleanup_jobs(Path(values["NNUI_STATE_DIR"]))


def live_roots() -> Roots:
    from trainer.schema.tree import resolve_roots

    return resolve_roots()


def test_start_detaches_and_records_the_exit_code(env: dict) -> None:
    registry = Registry()
    req = request(device="cpu", gpus=[], trainer_entry=(str(FAKE_TRAINER),),
                  trainer_args=["--epochs", "3", "--epoch-time", "0.05"])  # fmt: skip
    plans, problems = plan_launch(req, live_roots(), 2, registry=registry)
    assert problems == []
    job = launcher.start(plans[0], registry)
    supervisor = job.process("supervisor")
    info = proc_info(supervisor.pid)
    assert info is not None and info.env_job_id == job.job_id
    assert os.getsid(supervisor.pid) == supervisor.pid  # its own session: survives a hang-up
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 15)
    done = registry.get(job.job_id)
    assert done.exit_code == 0 and done.ended_at >= done.created_at
    assert [p.role for p in done.processes] == ["supervisor", "trainer"]
    console = Path(done.console_path).read_text()
    assert f"[nnui] job {job.job_id}" in console and "epoch 2 loss" in console
    assert "trainer exited with code 0" in console
    # The claim went with the trainer: the fold is free for the next run.
    assert sorted(p.name for p in Path(done.run_dir).iterdir()) == [
        f"console.{job.job_id}.1.log", "events.jsonl", "status.json",
    ]  # fmt: skip


def test_failed_trainer_exit_code_is_recorded(env: dict) -> None:
    registry = Registry()
    req = request(device="cpu", gpus=[], trainer_entry=(str(FAKE_TRAINER),),
                  trainer_args=["--epochs", "5", "--epoch-time", "0.05",
                                "--fail-at", "1"])  # fmt: skip
    plans, _ = plan_launch(req, live_roots(), 2, registry=registry)
    job = launcher.start(plans[0], registry)
    assert wait_until(lambda: registry.get(job.job_id).exit_code is not None, 15)
    assert registry.get(job.job_id).exit_code == 3


def test_second_fold_on_a_gpu_waits_for_the_first(env: dict) -> None:
    registry = Registry()
    req = request(folds=["0", "1"], gpus=["0"], simulated=True, sequential=True,
                  trainer_entry=(str(FAKE_TRAINER),),
                  trainer_args=["--epochs", "4", "--epoch-time", "0.1"])  # fmt: skip
    plans, problems = plan_launch(req, live_roots(), 2, registry=registry)
    assert problems == []
    first, second = (launcher.start(p, registry) for p in plans)
    assert wait_until(lambda: registry.get(second.job_id).exit_code is not None, 20)
    first, second = registry.get(first.job_id), registry.get(second.job_id)
    assert (first.exit_code, second.exit_code) == (0, 0)
    second_trainer = next(p for p in second.processes if p.role == "trainer")
    assert second_trainer.create_time >= first.ended_at - 0.05


def test_queued_fold_stopped_before_its_turn_never_starts(env: dict) -> None:
    registry = Registry()
    req = request(folds=["0", "1"], gpus=["0"], simulated=True, sequential=True,
                  trainer_entry=(str(FAKE_TRAINER),),
                  trainer_args=["--epochs", "8", "--epoch-time", "0.1"])  # fmt: skip
    plans, _ = plan_launch(req, live_roots(), 2, registry=registry)
    _first, second = (launcher.start(p, registry) for p in plans)
    registry.update(second.job_id, queued_stop=True)
    assert wait_until(lambda: registry.get(second.job_id).exit_code is not None, 20)
    second = registry.get(second.job_id)
    assert second.note == "stopped before it started" and second.process("trainer") is None


# ---- CPU slots: one job per slot at a time, like a GPU (cpu_slots.py) ---------------------


def _cpu(**changes: object) -> LaunchRequest:
    return request(**{"device": "cpu", "gpus": [], "folds": ["0", "1", "2"], **changes})


def test_cpu_folds_take_turns_on_the_cpu_slots(roots: Roots, monkeypatch) -> None:
    from app.services.launch import cpu_slots

    monkeypatch.setattr(cpu_slots, "usable_cores", lambda: 2)
    plans, problems = plan_launch(_cpu(), roots, 4)  # a job uses both cores: one slot
    assert problems == []
    assert [p.after for p in plans] == [None, plans[0].job_id, plans[1].job_id]
    checks = launch_request.check_request(_cpu(), roots, 4)
    assert any("1 CPU slot (2 cores, 2 threads per job)" in w for w in checks.warnings)

    plans, _ = plan_launch(_cpu(threads=1), roots, 4)  # two slots of one thread each
    assert [p.after for p in plans] == [None, None, plans[0].job_id]

    plans, _ = plan_launch(_cpu(oversubscribe=True), roots, 4)
    assert [p.after for p in plans] == [None, None, None]
    checks = launch_request.check_request(_cpu(oversubscribe=True), roots, 4)
    (warning,) = [w for w in checks.warnings if "--oversubscribe" in w]
    assert "3 CPU jobs on 1 CPU slot" in warning and "at least 3x slower" in warning


def test_cpu_slots_count_the_cpu_jobs_already_running(roots: Roots, tmp_path: Path,
                                                      monkeypatch) -> None:  # fmt: skip
    from test_jobs import ME_ALIVE, add_job

    from app.services.launch import cpu_slots

    monkeypatch.setattr(cpu_slots, "usable_cores", lambda: 2)
    registry = Registry(tmp_path / "state")
    add_job(registry, tmp_path, "busy", device="cpu", gpus=[], processes=[ME_ALIVE])
    add_job(registry, tmp_path, "gpu-job", device="cuda", processes=[ME_ALIVE])  # not a slot
    plans, _ = plan_launch(_cpu(folds=["0"]), roots, 4, registry=registry)
    assert plans[0].after == "busy"


def test_two_cpu_folds_on_one_slot_run_one_after_the_other(env: dict, monkeypatch) -> None:
    from app.services.launch import cpu_slots

    monkeypatch.setattr(cpu_slots, "usable_cores", lambda: 2)  # one slot, as on this box
    registry = Registry()
    req = _cpu(folds=["0", "1"], trainer_entry=(str(FAKE_TRAINER),),
               trainer_args=["--epochs", "4", "--epoch-time", "0.1"])  # fmt: skip
    plans, problems = plan_launch(req, live_roots(), 2, registry=registry)
    assert problems == []
    first, second = (launcher.start(p, registry) for p in plans)
    assert wait_until(lambda: registry.get(second.job_id).exit_code is not None, 60)
    first, second = registry.get(first.job_id), registry.get(second.job_id)
    assert (first.exit_code, second.exit_code) == (0, 0)
    assert second.after == first.job_id
    second_trainer = second.process("trainer")
    assert second_trainer.create_time >= first.ended_at - 0.05
