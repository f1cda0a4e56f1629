"""`make setup` after an interrupted one (issue 14): the real Makefile against fakes.

A fake `python3` first on PATH stands in for the bootstrap interpreter: `-m venv [--clear]
[--without-pip] DIR` makes DIR/bin/python, a stub that logs its argv and fakes pip and the
imports with marker files under DIR/site (so `--clear` wipes them, as it wipes a real venv's
packages). Each test builds one interrupted state, runs `make setup VENV=<tmp>`, and asserts
the commands run, the exit status and whether the stamp was written. No network, no pip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the Makefile's default TORCH
CONSTRAINTS = ".ci/constraints-cpu.txt"  # its default CONSTRAINTS
PROJECT = f"-c {CONSTRAINTS} -e .[dev,nnunet,plot]"

# <venv>/bin/python. FAKE_PROJECT: "ok" (an install makes the project import), "once" (a
# plain install leaves it broken, --force-reinstall repairs it), "never" (nothing does).
STUB = r"""#!/bin/sh
site="$(dirname "$0")/../site"
printf 'PY %s\n' "$*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = pip ]; then
  [ -e "$site/pip" ] || { echo "No module named pip" >&2; exit 1; }
  [ "$3" = install ] || exit 0
  for arg in "$@"; do
    case "$arg" in
      torch*) touch "$site/torch" ;;
      -e) case "$FAKE_PROJECT:$*" in
            never:*) ;;
            once:*--force-reinstall*) touch "$site/project" ;;
            once:*) ;;
            *) touch "$site/project" ;;
          esac ;;
    esac
  done
  exit 0
fi
if [ "$1" = -c ]; then
  case "$2" in
    "import torch") [ -e "$site/torch" ]; exit ;;
    "import app.main"*) [ -e "$site/project" ]; exit ;;
  esac
fi
exit 3
"""

FAKE_PYTHON3 = r"""#!/bin/sh
printf 'python3 %s\n' "$*" >> "$FAKE_LOG"
[ "$1" = -m ] && [ "$2" = venv ] || exit 3
shift 2
clear=; pip=1; dir=
for arg in "$@"; do
  case "$arg" in
    --clear) clear=1 ;;
    --without-pip) pip= ;;
    -*) exit 3 ;;
    *) dir=$arg ;;
  esac
done
case "$dir" in "$FAKE_ROOT"/*) ;; *) echo "refusing $dir" >&2; exit 4 ;; esac
if [ -n "$clear" ]; then rm -rf "$dir"; fi
mkdir -p "$dir/bin" "$dir/site"
cp "$FAKE_ROOT/stub" "$dir/bin/python"
chmod +x "$dir/bin/python"
if [ -n "$pip" ]; then touch "$dir/site/pip"; fi
exit 0
"""


@pytest.fixture
def box(tmp_path: Path) -> Path:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (tmp_path / "stub").write_text(STUB)
    (fake_bin / "python3").write_text(FAKE_PYTHON3)
    (fake_bin / "python3").chmod(0o755)
    (tmp_path / "log").touch()
    return tmp_path


def _env(box: Path, project: str = "ok") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env.update(PATH=f"{box / 'bin'}{os.pathsep}{env.get('PATH', '')}", FAKE_LOG=str(box / "log"),
               FAKE_ROOT=str(box), FAKE_PROJECT=project)  # fmt: skip
    return env


def make_venv(box: Path, *, pip: bool = True, torch: bool = False, project: bool = False) -> Path:
    """A venv as an interrupted `make setup` may leave it (made by the fake python3)."""
    venv = box / "venv"
    flags = [] if pip else ["--without-pip"]
    python3 = str(box / "bin" / "python3")
    subprocess.run([python3, "-m", "venv", *flags, str(venv)], env=_env(box), check=True)
    for name, present in (("torch", torch), ("project", project)):
        if present:
            (venv / "site" / name).touch()
    (box / "log").write_text("")
    return venv


def setup(box: Path, project: str = "ok") -> tuple[int, list[str]]:
    """`make setup` on the real Makefile; its exit status and the commands the fakes saw."""
    (box / "log").write_text("")
    done = subprocess.run(
        ["make", "-C", str(REPO), "setup", f"VENV={box / 'venv'}"],
        env=_env(box, project), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # The project's import check is named as such, whatever modules it lists.
    log = [
        "PY -c import project" if line.startswith("PY -c import app.main") else line
        for line in (box / "log").read_text().splitlines()
    ]
    return done.returncode, log


def stamp(box: Path) -> Path:
    return box / "venv" / ".installed"


UPGRADE_PIP = "PY -m pip install -q --upgrade pip"
REINSTALL_TORCH = f"PY -m pip install -q --force-reinstall {TORCH}"
INSTALL = f"PY -m pip install -q {PROJECT}"
REINSTALL = f"PY -m pip install -q --force-reinstall {PROJECT}"


@pytest.mark.parametrize("state", ["empty dir", "without pip"])
def test_a_venv_without_pip_is_made_anew(box, state) -> None:
    if state == "empty dir":
        (box / "venv").mkdir()
        head = []  # no bin/python to log the failed pip check
    else:
        make_venv(box, pip=False, torch=True, project=True)  # --clear drops these
        head = ["PY -m pip --version"]
    rc, log = setup(box)
    assert rc == 0
    assert log == [*head, f"python3 -m venv --clear {box / 'venv'}", UPGRADE_PIP,
                   "PY -c import torch", REINSTALL_TORCH, INSTALL,
                   "PY -c import project", "PY -c import project"]  # fmt: skip
    assert stamp(box).exists()


def test_a_torch_that_does_not_import_is_installed_again(box) -> None:
    make_venv(box, pip=True, torch=False, project=True)
    rc, log = setup(box)
    assert rc == 0
    assert log == ["PY -m pip --version", UPGRADE_PIP, "PY -c import torch", REINSTALL_TORCH,
                   INSTALL, "PY -c import project", "PY -c import project"]  # fmt: skip
    assert stamp(box).exists()


def test_a_project_that_does_not_import_is_installed_again(box) -> None:
    make_venv(box, pip=True, torch=True)
    rc, log = setup(box, project="once")
    assert rc == 0
    # pip and torch work: neither the venv nor torch is touched.
    assert log == ["PY -m pip --version", UPGRADE_PIP, "PY -c import torch", INSTALL,
                   "PY -c import project", REINSTALL, "PY -c import project"]  # fmt: skip
    assert stamp(box).exists()


def test_no_stamp_while_the_project_does_not_import_and_the_next_run_repairs(box) -> None:
    make_venv(box, pip=True, torch=True)
    rc, log = setup(box, project="never")
    assert rc != 0
    assert log[-3:] == ["PY -c import project", REINSTALL, "PY -c import project"]
    assert not stamp(box).exists()
    rc, log = setup(box)  # whatever broke it is gone: the next `make setup` finishes
    assert rc == 0 and stamp(box).exists()
    assert log == ["PY -m pip --version", UPGRADE_PIP, "PY -c import torch", INSTALL,
                   "PY -c import project", "PY -c import project"]  # fmt: skip


def test_a_complete_venv_is_left_alone(box) -> None:
    make_venv(box, pip=True, torch=True, project=True)
    newest = max((REPO / p).stat().st_mtime for p in ("pyproject.toml", CONSTRAINTS))
    stamp(box).touch()
    os.utime(stamp(box), (newest + 60, newest + 60))  # newer than its prerequisites
    rc, log = setup(box)
    assert rc == 0
    assert log == []
    assert stamp(box).exists()


def test_the_license_is_an_spdx_string_setuptools_reads_without_a_warning() -> None:
    """A TOML table is deprecated (setuptools warns twice at every install); the string
    form needs setuptools >= 77, which the build requires."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert project["build-system"]["requires"] == ["setuptools>=77"]
