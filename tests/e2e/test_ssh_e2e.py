"""Trainings outlive an SSH hang-up, and a new login re-attaches to them (real sshd + tmux).

sshd on 127.0.0.1 (free port), a tmux pane running `ssh` to it, `nnui --simulate-gpus 2`
(the TUI) inside the session; keystrokes put folds 0 and 1 on GPUs 0 and 1 with short
trainer flags and launch. Then the ssh client is killed by its pid while the TUI is open:
the trainings must keep running (pids alive, events growing), and after logging in again a
new `nnui` shows both jobs re-attached, running, with their epochs (and `nnui status --json`
agrees). The jobs are then ended by their verified pids. Uses the real trainer with the
demo_preprocessed fixture (NNUI_E2E_TRAINER=fake: tests/fake_trainer.py, for quick local
runs). Facts: shared/notes/ssh-local.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fake_trainer import FAKE_TRAINER, cleanup_jobs, make_preprocessed, wait_until

from app.services.jobs.liveness import job_alive, record_alive
from app.services.jobs.registry import Registry
from app.services.signals.send import kill

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("sshd", "ssh", "ssh-keygen", "tmux")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = pytest.mark.slow

# Every wait below ends when its condition holds; these are only guards against a hang,
# generous for a busy machine, never assertions about speed.
SAFETY_NET_S = 120.0
TRAINING_SAFETY_NET_S = 300.0  # the real trainer's first epochs on a shared box


def _missing_tools() -> list[str]:
    return [t for t in TOOLS if not (shutil.which(t) or (t == "sshd" and os.path.exists(SSHD)))]


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    missing = _missing_tools()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must install {missing} (apt-get install openssh-server tmux)")
        pytest.skip(f"needs {missing}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Sshd:
    """A private sshd on 127.0.0.1 accepting one generated key, for root or the current user."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.key = folder / "client_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key)],
                       check=True)  # fmt: skip
        host_key = folder / "host_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)],
                       check=True)  # fmt: skip
        authorized = folder / "authorized_keys"
        authorized.write_text((folder / "client_key.pub").read_text())
        authorized.chmod(0o600)
        config = folder / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            f"AuthorizedKeysFile {authorized}\nStrictModes no\nPidFile {folder / 'sshd.pid'}\n"
            "UsePAM no\n"
        )
        if os.getuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
        self.log = open(folder / "sshd.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(config)], stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if not wait_until(self._listening, SAFETY_NET_S):
            self.stop()
            pytest.fail(f"sshd did not start: {(folder / 'sshd.log').read_text()}")

    def _listening(self) -> bool:
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def ssh_command(self) -> str:
        user = psutil.Process().username()
        return shlex.join([
            "ssh", "-tt", "-p", str(self.port), "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-i", str(self.key),
            f"{user}@127.0.0.1",
        ])  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class Tmux:
    """tmux on a private socket; each session is one SSH login."""

    def __init__(self, name: str) -> None:
        self.socket = name

    def run(self, *args: str) -> str:
        result = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                                text=True, timeout=SAFETY_NET_S)  # fmt: skip
        return result.stdout

    def login(self, session: str, sshd: Sshd) -> None:
        """An SSH login whose remote side prints a marker and then becomes the user's login
        shell: once the marker is on screen the session is up and typing reaches the shell
        (input typed earlier could be dropped while ssh sets up the terminal)."""
        marker = f"logged-in-{session}"
        remote = f'echo {marker}; exec "$SHELL" -l'
        self.run("new-session", "-d", "-s", session, "-x", "160", "-y", "48",
                 f"{sshd.ssh_command()} {shlex.quote(remote)}")  # fmt: skip
        assert wait_until(lambda: marker in self.screen(session), SAFETY_NET_S), self.screen(
            session
        )

    def send(self, session: str, line: str) -> None:
        self.run("send-keys", "-t", session, line, "Enter")

    def keys(self, session: str, *keys: str) -> None:
        """Key presses by tmux name (Space, Down, Enter, l, ...), in this order. nnui handles
        keys in the order pressed; the caller waits for what a key must change on screen
        before pressing a key that depends on it."""
        self.run("send-keys", "-t", session, *keys)

    def footer(self, session: str) -> str:
        """The last line drawn: the key footer of the screen."""
        lines = [line for line in self.screen(session).splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def type(self, session: str, text: str) -> None:
        self.run("send-keys", "-t", session, "-l", "--", text)

    def screen(self, session: str) -> str:
        return self.run("capture-pane", "-p", "-t", session, "-S", "-200")

    def pane_pid(self, session: str) -> int:
        return int(self.run("display-message", "-p", "-t", session, "#{pane_pid}").strip())

    def kill_server(self) -> None:
        # Ends only this private tmux server (its own socket), not other people's tmux.
        self.run("kill-server")


@pytest.fixture
def setup(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict]:
    """Roots, state dir and a wrapper script the remote login shell runs as `nnui`."""
    conftest = ROOT / "tests" / "conftest.py"
    real = (
        (ROOT / "trainer" / "run.py").exists()
        and conftest.exists()
        and "def demo_preprocessed" in conftest.read_text()
        and os.environ.get("NNUI_E2E_TRAINER") != "fake"  # quick local runs
    )
    env = {"NNUI_STATE_DIR": str(tmp_path / "state"), "nnUNet_results": str(tmp_path / "results")}
    # The login shell does not inherit pytest's environment: the suite's isolation from other
    # tests' trainings (conftest: adoption scope, GPU claims folder) must be passed on.
    env.update(
        {k: os.environ[k] for k in ("NNUI_ADOPT_SCOPE", "NNUI_GPU_CLAIMS_DIR") if k in os.environ}
    )
    if real:
        demo = request.getfixturevalue("demo_preprocessed")
        env["nnUNet_preprocessed"] = str(demo.preprocessed)
        dataset = demo.dataset_name
        flags = ["--epochs", "400", "--iterations-per-epoch", "2", "--val-iterations", "1"]
    else:
        make_preprocessed(tmp_path / "preprocessed")
        env["nnUNet_preprocessed"] = str(tmp_path / "preprocessed")
        env["NNUI_TRAINER_SCRIPT"] = str(FAKE_TRAINER)
        dataset = "4"
        flags = ["--epochs", "2000", "--epoch-time", "0.2"]
    wrapper = tmp_path / "nnui"
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    wrapper.write_text(
        f"#!/bin/sh\n{exports}cd {shlex.quote(str(ROOT))}\n"
        f'exec {shlex.quote(sys.executable)} -m app.main "$@"\n'
    )
    wrapper.chmod(0o755)
    sshd = Sshd(tmp_path)
    tmux = Tmux(f"nnui-e2e-{os.getpid()}")
    try:
        yield {"env": env, "wrapper": wrapper, "dataset": dataset, "flags": flags, "real": real,
               "sshd": sshd, "tmux": tmux, "tmp": tmp_path}  # fmt: skip
    finally:
        tmux.kill_server()
        for proc in _nnui_processes({"env": env}):  # a TUI that outlived its session
            with contextlib.suppress(psutil.Error):
                proc.kill()
        cleanup_jobs(Path(env["NNUI_STATE_DIR"]))
        sshd.stop()


def launch_headless(setup: dict, session: str) -> None:
    """Folds 0 and 1 on simulated GPUs 0 and 1 with the headless twin."""
    args = [str(setup["wrapper"]), "launch", setup["dataset"], "3d_fullres", "--simulate-gpus",
            "2", "--folds", "0,1", "--gpus", "0,1", "--", *setup["flags"]]  # fmt: skip
    setup["tmux"].send(session, shlex.join(args))


def start_tui(setup: dict, session: str) -> None:
    """`nnui --simulate-gpus 2` in the remote shell; returns once the dashboard is drawn."""
    tmux = setup["tmux"]
    tmux.send(session, f"{shlex.quote(str(setup['wrapper']))} --simulate-gpus 2")
    drawn = lambda: "q Quit" in tmux.screen(session)  # noqa: E731
    assert wait_until(drawn, SAFETY_NET_S), tmux.screen(session)


def launch_through_tui(setup: dict, session: str) -> None:
    """Keystrokes, as a user would type them: `l` opens the launch screen, space puts fold 0
    on GPU 0, down/right/space fold 1 on GPU 1, `f` + the trainer flags + enter, `g` starts.
    Before each key that depends on the previous ones, the test waits for what they must
    show: the board filled, the flags field focused (the footer offers "Done" instead of
    "Trainer flags"), the flags typed, the board focused again.
    nnui stays open: the hang-up comes while it runs."""
    tmux = setup["tmux"]

    def shows(text: str, where=tmux.screen) -> bool:
        return text in where(session)

    def wait(condition, why: str) -> None:
        assert wait_until(condition, SAFETY_NET_S), f"{why}:\n{tmux.screen(session)}"

    start_tui(setup, session)
    tmux.keys(session, "l")
    wait(lambda: shows("folds × GPUs"), "no launch screen")
    # The dataset list is read in a thread: wait for the demo dataset's row.
    wait(lambda: shows(setup["dataset"].split("_", 1)[-1]), "no dataset row")
    tmux.keys(session, "Space", "Down", "Right", "Space")
    wait(lambda: shows("ready: 2 process(es)"), "the board did not take both folds")
    tmux.keys(session, "f")
    wait(lambda: shows("Done", tmux.footer) and not shows("Trainer flags", tmux.footer),
         "the flags field did not take focus")  # fmt: skip
    flags = " ".join(setup["flags"])
    tmux.type(session, flags)
    tail = " ".join(setup["flags"][-2:])  # the field scrolls: its end is what is visible
    wait(lambda: shows(tail), "the flags were not typed")
    tmux.keys(session, "Enter")
    wait(lambda: shows("Trainer flags", tmux.footer), "the board did not take focus back")
    tmux.keys(session, "g")
    wait(lambda: shows("started 2 job(s)"), "nothing started")


def _jobs(setup: dict) -> list:
    return Registry(Path(setup["env"]["NNUI_STATE_DIR"])).list()


def _epochs(job) -> int:
    path = Path(job.run_dir) / "events.jsonl"
    try:
        return path.read_text().count('"epoch_ended"')
    except OSError:
        return 0


def _nnui_processes(setup: dict) -> list[psutil.Process]:
    """TUIs of this test (python -m app.main with this test's state dir), for clean-up."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "app.main" in (proc.info["cmdline"] or []) and (
                proc.environ().get("NNUI_STATE_DIR") == setup["env"]["NNUI_STATE_DIR"]
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _session_processes(session_id: int) -> list[psutil.Process]:
    """Live processes of one session (zombies excluded: their parent reaps them)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == session_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


EPOCH_CELL = re.compile(r"\b(\d+)/(\d+)\b")


def _job_rows(screen: str, job_ids: set[str]) -> dict[str, str]:
    """The jobs-table line of each job on the captured screen (the one with its epoch N/M;
    the GPU panel and the summary line name the job too)."""
    return {
        j: line
        for line in screen.splitlines()
        for j in job_ids
        if j in line and EPOCH_CELL.search(line)
    }


def _running_with_progress(line: str) -> bool:
    match = EPOCH_CELL.search(line)
    return "running" in line and match is not None and int(match.group(1)) > 0


def test_trainings_survive_ssh_hangup_and_reattach(setup: dict) -> None:
    tmux, sshd = setup["tmux"], setup["sshd"]
    tmux.login("first", sshd)
    launch_through_tui(setup, "first")
    assert wait_until(lambda: len(_jobs(setup)) == 2, SAFETY_NET_S), tmux.screen("first")
    jobs = _jobs(setup)
    assert sorted(j.fold for j in jobs) == ["0", "1"]
    assert sorted(tuple(j.gpus) for j in jobs) == [("0",), ("1",)]
    for job in jobs:  # the flags typed into the board's flags field
        assert job.simulated and job.argv[-len(setup["flags"]) :] == setup["flags"], (
            job.argv,
            tmux.screen("first"),
        )
    first_epochs = lambda: all(_epochs(j) >= 1 for j in _jobs(setup))  # noqa: E731
    assert wait_until(first_epochs, TRAINING_SAFETY_NET_S), tmux.screen("first")

    (tui,) = _nnui_processes(setup)
    login_session = os.getsid(tui.pid)  # the first login's session (its shell and the TUI)
    ssh_pid = tmux.pane_pid("first")
    assert psutil.Process(ssh_pid).name() == "ssh"
    os.kill(ssh_pid, signal.SIGTERM)  # the connection drops: sshd hangs up the login shell
    assert wait_until(lambda: not psutil.pid_exists(ssh_pid) or
                      psutil.Process(ssh_pid).status() == psutil.STATUS_ZOMBIE,
                      SAFETY_NET_S)  # fmt: skip
    # The TUI of the dropped session dies of the hang-up; the trainings must not. Once no
    # process of that login's session is left, the hang-up has reached all it ever will.
    assert wait_until(lambda: not _nnui_processes(setup), SAFETY_NET_S), _nnui_processes(setup)
    gone = lambda: not _session_processes(login_session)  # noqa: E731
    assert wait_until(gone, SAFETY_NET_S), _session_processes(login_session)

    jobs = _jobs(setup)
    for job in jobs:
        assert job.exit_code is None, (job.job_id, job.exit_code, job.note)
        assert all(record_alive(p) for p in job.processes), job.job_id
    before = {j.job_id: _epochs(j) for j in jobs}
    grown = lambda: all(_epochs(j) > before[j.job_id] for j in _jobs(setup))  # noqa: E731
    assert wait_until(grown, TRAINING_SAFETY_NET_S)

    # Log in again, start nnui: both jobs are re-attached, running, with their progress.
    tmux.login("second", sshd)
    start_tui(setup, "second")
    job_ids = {j.job_id for j in jobs}

    def both_rows_running() -> bool:
        rows = _job_rows(tmux.screen("second"), job_ids)
        return set(rows) == job_ids and all(_running_with_progress(r) for r in rows.values())

    assert wait_until(both_rows_running, SAFETY_NET_S), tmux.screen("second")
    tmux.keys("second", "q")  # quit leaves the jobs running
    assert wait_until(lambda: not _nnui_processes(setup), SAFETY_NET_S)

    # The headless twin agrees.
    out = setup["tmp"] / "status.json"
    nnui = shlex.quote(str(setup["wrapper"]))
    tmux.send("second", f"{nnui} status --json > {out}.tmp && mv {out}.tmp {out}")
    assert wait_until(out.exists, SAFETY_NET_S), tmux.screen("second")
    rows = {row["id"]: row for row in json.loads(out.read_text())}
    assert set(rows) == job_ids
    for row in rows.values():
        assert row["state"] == "running", row
        assert row["epoch"] >= 1 and row["simulated"]

    # Stop both by their verified pids (SIGTERM, then SIGKILL), and see them end.
    registry = Registry(Path(setup["env"]["NNUI_STATE_DIR"]))
    for job in _jobs(setup):
        records = kill(job, registry, grace_s=5.0)
        assert records and all(r.result == "sent" for r in records if r.signal == "SIGTERM")
    ended = lambda: all(j.exit_code is not None for j in _jobs(setup))  # noqa: E731
    assert wait_until(ended, SAFETY_NET_S)
    # (the supervisor writes the exit code, then ends itself)
    assert wait_until(lambda: not any(job_alive(j) for j in _jobs(setup)), SAFETY_NET_S)
