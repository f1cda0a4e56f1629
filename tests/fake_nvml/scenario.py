"""Build the fake libnvidia-ml.so.1 (fake_nvml.c) and write its scenario file.

A scenario is a dict: {"gpus": [gpu, ...], "errors": [{"gpu": i or -1, "fn": name or "*",
"code": NVML code}, ...]}; a gpu is {"name", "uuid", "bus_id", "mem_total", "mem_used",
"util", "temp", "power_mw", "limit_mw", "fan", "mig", "max_mig", "grow", "procs": [{"pid",
"used", "mig"?}], "migs": [{"slot", "uuid", "mem_total", "mem_used"}]}; -1 in a number
means "not supported". It is written as the tab-separated line format the C side reads
(documented at the top of fake_nvml.c), atomically, so a running nnui sees either the old
or the new machine.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from itertools import count
from pathlib import Path
from types import ModuleType
from typing import Any

SOURCE = Path(__file__).with_name("fake_nvml.c")
LIBRARY_NAME = "libnvidia-ml.so.1"
SCENARIO_ENV = "FAKE_NVML_SCENARIO"
LOG_ENV = "FAKE_NVML_LOG"
GIB = 1024**3
_copies = count()
NOT_SUPPORTED, GPU_IS_LOST, DRIVER_NOT_LOADED = 3, 15, 9


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build_library(folder: Path) -> Path:
    """Compile fake_nvml.c into folder/libnvidia-ml.so.1 (the loader's name for NVML)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / LIBRARY_NAME
    argv = [compiler() or "cc", "-shared", "-fPIC", "-O1", "-Wall",
            "-o", str(target), str(SOURCE)]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, text=True)
    return target


def load_pynvml(library: Path) -> ModuleType:
    """A private copy of the real nvidia-ml-py module whose library is the fake: the module's
    own loader is left alone (it would dlopen libnvidia-ml.so.1 by name); only its
    `nvmlLib` is set first, which its _LoadNvmlLibrary then keeps."""
    import pynvml

    name = f"pynvml_on_fake_{next(_copies)}"  # its error classes look themselves up by name
    spec = importlib.util.spec_from_file_location(name, pynvml.__file__)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.nvmlLib = ctypes.CDLL(str(library))
    return module


def h200(index: int, **changes: Any) -> dict:
    """One idle H200 at PCI bus 0x18 + 0x10 * index, as an 8-GPU HGX board shows them."""
    gpu = {
        "name": "NVIDIA H200",
        "uuid": f"GPU-{index:x}{index:x}{index:x}{index:x}a0b1-c2d3-e4f5-0617-28394a5b6c7d",
        "bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0",
        "mem_total": 143771 * 1024**2,
        "mem_used": 512 * 1024**2,
        "util": 0,
        "temp": 30 + index,
        "power_mw": 75_000 + 1000 * index,
        "limit_mw": 700_000,
        "fan": -1,  # passively cooled, as SXM boards are
        "mig": 0,
        "max_mig": 7,
        "procs": [],
        "migs": [],
    }
    gpu.update(changes)
    return gpu


def h200_box(num_gpus: int = 8) -> dict:
    return {"gpus": [h200(i) for i in range(num_gpus)], "errors": []}


def _line(kind: str, fields: dict) -> str:
    parts = [kind]
    for key, value in fields.items():
        text = str(int(value)) if isinstance(value, bool | int) else str(value)
        if "\t" in text or "\n" in text:
            raise ValueError(f"{key}: tabs and newlines cannot be written")
        parts.append(f"{key}={text}")
    return "\t".join(parts)


def scenario_lines(scenario: dict) -> list[str]:
    lines = []
    for index, gpu in enumerate(scenario.get("gpus", [])):
        bus = int(gpu["bus_id"].split(":")[1], 16)
        plain = {k: v for k, v in gpu.items() if k not in ("procs", "migs")}
        lines.append(_line("gpu", {"index": index, "domain": 0, "bus": bus, **plain}))
        for mig in gpu.get("migs", []):
            lines.append(_line("mig", {"gpu": index, **mig}))
        for proc in gpu.get("procs", []):
            lines.append(_line("proc", {"gpu": index, **proc}))
    for error in scenario.get("errors", []):
        lines.append(_line("err", error))
    return lines


def write_scenario(path: Path, scenario: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("\n".join(scenario_lines(scenario)) + "\n")
    os.replace(tmp, path)  # a new inode: the library re-reads it at its next call


def calls(log: Path) -> list[tuple[str, int]]:
    """(function, return code) of every call the library logged."""
    if not log.is_file():
        return []
    return [(f, int(c)) for f, c in (x.split() for x in log.read_text().splitlines())]


class FakeMachine:
    """The fake library with one scenario file: in-process through a private pynvml copy,
    in subprocesses through LD_LIBRARY_PATH (env())."""

    def __init__(self, library: Path, folder: Path) -> None:
        self.library = library
        self.scenario_path = folder / "nvml-scenario.txt"
        self.log = folder / "nvml-calls.log"
        self.nvml = load_pynvml(library)

    def write(self, scenario: dict) -> None:
        write_scenario(self.scenario_path, scenario)

    def env(self) -> dict[str, str]:
        return {
            "LD_LIBRARY_PATH": str(self.library.parent),
            SCENARIO_ENV: str(self.scenario_path),
            LOG_ENV: str(self.log),
        }

    def calls(self) -> list[tuple[str, int]]:
        return calls(self.log)


def other_user_process() -> tuple[subprocess.Popen | None, int, str]:
    """(process to end, pid, user name) of a process of another user: as root a `sleep`
    started as `nobody`, else pid 1 when another user owns it; (None, 0, "") otherwise."""
    import pwd

    if os.getuid() == 0:
        user = "nobody"
        try:
            pwd.getpwnam(user)
        except KeyError:
            return None, 0, ""
        proc = subprocess.Popen(["sleep", "600"], user=user)
        return proc, proc.pid, user
    owner = os.stat("/proc/1").st_uid
    if owner != os.getuid():
        return None, 1, pwd.getpwuid(owner).pw_name
    return None, 0, ""
