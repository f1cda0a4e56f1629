"""app/services/slurm/script.py: the generated job script (syntax, content) and its signal logic.

The signal logic is exercised without SLURM: fake `srun`/`scontrol` on PATH and a fake
torchrun whose two workers catch SIGUSR1 only after a delay (as real workers do after
Python starts), so an early USR1 must be held back and forwarded later, and torchrun itself
must never see it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.cli import sbatch
from app.services.slurm import script as slurm

SPEC = slurm.JobSpec(
    dataset="Dataset900_NnuiDemo",
    configuration="3d_fullres",
    fold="0",
    nodes=2,
    gpus_per_node=4,
    time_limit="1-02:00:00",
    procs_per_node=1,
    output_dir=Path("/tmp/nnui_slurm_out"),
    workdir=Path("/tmp"),
    python="/opt/venv/bin/python",
    trainer_args=("--epochs", "100"),
)


def _bash_n(text: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("changes", "present", "absent"),
    [
        (
            {},
            [
                "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                "#SBATCH --time=1-02:00:00", "#SBATCH --signal=B:USR1@600",
                "#SBATCH --chdir=/tmp", "#SBATCH --output=/tmp/nnui_slurm_out/",
                "trap 'stop=1' USR1", "(trap '' USR1; exec /opt/venv/bin/python -m "
                "torch.distributed.run", '"--nnodes=$SLURM_NNODES"', "--nproc_per_node=4",
                "--rdzv_backend=c10d", '"--rdzv_endpoint=$NNUI_HEAD:$NNUI_PORT"',
                "NNUI_PORT=$((20000 + SLURM_JOB_ID % 20000))",
                '"--rdzv_id=$SLURM_JOB_ID"',
                "-m trainer Dataset900_NnuiDemo 3d_fullres 0 --c -device cuda --epochs 100",
                'pgrep -P "$torchrun_pid"', 'kill -USR1 "$kid"', 'kill -USR1 "$srun_pid"',
                'while kill -0 "$srun_pid"', 'wait "$srun_pid"',
            ],
            ["--partition", "--account", "--cpus-per-task", "pkill"],
        ),
        (
            {"gpus_per_node": 0, "procs_per_node": 2, "nodes": 1, "signal_lead_s": 45,
             "partition": "debug", "account": "lab", "cpus_per_task": 2, "rdzv_port": 29999},
            ["#SBATCH --signal=B:USR1@45", "--nproc_per_node=2", "-device cpu",
             "#SBATCH --partition=debug", "#SBATCH --account=lab", "#SBATCH --cpus-per-task=2",
             'NNUI_PORT=29999', "--standalone --nnodes=1", '[ "$caught" -ge 2 ]'],
            ["--gpus-per-node", "-device cuda", "--rdzv_endpoint"],
        ),
        (
            {"trainer_args": ("--save-every", "1", "--results", "/r w/x")},
            ["--c -device cuda --save-every 1 --results '/r w/x'"],
            [],
        ),
        ({"env": {"nnUNet_results": "/data/res"}}, ["export nnUNet_results=/data/res"], []),
    ],
)  # fmt: skip
def test_render_script(changes, present, absent, tmp_path) -> None:
    text = slurm.render_script(replace(SPEC, **changes))
    _bash_n(text, tmp_path)
    for snippet in present:
        assert snippet in text, snippet
    for snippet in absent:
        assert snippet not in text, snippet


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["D", "2d", "7", "--time", "1:00:00"], "fold '7'"),
        (["D", "2d", "0", "--time", "90"], "--time must look like"),
        (["D", "2d", "0", "--time", "1:00:00", "--nodes", "0"], "--nodes must be >= 1"),
        (["D", "2d", "0", "--time", "1:00:00", "--gpus-per-node", "-1"], "--gpus-per-node"),
        (["D", "2d", "0", "--time", "1:00:00", "--signal-lead", "-5"], "--signal-lead"),
        (["D", "2d", "0", "--time", "00:10:00"], "not shorter than --time"),
        (["D", "2d", "0", "--time", "00:01:00", "--signal-lead", "60"], "not shorter"),
        (["D", "2d", "0", "--time", "1:00:00", "--", "-num_gpus", "2"], "-num_gpus"),
        (["D", "2d", "0", "--time", "1:00:00", "--", "--c"], "--c"),
    ],
)
def test_bad_arguments_are_one_error_line(args, message, capsys, tmp_path) -> None:
    assert sbatch.sbatch_main([*args, "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["D", "2d", "0"], "the following arguments are required: --time"),
        (["D", "2d"], "the following arguments are required: fold"),
        (["D", "2d", "0", "--time", "1:00:00", "--nodes", "two"], "--nodes: invalid int value"),
        (["D", "2d", "0", "--time", "1:00:00", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_argparse_errors_are_one_line_with_a_hint(args, message, capsys, tmp_path) -> None:
    assert sbatch.sbatch_main([*args, "--output", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert err[0].endswith("(see nnui sbatch --help)") and "usage:" not in captured.err
    assert not list(tmp_path.iterdir())


def test_unwritable_output_is_one_error_line(capsys) -> None:
    argv = ["D", "2d", "0", "--time", "1:00:00", "--output", "/proc/nope", "--no-check"]
    assert sbatch.sbatch_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write the job script"), err
    assert "/proc/nope" in err[0] and "--output" in err[0]


@pytest.fixture
def preprocessed_root(tmp_path, monkeypatch) -> Path:
    """A preprocessed root with Dataset900_NnuiDemo planned for 3d_fullres only."""
    root = tmp_path / "pre"
    (root / "Dataset900_NnuiDemo").mkdir(parents=True)
    plans = {"plans_name": "nnuiPlans", "configurations": {"3d_fullres": {}}}
    (root / "Dataset900_NnuiDemo" / "nnuiPlans.json").write_text(json.dumps(plans))
    (root / "Dataset900_NnuiDemo" / "myPlans.json").write_text(
        json.dumps({"configurations": {"2d": {}}})
    )
    (root / "Dataset901_Broken").mkdir()
    (root / "Dataset901_Broken" / "nnuiPlans.json").write_text("{not json")
    monkeypatch.setenv("nnUNet_preprocessed", str(root))
    return root


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["900", "3d_fullres"], None),
        (["Dataset900_NnuiDemo", "3d_fullres"], None),
        (["900", "2d", "--", "-p", "myPlans"], None),
        (["902", "3d_fullres"], "no dataset with id 902"),
        (["900", "2d"], "configuration '2d' is not preprocessed for Dataset900_NnuiDemo "
         "(plans have: 3d_fullres); run nnui-preprocess Dataset900_NnuiDemo -c 2d"),
        (["900", "3d_fullres", "--", "-p", "myPlans"], "configuration '3d_fullres'"),
        (["900", "3d_fullres", "--", "-p", "nope"], "no readable plans at"),
        (["901", "3d_fullres"], "no readable plans at"),
        (["900", "3d_fullres", "--", "--preprocessed", "/nonexistent"], "no dataset with id 900"),
    ],
)  # fmt: skip
def test_dataset_and_configuration_are_checked(
    preprocessed_root, tmp_path, capsys, args, message
) -> None:
    dataset, configuration, *rest = args
    out = tmp_path / "out"
    argv = [dataset, configuration, "0", "--time", "1:00:00", "--output", str(out), *rest]
    if message is None:
        assert sbatch.sbatch_main(argv) == 0, capsys.readouterr().err
        return
    assert sbatch.sbatch_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert err[0].endswith("pass --no-check if the data lives only on the cluster")
    assert not out.exists()
    cut = argv.index("--") if "--" in argv else len(argv)
    assert sbatch.sbatch_main([*argv[:cut], "--no-check", *argv[cut:]]) == 0  # skipped


def test_sbatch_main_writes_script_and_submits(tmp_path, capsys, monkeypatch) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "sbatch").write_text('#!/bin/sh\necho "Submitted batch job 42 for $1"\n')
    (fake_bin / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    monkeypatch.setenv("nnUNet_preprocessed", "/data/pre")
    argv = ["Dataset900_NnuiDemo", "2d", "all", "--time", "01:30:00", "--gpus-per-node", "0",
            "--procs-per-node", "2", "--output", str(tmp_path / "out"), "--no-check"]  # fmt: skip
    assert sbatch.sbatch_main(argv) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == tmp_path / "out" and os.access(path, os.X_OK)
    assert "export nnUNet_preprocessed=/data/pre" in path.read_text()
    assert sbatch.sbatch_main([*argv, "--submit"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        str(path),
        f"Submitted batch job 42 for {path}",
    ]


# ---- the signal logic, with fakes -------------------------------------------------------

FAKE_TORCHRUN = r"""
import os, signal, subprocess, sys
out = os.environ["FAKE_OUT"]
# A worker catches USR1 only after a start-up delay, then exits 0 when it arrives.
worker = (
    "import os, signal, sys, time; time.sleep(1.5);"
    "h = lambda *a: (open(sys.argv[1], 'a').write('usr1\\n'), os._exit(0));"
    "signal.signal(signal.SIGUSR1, h); open(sys.argv[1] + '.ready', 'w').close();"
    "time.sleep(float(os.environ.get('FAKE_WORK_S', '60')));"
    "sys.exit(int(os.environ.get('FAKE_RC', '0')))"
)
open(os.path.join(out, "torchrun.pid"), "w").write(str(os.getpid()))
argvs = [[sys.executable, "-c", worker, os.path.join(out, f"w{i}")] for i in range(2)]
kids = [subprocess.Popen(argv) for argv in argvs]
sys.exit(max(k.wait() for k in kids))
"""


@pytest.fixture
def fake_cluster(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        # srun: drop its options, become the task (so srun's pid is the node wrapper's).
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": '#!/bin/bash\ncase "$*" in *hostnames*) echo localhost ;; '
        "*step*) echo 'StepId=1.0 State=RUNNING' ;; esac\n",
        "python": f"#!/bin/bash\nexec {sys.executable} {tmp_path / 'fake_torchrun.py'}\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "fake_torchrun.py").write_text(FAKE_TORCHRUN)
    spec = replace(SPEC, nodes=1, gpus_per_node=0, procs_per_node=2, python=str(bin_dir / "python"))
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render_script(spec))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_OUT=str(tmp_path),
               SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost")  # fmt: skip
    started: list[subprocess.Popen] = []

    def start(**extra: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            ["bash", str(script)], env={**env, **extra}, stderr=subprocess.PIPE, text=True
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    pid_file = tmp_path / "torchrun.pid"
    if pid_file.exists():
        # The fake torchrun and its workers, if a test failed half-way.
        pid = int(pid_file.read_text())
        for kid in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                  text=True).stdout.split():  # fmt: skip
            os.kill(int(kid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_file(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, path
        time.sleep(0.05)


@pytest.mark.parametrize("when", ["before the workers catch it", "while they run"])
def test_usr1_to_batch_shell_reaches_workers_only(fake_cluster, tmp_path, when) -> None:
    proc = fake_cluster()
    _wait_file(tmp_path / "torchrun.pid")
    if when == "while they run":
        _wait_file(tmp_path / "w0.ready")
        _wait_file(tmp_path / "w1.ready")
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    for worker in ("w0", "w1"):
        assert (tmp_path / worker).read_text() == "usr1\n"  # exactly once
    assert "training step ended with exit code 0" in stderr


def test_script_exits_with_the_step_code(fake_cluster, tmp_path) -> None:
    proc = fake_cluster(FAKE_WORK_S="0", FAKE_RC="3")
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 3, stderr
    assert not (tmp_path / "w0").exists()


# ---- the nnU-Net engine: one node, nnUNetv2_train with nnui's extension trainer ----------

FAKE_NNUNET = r"""
import os, signal, sys, time
out = os.environ["FAKE_OUT"]
open(os.path.join(out, "torchrun.pid"), "w").write(str(os.getpid()))
time.sleep(1.5)  # catches USR1 only after a start-up delay, as a real trainer
signal.signal(signal.SIGUSR1, lambda *a: (open(os.path.join(out, "w0"), "a").write("usr1\n"),
                                           os._exit(0)))
time.sleep(60)
sys.exit(1)
"""


def test_nnunet_script_runs_the_extension_trainer_on_one_node() -> None:
    spec = replace(SPEC, engine="nnunet", nodes=1, gpus_per_node=2,
                   trainer_args=("-tr", "nnUNetTrainerNoMirroring", "--epochs", "5"),
                   env={"nnUNet_extTrainer": "/ext"})  # fmt: skip
    text = slurm.render_script(spec)
    assert "-m trainer.nnunet_engine" in text and "torch.distributed.run" not in text
    assert "-tr nnUNetTrainerNoMirroring_nnui -p nnUNetPlans --c -device cuda" in text
    assert "--epochs 5 -num_gpus 2" in text and "export nnUNet_extTrainer=/ext" in text
    assert 'pgrep -P "$torchrun_pid"' in text  # -num_gpus: the ranks are its children
    with pytest.raises(ValueError, match="one node"):
        slurm.render_script(replace(spec, nodes=2))


def test_usr1_reaches_a_single_gpu_nnunet_trainer_itself(tmp_path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": '#!/bin/bash\ncase "$*" in *hostnames*) echo localhost ;; '
        "*step*) echo 'StepId=1.0 State=RUNNING' ;; esac\n",
        "python": f"#!/bin/bash\nexec {sys.executable} {tmp_path / 'fake_nnunet.py'}\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "fake_nnunet.py").write_text(FAKE_NNUNET)
    spec = replace(SPEC, engine="nnunet", nodes=1, gpus_per_node=1, python=str(bin_dir / "python"))
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.render_script(spec))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_OUT=str(tmp_path),
               SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost")  # fmt: skip
    proc = subprocess.Popen(["bash", str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_file(tmp_path / "torchrun.pid")
        proc.send_signal(signal.SIGUSR1)  # before the trainer catches it: kept, then sent
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        pid = int((tmp_path / "torchrun.pid").read_text())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr
    assert (tmp_path / "w0").read_text() == "usr1\n"
