"""A one-node SLURM cluster for tests: munged, slurmctld and slurmd started and stopped by PID.

Installs nothing (.ci/slurm-setup does that in CI). Needs root, as on CI (Debian 12, no
systemd). Facts: shared/notes/slurm-local.md.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SLURM_CONF = """\
ClusterName=nnuitest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType={proctrack}
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
KillWait=10
InactiveLimit=0
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/state/slurmctld.pid
SlurmdPidFile={dir}/spool/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
"""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be started here, or None."""
    for tool in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (run .ci/slurm-setup)"
    if os.geteuid() != 0:
        return "a test SLURM cluster needs root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sbin(tool: str) -> str:
    return shutil.which(tool) or f"/usr/sbin/{tool}"


@dataclass
class Cluster:
    """A running cluster. `env` points the SLURM clients at it (SLURM_CONF)."""

    directory: Path
    conf: Path
    pids: dict[str, int] = field(default_factory=dict)
    lock_fd: int | None = None  # the box-wide test-cluster lock (see start_cluster)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(argv), capture_output=True, text=True, check=check, timeout=60,
            env={**os.environ, **self.env},
        )  # fmt: skip

    def submit(self, script: Path, *options: str) -> int:
        out = self.run("sbatch", "--parsable", *options, str(script)).stdout.strip()
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, ...)."""
        text = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: int, timeout_s: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in (
                "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            ):  # fmt: skip
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout_s} s")
            time.sleep(0.5)

    def wait_running(self, job_id: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.job(job_id).get("JobState") != "RUNNING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not running after {timeout_s} s")
            time.sleep(0.2)

    def drain(self, timeout_s: float = 60) -> None:
        """Cancel this cluster's jobs (all a test's own: the cluster is private) and wait until
        none is left: a batch shell still running when slurmd stops outlives the test."""
        ids = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if ids:
            self.run("scancel", *ids, check=False)
        deadline = time.monotonic() + timeout_s
        while self.run("squeue", "-h", "-o", "%i", check=False).stdout.strip():
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)

    def stop(self) -> None:
        if "slurmctld" in self.pids and "slurmd" in self.pids:
            self.drain()
        # Reverse start order; each daemon by its own PID, then SIGKILL if it lingers.
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done == pid:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the next suite's cluster may start now
            self.lock_fd = None


def _spawn(name: str, argv: list[str], log: Path, pids: dict[str, int]) -> None:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    pids[name] = proc.pid


def _wait(predicate, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"test SLURM cluster: {what} not ready after {timeout_s} s")
        time.sleep(0.2)


def start_cluster(directory: Path, cpus: int | None = None) -> Cluster:
    """Start munged (unless one runs), slurmctld and slurmd; return once the node is idle.

    One test cluster on the box at a time: two suites at once (the load check) would share
    one munged (the second sees the first's and uses it) and lose it when the first stops.
    The second waits on a box-wide lock until the first cluster is stopped."""
    lock_fd = os.open(Path(tempfile.gettempdir()) / "nnui-test-slurm.lock",
                      os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)  # fmt: skip
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # blocks until no other test cluster runs
    try:
        cluster = _start_cluster(directory, cpus)
    except BaseException:
        os.close(lock_fd)
        raise
    cluster.lock_fd = lock_fd  # released by cluster.stop()
    return cluster


def _start_cluster(directory: Path, cpus: int | None) -> Cluster:
    directory.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (directory / sub).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    cgroup_ok = Path("/sys/fs/cgroup/freezer").is_dir()
    conf = directory / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host, dir=directory, cpus=cpus or os.cpu_count() or 1, memory_mb=2000,
            ctld_port=_free_port(), slurmd_port=_free_port(),
            proctrack="proctrack/cgroup" if cgroup_ok else "proctrack/linuxproc",
        )
    )  # fmt: skip
    (directory / "cgroup.conf").write_text(CGROUP_CONF)
    cluster = Cluster(directory, conf)
    try:
        munge_ok = subprocess.run("munge -n | unmunge", shell=True, capture_output=True)
        if munge_ok.returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            # setpriv execs (runuser would fork): the PID we keep is munged's own.
            as_munge = ["setpriv", "--reuid=munge", "--regid=munge", "--init-groups"]
            argv = [*as_munge, _sbin("munged"), "--foreground"]
            _spawn("munged", argv, directory / "munged.log", cluster.pids)
            _wait(
                lambda: subprocess.run("munge -n | unmunge", shell=True,
                                       capture_output=True).returncode == 0,
                "munged", 20,
            )  # fmt: skip
        _spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(conf)],
               directory / "slurmctld.out", cluster.pids)  # fmt: skip
        _spawn("slurmd", [_sbin("slurmd"), "-D", "-f", str(conf)],
               directory / "slurmd.out", cluster.pids)  # fmt: skip

        def idle() -> bool:
            done = cluster.run("sinfo", "-h", "-N", "-o", "%t", check=False)
            return done.returncode == 0 and done.stdout.strip() == "idle"

        _wait(idle, "slurmd (node idle)", 60)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def running_cluster(tmp_path_factory) -> Iterator[Cluster]:
    """The body of every test file's module-scoped `cluster` fixture: skipped where SLURM is
    missing (a failure in CI, where it must run), stopped after the module."""
    import pytest

    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM end-to-end tests must run in CI: {reason}")
        pytest.skip(reason)
    running = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield running
    finally:
        running.stop()
