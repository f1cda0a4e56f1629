"""Trainings outlive an SSH hang-up, and a new login re-attaches to them (real sshd + tmux).

sshd on 127.0.0.1 (free port), a tmux pane running `ssh` to it, `nnui launch` inside the
session on a simulated 2-GPU machine (folds 0 and 1, one per GPU); then the ssh client is
killed by its pid, the trainings must keep running (pids alive, events growing), and after
logging in again `nnui status` shows both jobs with progress. Uses the real trainer when it
and the demo data fixture exist, else tests/fake_trainer.py. Facts: shared/notes/ssh-local.md.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fake_trainer import FAKE_TRAINER, cleanup_jobs, make_preprocessed, wait_until

from app.services.registry import Registry
from app.services.signals import is_same_process

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("sshd", "ssh", "ssh-keygen", "tmux")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

pytestmark = pytest.mark.slow


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
        if not wait_until(self._listening, 10):
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
                                text=True, timeout=10)  # fmt: skip
        return result.stdout

    def login(self, session: str, sshd: Sshd) -> None:
        self.run("new-session", "-d", "-s", session, "-x", "160", "-y", "48", sshd.ssh_command())
        marker = f"logged-in-{session}"
        # The remote shell answers once the login is complete.
        assert wait_until(lambda: self._try_marker(session, marker), 20), self.screen(session)

    def _try_marker(self, session: str, marker: str) -> bool:
        if marker in self.screen(session).replace("echo " + marker, ""):
            return True
        self.send(session, f"echo {marker}")
        time.sleep(0.3)
        return marker in self.screen(session).replace("echo " + marker, "")

    def send(self, session: str, line: str) -> None:
        self.run("send-keys", "-t", session, line, "Enter")

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
        cleanup_jobs(Path(env["NNUI_STATE_DIR"]))
        sshd.stop()


def launch_headless(setup: dict, session: str) -> None:
    """Folds 0 and 1 on simulated GPUs 0 and 1 with the headless twin."""
    args = [str(setup["wrapper"]), "launch", setup["dataset"], "3d_fullres", "--simulate-gpus",
            "2", "--folds", "0,1", "--gpus", "0,1", "--", *setup["flags"]]  # fmt: skip
    setup["tmux"].send(session, shlex.join(args))


def launch_through_tui(setup: dict, session: str) -> None:
    """TODO(lead): the TUI keystroke sequence — start `nnui --simulate-gpus 2` in the pane, put
    fold 0 on GPU 0 and fold 1 on GPU 1 on the fold board, launch, confirm, quit with `q`
    (jobs keep running). Until wired, the headless launch stands in (same services)."""
    launch_headless(setup, session)


def _jobs(setup: dict) -> list:
    return Registry(Path(setup["env"]["NNUI_STATE_DIR"])).list()


def _epochs(job) -> int:
    path = Path(job.run_dir) / "events.jsonl"
    try:
        return path.read_text().count('"epoch_ended"')
    except OSError:
        return 0


def test_trainings_survive_ssh_hangup_and_reattach(setup: dict) -> None:
    tmux, sshd = setup["tmux"], setup["sshd"]
    tmux.login("first", sshd)
    launch_through_tui(setup, "first")
    startup_s = 120 if setup["real"] else 20
    assert wait_until(lambda: len(_jobs(setup)) == 2, 30), tmux.screen("first")
    assert wait_until(lambda: all(_epochs(j) >= 1 for j in _jobs(setup)), startup_s), tmux.screen(
        "first"
    )

    ssh_pid = tmux.pane_pid("first")
    assert psutil.Process(ssh_pid).name() == "ssh"
    os.kill(ssh_pid, signal.SIGTERM)  # the connection drops: sshd hangs up the login shell
    assert wait_until(lambda: not psutil.pid_exists(ssh_pid) or
                      psutil.Process(ssh_pid).status() == psutil.STATUS_ZOMBIE, 10)  # fmt: skip
    time.sleep(2.0)  # give SIGHUP every chance to reach anything still attached

    jobs = _jobs(setup)
    for job in jobs:
        assert job.exit_code is None, (job.job_id, job.exit_code, job.note)
        assert all(is_same_process(p.pid, p.create_time) for p in job.processes), job.job_id
    before = {j.job_id: _epochs(j) for j in jobs}
    grown = lambda: all(_epochs(j) > before[j.job_id] for j in _jobs(setup))  # noqa: E731
    assert wait_until(grown, 60 if setup["real"] else 10)

    tmux.login("second", sshd)
    out = setup["tmp"] / "status.json"
    nnui = shlex.quote(str(setup["wrapper"]))
    command = f"{nnui} status --json > {out}.tmp && mv {out}.tmp {out} && {nnui} status"
    tmux.send("second", command)
    assert wait_until(out.exists, 30), tmux.screen("second")
    rows = {row["id"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {j.job_id for j in jobs}
    assert sorted(r["fold"] for r in rows.values()) == ["0", "1"]
    for row in rows.values():
        assert row["state"] == "running", row
        assert row["epoch"] >= 1 and row["simulated"]
    # The table in the new login shows both re-attached jobs.
    on_screen = lambda: all(job_id in tmux.screen("second") for job_id in rows)  # noqa: E731
    assert wait_until(on_screen, 15), tmux.screen("second")
