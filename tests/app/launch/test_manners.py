"""Shared-box manners and failures at hand (issue 14, items 2 and 5): one console file per
run attempt, busy GPUs confirmed, the simulated machine playing other users, dry runs that
list every fold, trainer nice value and threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_jobs import add_job

from app.services.jobs import consoles
from app.services.jobs.registry import Registry
from app.services.jobs.views import JobTracker
from app.services.launch import niceness
from app.services.supervisor import main as supervisor

ROOT = Path(__file__).resolve().parents[3]


# ---- one console per attempt -------------------------------------------------------------


def test_the_next_attempt_gets_its_own_file() -> None:
    first = Path("/r/fold_0") / consoles.console_name("abc", 1)
    assert first.name == "console.abc.1.log"
    assert consoles.next_attempt_path(first, "abc") == Path("/r/fold_0/console.abc.2.log")
    assert consoles.next_attempt_path(Path("/r/console.log"), "abc") is None  # legacy: stays


def test_a_restart_moves_the_console_and_names_it_in_the_registry(tmp_path, monkeypatch) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j1", console_path=str(tmp_path / "console.j1.1.log"))
    moved: list[Path] = []
    monkeypatch.setattr(supervisor, "redirect_output", moved.append)
    supervisor._next_console(registry, job.job_id, "exit 137 (SIGKILL)")
    assert moved == [tmp_path / "console.j1.2.log"]
    assert registry.get("j1").console_path == str(tmp_path / "console.j1.2.log")


def test_redirect_output_sends_this_process_and_its_children_to_the_new_file(tmp_path) -> None:
    code = (
        "import subprocess, sys; from pathlib import Path; from app.services.jobs import consoles\n"
        "print('before', flush=True); consoles.redirect_output(Path(sys.argv[1]))\n"
        "print('after', flush=True); subprocess.run(['echo', 'child'])\n"
    )
    target = tmp_path / "console.j.2.log"
    result = subprocess.run([sys.executable, "-c", code, str(target)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\n" and target.read_text() == "after\nchild\n"


def test_the_console_tail_follows_the_current_attempt(tmp_path) -> None:
    registry = Registry(tmp_path / "state")
    job = add_job(registry, tmp_path, "j1", console_path=str(tmp_path / "console.j1.1.log"))
    Path(job.console_path).write_text("attempt one\nTraceback: boom\n")
    tracker = JobTracker(registry)
    assert tracker.refresh()[0].console_tail[-1] == "Traceback: boom"
    second = tmp_path / "console.j1.2.log"
    second.write_text("[nnui] attempt 2\nepoch 3 loss 0.5\n")
    registry.update("j1", console_path=str(second))
    assert tracker.refresh()[0].console_tail == ("[nnui] attempt 2", "epoch 3 loss 0.5")


# ---- busy GPUs and the simulated machine's other users ------------------------------------


def nnui_env(tmp_path: Path) -> dict[str, str]:
    from fake_trainer import fake_env

    values = {**os.environ, **fake_env(tmp_path)}
    for name in ("CUDA_VISIBLE_DEVICES", "NNUI_SIMULATED_BUSY"):
        values.pop(name, None)
    values["NNUI_GPU_CLAIMS_DIR"] = str(tmp_path / "claims")
    return values


def nnui(env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.main", *args], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


LAUNCH = ("launch", "4", "3d_fullres", "--simulate-gpus", "4")


def test_a_gpu_of_another_user_needs_yes_headless(tmp_path) -> None:
    env = nnui_env(tmp_path)
    busy = ("--simulate-busy", "2:otheruser:30")
    refused = nnui(env, *LAUNCH, *busy, "--folds", "0", "--gpus", "2")
    assert refused.returncode == 1, refused.stderr
    assert "otheruser" in refused.stderr and "--yes" in refused.stderr
    assert refused.stderr.count("\n") <= 3 and "Traceback" not in refused.stderr
    assert not (tmp_path / "results").exists()  # nothing started, nothing written
    free = nnui(env, *LAUNCH, *busy, "--folds", "0", "--gpus", "1", "--dry-run")
    assert free.returncode == 0 and "note:" not in free.stderr, free.stderr
    shown = nnui(env, *LAUNCH, *busy, "--folds", "0", "--gpus", "2", "--dry-run")
    assert shown.returncode == 0 and "otheruser pid" in shown.stderr and "30 GiB" in shown.stderr


def test_simulate_busy_is_checked_and_written_where_the_monitor_reads_it(tmp_path) -> None:
    env = nnui_env(tmp_path)
    for bad in ("2:x", "9:bob:30", "1:bob:lots", "1:bob:500"):
        result = nnui(env, "status", "--simulate-gpus", "4", "--simulate-busy", bad)
        assert result.returncode == 2 and result.stderr.startswith("error: --simulate-busy")
    assert nnui(env, "status", "--simulate-busy", "1:bob:3").returncode == 2  # no simulation
    code = (
        "import os; from app.services.machine.simulate_busy import install\n"
        "from app.services.machine.gpus import GpuMonitor\n"
        "from app.services.jobs.registry import default_state_dir\n"
        "install(['2:otheruser:30', '2:bob:10:50'], 4, default_state_dir())\n"
        "gpu = GpuMonitor(simulate=4).snapshot().gpu(2)\n"
        "print(gpu.other_users, gpu.memory_used_bytes >> 30, gpu.utilization_percent)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.stdout.split("\n")[0] == "('bob', 'otheruser') 40 90", result.stderr


@pytest.mark.slow
def test_a_gpu_running_your_own_job_needs_yes_too(tmp_path) -> None:
    from fake_trainer import cleanup_jobs, wait_until

    env = nnui_env(tmp_path)
    try:
        first = nnui(env, *LAUNCH, "--folds", "0", "--gpus", "1", "--nice", "7", "--threads",
                     "2", "--", "--epochs", "100", "--epoch-time", "0.5")  # fmt: skip
        assert first.returncode == 0, first.stderr
        job_id = first.stdout.split()[0]
        registry = Registry(tmp_path / "state")
        assert wait_until(lambda: registry.get(job_id).process("trainer") is not None)
        trainer = registry.get(job_id).process("trainer").pid
        assert os.getpriority(os.PRIO_PROCESS, trainer) == 7  # --nice, the trainer only
        supervisor = registry.get(job_id).process("supervisor").pid
        assert os.getpriority(os.PRIO_PROCESS, supervisor) == os.getpriority(os.PRIO_PROCESS, 0)
        environ = Path(f"/proc/{trainer}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=2" in environ
        again = nnui(env, *LAUNCH, "--folds", "1", "--gpus", "1")
        assert again.returncode == 1 and "yours pid" in again.stderr, again.stderr
        assert len(registry.list()) == 1
        forced = nnui(env, *LAUNCH, "--folds", "1", "--gpus", "1", "--yes", "--", "--epochs", "1")
        assert forced.returncode == 0, forced.stderr
        assert len(registry.list()) == 2
    finally:
        cleanup_jobs(tmp_path / "state")


def test_a_dry_run_lists_every_fold_and_the_refused_ones(tmp_path) -> None:
    from trainer.schema.atomic import atomic_write_text
    from trainer.schema.status import Status
    from trainer.schema.tree import run_dir

    env = nnui_env(tmp_path)
    (dataset,) = [p.name for p in (tmp_path / "preprocessed").iterdir() if p.is_dir()]
    folder = run_dir(tmp_path / "results", dataset, "3d_fullres", "1")
    folder.mkdir(parents=True)
    atomic_write_text(folder / "status.json", Status("finished", epoch=3, num_epochs=3).to_json())
    result = nnui(env, *LAUNCH, "--folds", "0,1,2", "--gpus", "0,1,2", "--dry-run")
    assert result.returncode == 1
    commands = [line for line in result.stdout.splitlines() if line.startswith("cd ")]
    assert len(commands) == 2 and " 0 -device" in commands[0] and " 2 -device" in commands[1]
    assert "refused: fold 1:" in result.stderr
    assert not any(p.name.startswith("fold_0") for p in folder.parent.iterdir())


async def test_the_board_asks_before_starting_beside_another_users_process(
    tmp_path: Path, monkeypatch
) -> None:
    """Fake NVML: GPU 1 is used by alice. g asks; n starts nothing; g then y starts."""
    from fake_trainer import cleanup_jobs
    from test_gpus import FakeNvml, monitor
    from test_tui_board import open_board, settled
    from tui_fixtures import make_roots, screen_of, use_fake_trainer, wait_for

    from app.screens.confirm import LaunchConfirmScreen
    from app.screens.launch import LaunchScreen
    from app.screens.seam import Services, TuiConfig
    from app.tui import make_app

    roots, state = make_roots(tmp_path), tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    registry = Registry(state)
    services = Services(monitor(FakeNvml()), registry, JobTracker(registry))
    app = make_app(TuiConfig(roots=roots, state_dir=state, jobs_interval_s=0.25), services)
    try:
        async with app.run_test(size=(150, 48)) as pilot:
            screen = await open_board(app, pilot)
            await pilot.press("right", "space")  # fold 0 on GPU 1
            await settled(screen, pilot, {"0": ["1"]})
            assert any("alice pid" in c for c in screen.confirmations), screen.confirmations
            assert "? GPU 1 already runs" in screen.query_one("#launch-checks").render().plain
            await pilot.press("g")
            confirm = await screen_of(app, pilot, LaunchConfirmScreen)
            assert "alice pid" in confirm.query_one("#launch-preview-text").render().plain
            await pilot.press("n")
            await screen_of(app, pilot, LaunchScreen)
            assert registry.list() == []
            await pilot.press("g")
            await screen_of(app, pilot, LaunchConfirmScreen)
            await pilot.press("y")
            await wait_for(lambda: len(registry.list()) == 1, pilot)
    finally:
        cleanup_jobs(state)


# ---- nice value and threads ----------------------------------------------------------------


def test_nice_and_threads_reach_the_job_environment_and_survive_a_resume(tmp_path) -> None:
    from fake_trainer import make_preprocessed
    from test_launcher import request

    from app.services.jobs.registry import Job
    from app.services.launch import launcher
    from app.services.launch import request as launch_request
    from trainer.schema.tree import Roots

    make_preprocessed(tmp_path / "pre", batch_size=4)
    roots = Roots(tmp_path / "raw", tmp_path / "pre", tmp_path / "res")
    plans, problems = launcher.plan_launch(request(nice=5, threads=2), roots, 4)
    assert problems == []
    assert plans[0].env["NNUI_NICE"] == "5" and plans[0].env["OMP_NUM_THREADS"] == "2"
    (default,), _ = launcher.plan_launch(request(), roots, 4)
    assert "NNUI_NICE" not in default.env and "OMP_NUM_THREADS" not in default.env
    job = Job("j", 0.0, "Dataset004_Hippocampus", "3d_fullres", "0", "single", "cuda", ["0"],
              False, [], dict(plans[0].env), "/r", "/r/c.log")  # fmt: skip
    again = launch_request.resume_request(job)
    assert (again.nice, again.threads) == (5, 2)


def test_bad_nice_and_threads_are_usage_errors(tmp_path) -> None:
    env = nnui_env(tmp_path)
    for flags, fragment in ((("--nice", "40"), "-20 to 19"), (("--threads", "0"), "at least 1")):
        result = nnui(env, *LAUNCH, "--folds", "0", "--gpus", "0", *flags, "--dry-run")
        assert result.returncode == 2 and fragment in result.stderr, result.stderr


def test_a_niced_nnui_says_its_jobs_inherit_it_and_cannot_lower_it(tmp_path) -> None:
    env = nnui_env(tmp_path)
    base = [sys.executable, "-m", "app.main", *LAUNCH, "--folds", "0", "--gpus", "0", "--dry-run"]

    def niced(*flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["nice", "-n", "5", *base, *flags], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    warned = niced()
    assert warned.returncode == 0 and "nnui runs at nice" in warned.stderr, warned.stderr
    assert "nnui runs at nice" not in niced("--nice", "10").stderr
    if os.geteuid() != 0:
        lower = niced("--nice", "0")
        assert lower.returncode == 2 and "only root can lower" in lower.stderr


def test_child_setup_starts_the_child_at_the_nice_value() -> None:
    probe = [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"]
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    wanted = min(19, mine + 3)
    setup = niceness.child_setup({"NNUI_NICE": str(wanted)})
    out = subprocess.run(probe, preexec_fn=setup, capture_output=True, text=True, timeout=60)
    assert int(out.stdout) == wanted
    assert niceness.child_setup({}) is None


# ---- trainer flags checked before launch ---------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "flags", "fragment"),
    [
        ("nnui", ["--epochs", "abc"], "invalid int value: 'abc'"),
        ("nnui", ["--nope"], "unrecognized arguments: --nope"),
        ("nnunet", ["--epochs", "abc"], "--epochs needs a whole number"),
        ("nnunet", ["--nope"], "unrecognized arguments: --nope"),
        ("nnunet", ["-num_gpus", "x"], "invalid int value: 'x'"),
    ],
)
def test_the_flag_check_refuses_what_the_trainer_would(engine, flags, fragment) -> None:
    from app.services.launch import flag_check

    problem = flag_check.flag_problem(engine, "Dataset004_Demo", "3d_fullres", tuple(flags))
    assert problem is not None and fragment in problem and "\n" not in problem
    assert (
        flag_check.flag_problem(engine, "Dataset004_Demo", "3d_fullres", ("--epochs", "3")) is None
    )
    assert flag_check.flag_problem(engine, "D", "2d", ("--npz", "--c")) is None


def test_bad_trainer_flags_are_refused_headless_before_any_job(tmp_path) -> None:
    env = nnui_env(tmp_path)
    env.pop("NNUI_TRAINER_SCRIPT")  # nnui's own trainer: its flags are checked
    for flags in (("--epochs", "abc"), ("--nope",)):
        for dry in ((), ("--dry-run",)):
            result = nnui(env, *LAUNCH, "--folds", "0", "--gpus", "0", *dry, "--", *flags)
            assert result.returncode == 2, result.stderr
            assert "error: trainer flags refused" in result.stderr and result.stdout == ""
    assert not (tmp_path / "results").exists() and Registry(tmp_path / "state").list() == []


async def test_the_board_shows_bad_trainer_flags_and_does_not_start(tmp_path, monkeypatch) -> None:
    from test_tui_board import open_board, settled
    from tui_fixtures import make_roots, tui_app, use_fake_trainer, wait_for

    roots, state = make_roots(tmp_path), tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    monkeypatch.delenv("NNUI_TRAINER_SCRIPT")
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space", "f", *"--nope", "escape")
        await settled(screen, pilot, {"0": ["0"]})
        await wait_for(lambda: screen._inputs == screen.requests(), pilot)
        await settled(screen, pilot)
        assert any("unrecognized arguments: --nope" in p for p in screen.problems), screen.problems
        assert "trainer flags refused" in screen.query_one("#launch-checks").render().plain
        await pilot.press("g")
        await wait_for(lambda: screen.num_refused == 1, pilot)
    assert Registry(state).list() == []


@pytest.mark.slow
def test_a_resume_onto_a_busy_gpu_needs_yes(tmp_path) -> None:
    from fake_trainer import cleanup_jobs, wait_until

    env = nnui_env(tmp_path)
    try:
        first = nnui(env, *LAUNCH, "--folds", "0", "--gpus", "2", "--", "--epochs", "3",
                     "--fail-at", "1")  # fmt: skip
        assert first.returncode == 0, first.stderr
        job_id = first.stdout.split()[0]
        registry = Registry(tmp_path / "state")
        assert wait_until(lambda: registry.get(job_id).exit_code is not None)
        busy = ("--simulate-gpus", "4", "--simulate-busy", "2:bob:20")
        refused = nnui(env, "resume", job_id, *busy)
        assert refused.returncode == 1 and "bob pid" in refused.stderr, refused.stderr
        assert len(registry.list()) == 1
        forced = nnui(env, "resume", job_id, *busy, "--yes")
        assert forced.returncode == 0, forced.stderr
        assert len(registry.list()) == 2
    finally:
        cleanup_jobs(tmp_path / "state")


def test_the_board_field_reads_nice_and_threads() -> None:
    assert niceness.parse_field("") == (None, None)
    assert niceness.parse_field("nice 10 threads 4") == (10, 4)
    assert niceness.parse_field("threads=2") == (None, 2)
    for bad in ("nice", "nice ten", "fast 3"):
        with pytest.raises(ValueError, match="nice 10 threads 4"):
            niceness.parse_field(bad)


async def test_the_board_puts_nice_and_threads_into_the_job_environment(
    tmp_path, monkeypatch
) -> None:
    from test_tui_board import open_board, settled
    from tui_fixtures import make_roots, tui_app, use_fake_trainer, wait_for

    roots, state = make_roots(tmp_path), tmp_path / "state"
    use_fake_trainer(monkeypatch, roots, state)
    app = tui_app(roots, state)
    async with app.run_test(size=(150, 48)) as pilot:
        screen = await open_board(app, pilot)
        await pilot.press("space")
        await settled(screen, pilot, {"0": ["0"]})
        screen.query_one("#manners").value = "nice 12 threads 3"
        await wait_for(lambda: screen.plans and "NNUI_NICE" in screen.plans[0].env, pilot)
        await settled(screen, pilot)
        env = screen.plans[0].env
        assert env["NNUI_NICE"] == "12" and env["OMP_NUM_THREADS"] == "3"
        assert "OMP_NUM_THREADS=3" in screen.preview_text
        screen.query_one("#manners").value = "nice lots"
        await wait_for(lambda: any("nice/threads" in p for p in screen.problems), pilot)
