"""The log of job events nnui's supervisors announce — what `nnui watch` prints.

One JSON object per line in `<state dir>/job_events.jsonl`, appended with a single write
(O_APPEND: lines of several supervisors never interleave): `t`, `event` (started after
waiting, restarted, stalled, finished, failed, stopped), `job_id`, `dataset`, `configuration`,
`fold`, `gpus`, `exit_code`, `reason`, `dice`. Writing it never costs a job anything: a
full disk loses the line, not the run. Reading follows the file by byte offset and parses
complete lines only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JOB_EVENTS_FILE = "job_events.jsonl"


def append(state_dir: Path, record: dict[str, Any]) -> None:
    line = (json.dumps({"t": time.time(), **record}, allow_nan=False) + "\n").encode()
    try:
        fd = os.open(state_dir / JOB_EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except (OSError, ValueError) as error:
        log.warning("could not log the job event: %s", error)


class JobLogReader:
    """New records of the job event log since the last poll (from the end, or all)."""

    def __init__(self, state_dir: Path, from_start: bool) -> None:
        self.path = Path(state_dir) / JOB_EVENTS_FILE
        self.offset = 0 if from_start else _size(self.path)
        self.partial = b""

    def poll(self) -> list[dict[str, Any]]:
        size = _size(self.path)
        if size < self.offset:  # replaced or truncated: read it again from the start
            self.offset, self.partial = 0, b""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read(1 << 20)
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # not ours to repair: skip it
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                records.append(record)
        return records


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def describe(record: dict[str, Any]) -> str:
    """One line for people: `12:01:33 finished 1201-120133-f0-abc Dataset004_Demo 3d_fullres
    fold 0 gpus 1 dice 0.8123`."""
    stamp = time.strftime("%H:%M:%S", time.localtime(record.get("t", 0)))
    parts = [stamp, str(record.get("event")), str(record.get("job_id")),
             str(record.get("dataset")), str(record.get("configuration")),
             f"fold {record.get('fold')}"]  # fmt: skip
    if record.get("gpus"):
        parts.append(f"gpus {','.join(record['gpus'])}")
    if record.get("exit_code") not in (None, ""):
        parts.append(f"exit {record['exit_code']}")
    if record.get("dice"):
        parts.append(f"dice {record['dice']}")
    if record.get("reason"):
        parts.append(f"({record['reason']})")
    return " ".join(parts)
