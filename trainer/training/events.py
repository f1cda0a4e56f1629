"""The structured record of a run (docs/contract.md): events.jsonl and status.json.

Only global rank 0 writes (`enabled=False` elsewhere makes every call a no-op). Each event
is one `write()` of one complete line followed by a flush, so a tailing reader sees whole
lines only; status.json is replaced atomically.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from trainer.schema.atomic import atomic_write_text
from trainer.schema.events import Kind, encode_event
from trainer.schema.status import State, Status
from trainer.schema.tree import EVENTS_FILE, STATUS_FILE

log = logging.getLogger("trainer")


def finite_or_none(value: float | None) -> float | None:
    """NaN (e.g. Dice of a class absent from prediction and target) becomes JSON null."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return float(value)


class RunRecorder:
    def __init__(self, run_dir: Path, enabled: bool, num_epochs: int) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._status = Status(state=State.STARTING, num_epochs=num_epochs)
        self._handle = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Appending keeps the whole history across `--c` restarts.
            self._handle = open(self.run_dir / EVENTS_FILE, "a", encoding="utf-8")  # noqa: SIM115

    def event(self, kind: str, **fields: Any) -> None:
        if self._handle is None:
            return
        self._handle.write(encode_event(kind, **fields))
        self._handle.flush()

    def status(self, state: str | None = None, **changes: Any) -> None:
        if not self.enabled:
            return
        if state is not None:
            self._status.state = state
        for key, value in changes.items():
            setattr(self._status, key, value)
        self._status.updated_at = time.time()
        atomic_write_text(self.run_dir / STATUS_FILE, self._status.to_json())

    def failed(self, message: str, traceback_text: str, epoch: int | None = None) -> None:
        """Record a failure; on a full disk the record itself may fail, which must not turn
        the one-line failure into a traceback (the exit code still tells)."""
        try:
            self.event(Kind.FAILED, message=message, traceback=traceback_text, epoch=epoch)
        except OSError as error:
            log.warning("could not record the failure in %s: %s", EVENTS_FILE, error)
        try:
            self.status(State.FAILED, message=message)
        except OSError as error:
            log.warning("could not record the failure in %s: %s", STATUS_FILE, error)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
