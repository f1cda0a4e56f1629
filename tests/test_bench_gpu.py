"""bench/gpu.py --check, the GPU-readiness command, on a machine without a GPU: one line
that says so and a non-zero exit, before any data is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, even on a GPU machine
    argv = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--check", "--work", str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: no CUDA GPU present (torch sees none): the GPU check needs one; "
        "`--device cpu` checks the script itself"
    ]
    assert list(tmp_path.iterdir()) == []  # nothing prepared


def test_gpu_check_is_asked_for_by_name(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--work", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--check" in done.stderr.splitlines()[-1]
