"""What every nnui subcommand shares: the one-line error, the roots, a y/N question and one
reading of the machine. The exit codes are every command's one table, trainer.schema.exits
(0 ok, 1 refused by a safety check, 2 usage error or unknown job, 3 nothing to do).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from app.services.jobs.identity import watched_roots
from app.services.jobs.known_trees import known_trees
from app.services.jobs.registry import Registry
from app.services.jobs.simulated_load import simulated_gpu_load
from app.services.machine.gpus import GpuMonitor, MachineSnapshot
from trainer.schema.tree import Roots, resolve_roots


def error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def json_rows(rows: Iterable[dict[str, Any]]) -> str:
    """A JSON list, one row a line: json's C encoder (indent= takes the pure-Python one, a
    quarter second over a lab's 500 runs) and still one row per line to read or grep."""
    return "[\n" + ",\n".join(json.dumps(row) for row in rows) + "\n]"


def roots_of(options: argparse.Namespace) -> Roots:
    return resolve_roots(options.raw, options.preprocessed, options.results)


def looked_in(options: argparse.Namespace, jobs: Iterable[Any], state_dir: Path) -> list[Path]:
    """The results trees a command looks in: the default one, those of the jobs, and those
    runs started by hand were seen in (known_trees.py)."""
    return watched_roots(roots_of(options).results, jobs, known_trees(state_dir))


def confirm(question: str) -> bool:
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def machine_snapshot(options: argparse.Namespace) -> MachineSnapshot:
    load = None if options.simulate_gpus is None else lambda: simulated_gpu_load(Registry())
    monitor = GpuMonitor(simulate=options.simulate_gpus, simulated_load=load)
    try:
        return monitor.snapshot()
    finally:
        monitor.close()
