"""Adopted runs (app/services/jobs/discovery.py): grouping a process table into runs, and forged or
stale run folders that must never lead to a signal nor crash `nnui status`.

The forged cases use real processes: a stand-in `nnui-train` (a small script of that name
that records every SIGUSR1/SIGTERM it gets) and an unrelated `sleep` whose pid a forged
topology names (a reused pid: SIGUSR1 would kill it). Another user's process is started
with runuser when the tests run as root (else those cases are skipped, with the reason).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.services.jobs.discovery import (
    discover,
    is_agent,
    is_related,
    is_step,
    parse_args,
    trainer_index,
)
from app.services.machine.procs import ProcRow, read_sigcgt_usr1
from trainer.schema.tree import EVENTS_FILE

ROOT = Path(__file__).resolve().parents[3]
PY = sys.executable
# The stand-in needs only the standard library, and another user cannot run an interpreter
# kept under root's home.
FAKE_PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else PY
OTHER_USER = "nnuidisc"
FAKE_TRAINER = """\
import os, signal, sys, time
log = os.environ.get("FAKE_SIGNAL_LOG")

def record(signum, frame):
    if log:
        with open(log, "a") as handle:
            handle.write(f"{signal.Signals(signum).name}\\n")

signal.signal(signal.SIGUSR1, record)
signal.signal(signal.SIGTERM, record)
held = open(os.environ["FAKE_OPEN"], "a") if os.environ.get("FAKE_OPEN") else None
print("ready", flush=True)
time.sleep(3600)  # outlives the test however slow the box (the test kills it)
"""


def _row(pid, ppid, cmdline, uid=None, environ=None, ticks=None):
    return ProcRow(pid=pid, ppid=ppid, uid=os.getuid() if uid is None else uid,
                   start_ticks=ticks or pid, cmdline=tuple(cmdline), environ=environ)  # fmt: skip


ARGS = ["900", "2d", "0", "-device", "cpu", "--results", "/nonexistent/results"]


def test_command_lines_are_classified() -> None:
    assert trainer_index(["nnui-train", *ARGS]) == 0
    assert trainer_index([PY, "-u", "-m", "trainer", *ARGS]) == 3
    assert trainer_index(["/venv/bin/python3", "/venv/bin/nnui-train", *ARGS]) == 1
    assert trainer_index([PY, "-m", "trainer.demo"]) is None
    assert trainer_index([PY, "-c", "import trainer"]) is None
    assert is_agent([PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer"])
    assert is_agent(["/venv/bin/torchrun", "--standalone", "/venv/bin/nnui-train", *ARGS])
    assert not is_agent(["/venv/bin/torchrun", "other.py"])
    assert is_step(["srun", "--ntasks=2", "nnui-train", *ARGS])
    assert not is_related(["bash", "job.sbatch"])
    args = parse_args([*ARGS, "-tr", "T", "-p", "P", "--c", "-num_gpus", "2"])
    assert args is not None
    assert (args.trainer, args.plans, args.num_gpus, args.continue_training) == ("T", "P", 2, True)
    assert parse_args(["900", "2d"]) is None  # no fold: not a run


def test_groups_are_one_run_each_with_roles_and_ranks(monkeypatch) -> None:
    monkeypatch.delenv("NNUI_ADOPT_SCOPE", raising=False)  # folders of no watched root
    fork = [PY, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
            "--multiprocessing-fork"]  # fmt: skip
    rows = [
        # torchrun agent and its two workers (RANK in their environment), a data loader
        _row(
            100,
            1,
            [PY, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "trainer", *ARGS],
            environ={},
        ),
        _row(
            101,
            100,
            [PY, "-u", "-m", "trainer", *ARGS],
            environ={"RANK": "0", "TORCHELASTIC_RUN_ID": "x"},
        ),
        _row(
            102,
            100,
            [PY, "-u", "-m", "trainer", *ARGS],
            environ={"RANK": "1", "TORCHELASTIC_RUN_ID": "x"},
        ),
        _row(103, 101, fork),
        # a -num_gpus 2 spawn parent, its two ranks and the resource tracker
        _row(200, 1, ["nnui-train", *ARGS, "-num_gpus", "2"], environ={}),
        _row(201, 200, [PY, "-c", "from multiprocessing.resource_tracker import main;main(5)"]),
        _row(202, 200, fork),
        _row(203, 200, fork),
        # a single process, and a run nnui launched (skipped: its job shows it)
        _row(300, 1, ["nnui-train", *ARGS], environ={}),
        _row(400, 1, ["nnui-train", *ARGS], environ={"NNUI_JOB_ID": "j1"}),
        _row(500, 1, ["sleep", "100"]),
    ]
    runs = {run.top_pid: run for run in discover(procs=rows)}
    assert sorted(runs) == [100, 200, 300]
    roles = {top: {m.pid: (m.role, m.rank) for m in run.members} for top, run in runs.items()}
    assert roles[100] == {100: ("agent", None), 101: ("worker", 0), 102: ("worker", 1),
                          103: ("helper", None)}  # fmt: skip
    assert roles[200] == {200: ("launcher", None), 201: ("helper", None),
                          202: ("worker", None), 203: ("worker", None)}  # fmt: skip
    assert roles[300] == {300: ("worker", 0)}
    assert [(runs[t].launcher, runs[t].world_size) for t in (100, 200, 300)] == [
        ("torchrun", 2), ("spawn", 2), ("single", 1)]  # fmt: skip


# ---- forged and stale run folders: never a signal, never a crash ---------------------------


def _nnui(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "app.main", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)  # fmt: skip


def _wait(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Started:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, **kwargs)  # fmt: skip
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # our own session, by its pid
                proc.wait()


@pytest.fixture
def started():
    s = Started()
    try:
        yield s
    finally:
        s.cleanup()


def _shared_dir() -> Path:
    """A folder another user can read and write (tmp_path is root's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="nnui-disc-"))
    folder.chmod(0o777)
    return folder


def _fake_trainer(folder: Path) -> Path:
    path = folder / "nnui-train"
    path.write_text(FAKE_TRAINER)
    path.chmod(0o755)
    return path


def _fold(results: Path, fold: str) -> Path:
    folder = results / "Dataset900_NnuiDemo" / "nnuiTrainer__nnuiPlans__2d" / f"fold_{fold}"
    folder.mkdir(parents=True)
    for parent in (folder, *folder.parents):
        if parent == results.parent:
            break
        parent.chmod(0o777)
    return folder


def _events(folder: Path, t: float, pids: list[int], extra: str = "") -> None:
    lines = [
        {"v": 1, "t": t, "kind": "run_started", "num_epochs": 10, "world_size": len(pids),
         "launcher": "single", "argv": ["900", "2d", "0"]},
        {"v": 1, "t": t + 0.1, "kind": "topology", "ranks": [
            {"pid": pid, "global_rank": i, "local_rank": i, "device": "cpu",
             "sigusr1_handler": True} for i, pid in enumerate(pids)]},
        {"v": 1, "t": t + 0.2, "kind": "epoch_ended", "epoch": 0, "train_loss": 0.5,
         "val_loss": 0.4, "mean_fg_dice": 0.3, "ema_fg_dice": 0.3, "epoch_time_s": 1.0},
    ]  # fmt: skip
    text = "".join(json.dumps(r) + "\n" for r in lines) + extra
    (folder / EVENTS_FILE).write_text(text)
    (folder / EVENTS_FILE).chmod(0o666)


def _start_fake(started: Started, script: Path, results: Path, fold: str, log: Path,
                user: str | None = None, **env_extra: str) -> subprocess.Popen:  # fmt: skip
    argv = [FAKE_PY, str(script), "900", "2d", fold, "-device", "cpu", "--results", str(results)]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    env = {**os.environ, "FAKE_SIGNAL_LOG": str(log), **env_extra}
    proc = started.start(argv, env=env, cwd=str(script.parent))
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def _trainer_pid(proc: subprocess.Popen) -> int:
    """The fake trainer's own pid (under runuser it is runuser's child)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return int(children[0]) if children else proc.pid


def _other_user() -> str | None:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        return None
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        done = subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", OTHER_USER],
                              capture_output=True, check=False)  # fmt: skip
        if done.returncode != 0:
            return None
    return OTHER_USER


def _status(env: dict[str, str], results: Path) -> list[dict]:
    done = _nnui("status", "--json", "--results", str(results), env=env)
    assert done.returncode == 0, done.stderr
    return [r for r in json.loads(done.stdout) if str(results) in (r.get("run_dir") or "")]


async def test_forged_and_stale_folders_never_lead_to_a_signal(started, tmp_path) -> None:
    """Four folders, one stand-in trainer each: a topology naming an unrelated process of
    ours (a reused pid), a stale topology written before the process started, a corrupt
    events file, and (as root) another user's pid in our folder. status lists every one;
    stop and kill are refused with one line; nothing is signalled."""
    shared = _shared_dir()
    try:
        script = _fake_trainer(shared)
        results = shared / "results"
        results.mkdir(mode=0o777)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state")}
        bystander = started.start(["sleep", "3600"])  # killed at the end: must outlive the test
        other = _other_user()
        victim = None
        if other is not None:
            victim = _start_fake(started, script, results, "4", shared / "victim.log", other)
            _events(_fold(results, "4"), time.time(), [_trainer_pid(victim)])
        log = shared / "signals.log"
        fakes = {}
        for fold in ("0", "1", "2", "3"):
            folder = _fold(results, fold)
            fakes[fold] = _start_fake(started, script, results, fold, log)
            pid = fakes[fold].pid
            if fold == "0":
                _events(folder, time.time(), [bystander.pid])  # pid reuse
            elif fold == "1":
                _events(folder, time.time() - 3600, [pid])  # stale: an hour before it started
            elif fold == "2":  # no valid topology among torn, binary and ill-typed lines
                now = time.time()
                (folder / EVENTS_FILE).write_text(
                    json.dumps({"v": 1, "t": now, "kind": "run_started", "num_epochs": 5}) + "\n"
                    '{"t": "x", "kind": \n\x00garbage\n'
                    + json.dumps({"v": 1, "t": now, "kind": "topology", "ranks": [{"pid": "12"}]})
                    + "\n"
                    + json.dumps({"v": 1, "t": now, "kind": "topology", "ranks": [{"pid": -1}]})
                    + "\n"
                )
            else:
                other_pid = _trainer_pid(victim) if victim is not None else bystander.pid
                _events(folder, time.time(), [other_pid])
        _wait(lambda: all(read_sigcgt_usr1(p.pid) for p in fakes.values()), "handlers")
        rows = {r["top_pid"]: r for r in _status(env, results) if r.get("top_pid")}
        for fold, proc in fakes.items():
            assert rows[proc.pid]["owner"] == pwd.getpwuid(os.getuid()).pw_name, fold
            done = _nnui("stop", f"run:{proc.pid}", "--yes", "--results", str(results), env=env)
            assert done.returncode == 1, (fold, done.stdout, done.stderr)
            assert done.stderr.count("\n") == 1 and "nothing sent" in done.stderr, done.stderr
        assert rows[fakes["2"].pid]["num_invalid_events"] >= 2
        assert bystander.poll() is None  # never signalled
        assert not log.exists() or "SIGUSR1" not in log.read_text()
        text = _nnui("status", "--results", str(results), env=env)
        assert text.returncode == 0 and "Traceback" not in text.stderr
        if victim is not None:
            _check_other_user(env, results, victim, shared / "victim.log")
        others = [f"run:{_trainer_pid(victim)}"] if victim is not None else []
        await _board(results, tmp_path, [f"run:{p.pid}" for p in fakes.values()], others)
        assert bystander.poll() is None and not (shared / "victim.log").exists()
        # Our own run may be killed: SIGTERM to its verified topmost process, then SIGKILL.
        target = fakes["0"]
        done = _nnui("kill", f"run:{target.pid}", "--yes", "--grace", "1",
                     "--results", str(results), env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"SIGTERM -> pid {target.pid}: sent" in done.stdout, done.stdout
        assert target.wait(timeout=60) == -signal.SIGKILL  # the stand-in ignores SIGTERM
        assert log.read_text().splitlines() == ["SIGTERM"] and bystander.poll() is None
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _check_other_user(env, results: Path, victim: subprocess.Popen, log: Path) -> None:
    pid = _trainer_pid(victim)
    (row,) = [r for r in _status(env, results) if r.get("owner") == OTHER_USER]
    assert row["watch_only"] and row["top_pid"] == pid
    for action in ("stop", "kill"):
        done = _nnui(action, f"run:{pid}", "--yes", "--results", str(results), env=env)
        assert done.returncode == 1
        assert done.stderr.count("\n") == 1 and f"user {OTHER_USER}" in done.stderr, done.stderr
    assert victim.poll() is None and not log.exists()


def test_other_user_needs_root() -> None:
    if _other_user() is None:
        pytest.skip("another user's run needs root (useradd, runuser) to be started here")


def test_a_run_under_any_results_root_is_found_from_its_open_events_file(started, tmp_path):
    """The run's argv names no existing folder and its root is not watched: the events.jsonl
    it holds open names its folder (own processes; /proc/PID/fd)."""
    script = _fake_trainer(tmp_path)
    elsewhere = _fold(tmp_path / "elsewhere", "0")
    proc = _start_fake(started, script, tmp_path / "nowhere", "0", tmp_path / "log",
                       FAKE_OPEN=str(elsewhere / EVENTS_FILE))  # fmt: skip
    _events(elsewhere, time.time(), [proc.pid])  # replaces the file's content, same inode
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state")}
    watched = tmp_path / "watched"
    rows = {r["id"]: r for r in json.loads(
        _nnui("status", "--json", "--results", str(watched), env={**env, "NNUI_ADOPT_SCOPE": ""}
              ).stdout)}  # fmt: skip
    row = rows[f"run:{proc.pid}"]
    assert (row["run_dir"], row["run_dir_source"]) == (str(elsewhere.resolve()), "fd")
    assert (row["epoch"], row["launcher"], row["num_ranks"]) == (1, "single", 1)
    fresh = {**env, "XDG_STATE_HOME": str(tmp_path / "fresh")}  # no tree remembered yet
    scoped = _nnui("status", "--json", "--results", str(watched), env=fresh)
    assert f"run:{proc.pid}" not in scoped.stdout  # the suite's scope: watched roots only


async def _board(results: Path, tmp_path: Path, own: list[str], others: list[str]) -> None:
    """The board lists every forged run; their detail views open; `s` on another user's
    run shows the refusal; nothing crashes."""
    from tui_fixtures import screen_of, wait_for

    from app.screens.confirm import RefusalScreen
    from app.screens.dashboard import DashboardScreen
    from app.screens.job_detail import JobDetailScreen
    from app.screens.seam import TuiConfig
    from app.tui import make_app
    from trainer.schema.tree import Roots

    config = TuiConfig(roots=Roots(results, results, results), state_dir=tmp_path / "tui",
                       simulate_gpus=1, jobs_interval_s=0.25, procs_interval_s=0.25)  # fmt: skip
    app = make_app(config)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(lambda: all(app.view_of(i) is not None for i in own + others), pilot)
        assert all(app.view_of(i).watch_only for i in others)
        for job_id in own + others:
            await screen_of(app, pilot, DashboardScreen)
            await pilot.press("slash", *job_id.removeprefix("run:"), "enter", "enter")
            await screen_of(app, pilot, JobDetailScreen)
            await pilot.press("escape")
            await screen_of(app, pilot, DashboardScreen)
            if job_id in others:
                await pilot.press("s")
                await screen_of(app, pilot, RefusalScreen)
                await pilot.press("escape")
            await pilot.press("slash", "escape")


def test_runs_that_ended_unseen_are_listed_with_their_outcome(tmp_path) -> None:
    """The newest run of each folder, claimed by no nnui job: finished, failed, stopped, or
    lost (no end event, nothing alive); a folder whose newest run is a job's is not listed
    again; an unreadable events file is skipped."""
    from test_registry import make_job

    from app.services.jobs.registry import Registry
    from app.services.jobs.views import JobTracker

    results = tmp_path / "results"
    now = time.time() - 100
    outcomes = {"0": "finished", "1": "failed", "2": "stopped", "3": None, "4": "finished"}
    for fold, end in outcomes.items():
        folder = _fold(results, fold)
        _events(folder, now, [4_000_000 + int(fold)])
        if end is not None:
            with open(folder / EVENTS_FILE, "a") as handle:
                handle.write(json.dumps({"v": 1, "t": now + 5, "kind": end}) + "\n")
    (_fold(results, "all") / EVENTS_FILE).write_bytes(b"\xff\x00{not json\n")
    registry = Registry(tmp_path / "state")
    claimed = str(results / "Dataset900_NnuiDemo" / "nnuiTrainer__nnuiPlans__2d" / "fold_4")
    registry.add(make_job(created_at=now - 10, ended_at=now + 6, run_dir=claimed, fold="4",
                          exit_code=0))  # fmt: skip
    tracker = JobTracker(registry)
    tracker.refresh()
    views = tracker.refresh_watch_only([results], procs=[])
    states = {v.job.fold: (str(v.state), v.job.job_id) for v in views}
    assert {f: s for f, (s, _) in states.items()} == {
        "0": "finished", "1": "failed", "2": "stopped", "3": "lost"}  # fmt: skip
    assert states["0"][1] == "run:4000000"  # the rank 0 pid of its topology
    assert all(v.epoch == 1 and len(v.history) == 1 for v in views)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp_path / "state2")}
    done = _nnui("export", "run:4000000", "-o", str(out), "--results", str(results), env=env)
    assert done.returncode == 0, done.stderr
    (csv,) = out.glob("*.csv")
    assert len(csv.read_text().splitlines()) == 2  # the header and the one epoch
    done = _nnui("cv", "--json", "--results", str(results), env=env)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)  # the adopted folds are the dataset's cross-validation
    assert row["dataset"] == "Dataset900_NnuiDemo", row


def test_slurm_trainings_are_found_in_own_and_nnui_sbatch_scripts() -> None:
    """squeue's jobs whose batch script runs the trainer (a user's `srun ... -m trainer`, or
    what `nnui sbatch` writes); other jobs are not trainings. squeue is asked once per poll
    interval, each script once."""
    from app.services.jobs.slurm_jobs import SlurmWatcher
    from app.services.slurm import script as slurm

    spec = slurm.JobSpec(dataset="900", configuration="3d_fullres", fold="3", nodes=1,
                         gpus_per_node=2, time_limit="01:00:00", procs_per_node=1)  # fmt: skip
    scripts = {
        "12": "#!/bin/bash\n#SBATCH -n 1\ncd /x && srun python -m trainer 900 2d 1 -device cpu\n",
        "13": slurm.render_script(spec),
        "14": "#!/bin/bash\necho not a training\n",
    }
    calls: list[str] = []

    def run(argv: list[str]) -> str | None:
        calls.append(argv[0])
        if argv[0] == "squeue":
            return "12|PENDING|mine|Priority|\n13|RUNNING|nnui|None|n1\n14|RUNNING|other|None|n1\n"
        return scripts[argv[3]]

    watcher = SlurmWatcher(run)
    found = {(j.job_id, j.state, j.args.configuration, j.args.fold) for j in watcher.jobs()}
    assert found == {("12", "PENDING", "2d", "1"), ("13", "RUNNING", "3d_fullres", "3")}
    watcher.jobs()
    assert calls == ["squeue", "scontrol", "scontrol", "scontrol"]
    from app.services.jobs.listing import arrange
    from app.services.jobs.views import slurm_view

    rows = arrange([slurm_view(j, 0.0) for j in watcher.jobs()])  # no folder: a row each
    assert sorted(r.job.job_id for r in rows) == ["slurm:12", "slurm:13"]


async def test_r_on_a_run_that_ended_unseen_offers_its_own_command_with_c(tmp_path) -> None:
    """The board's resume of an adopted run: its own argv + --c in its own roots, through
    nnui's launcher (confirmed before anything starts; here declined)."""
    from tui_fixtures import screen_of, wait_for

    from app.screens.confirm import LaunchConfirmScreen
    from app.screens.dashboard import DashboardScreen
    from app.screens.seam import TuiConfig
    from app.tui import make_app
    from trainer.schema.tree import Roots

    results = tmp_path / "results"
    folder = _fold(results, "0")
    _events(folder, time.time() - 100, [4_100_000])
    with open(folder / EVENTS_FILE, "a") as handle:
        stopped = {"v": 1, "t": time.time() - 50, "kind": "stopped", "epoch": 0}
        handle.write(json.dumps(stopped) + "\n")
    config = TuiConfig(roots=Roots(results, results, results), state_dir=tmp_path / "tui",
                       simulate_gpus=1, jobs_interval_s=0.25, procs_interval_s=0.25)  # fmt: skip
    app = make_app(config)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(lambda: (v := app.view_of("run:4100000")) and v.state == "stopped", pilot)
        await screen_of(app, pilot, DashboardScreen)
        await pilot.press("r")
        screen = await screen_of(app, pilot, LaunchConfirmScreen)
        text = " ".join(str(p) for p in screen.previews)
        assert "-m trainer 900 2d 0 --c" in text and f"nnUNet_results={results}" in text, text
        await pilot.press("n")
        await screen_of(app, pilot, DashboardScreen)
    assert not (tmp_path / "tui" / "jobs").exists() or not any(
        (tmp_path / "tui" / "jobs").iterdir()
    )
