"""`--simulate-busy GPU:USER:GIB[:UTIL]`: the simulated machine plays another user's process
on a GPU, for the TUI and every command. The flag is written as the JSON file that
gpus.simulated_busy reads ($NNUI_SIMULATED_BUSY), and that variable is set for this process
and so for the jobs' supervisors it starts (a job waiting `--when-free` sees the same
machine). The file lives in the state dir, named by its content."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from app.services.machine.gpus import GIB, SIMULATED_BUSY_ENV, SIMULATED_MEMORY_BYTES
from trainer.schema.atomic import atomic_write_text

# Above any Linux pid_max (2**22): a simulated process is never mistaken for a real one.
FIRST_FAKE_PID = 9_000_000


def parse_spec(spec: str, num_gpus: int, number: int) -> tuple[int, dict]:
    """(GPU index, entry of the busy file) of one `GPU:USER:GIB[:UTIL]`; ValueError if bad."""
    parts = spec.split(":")
    usage = f"--simulate-busy {spec!r}: give GPU:USER:GIB[:UTIL], e.g. 2:otheruser:30"
    if len(parts) not in (3, 4) or not parts[0].isdigit() or not parts[1]:
        raise ValueError(usage)
    gpu = int(parts[0])
    if gpu >= num_gpus:
        raise ValueError(f"--simulate-busy: GPU {gpu} does not exist on the simulated machine")
    try:
        gib = float(parts[2])
        util = int(parts[3]) if len(parts) == 4 else 90
    except ValueError:
        raise ValueError(usage) from None
    if not 0 < gib <= SIMULATED_MEMORY_BYTES / GIB or not 0 <= util <= 100:
        raise ValueError(f"{usage} (GIB within 0-80, UTIL 0-100)")
    return gpu, {"pid": FIRST_FAKE_PID + number, "user": parts[1], "used_gib": gib, "util": util}


def install(specs: Sequence[str], num_gpus: int, folder: Path) -> str:
    """Write the busy file into `folder` (the state dir) and point $NNUI_SIMULATED_BUSY at
    it; its path."""
    busy: dict[str, list[dict]] = {}
    for number, spec in enumerate(specs):
        gpu, entry = parse_spec(spec, num_gpus, number)
        busy.setdefault(str(gpu), []).append(entry)
    text = json.dumps(busy, sort_keys=True)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"simulated-busy-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    if not path.exists():
        atomic_write_text(path, text)
    os.environ[SIMULATED_BUSY_ENV] = str(path)
    return str(path)
