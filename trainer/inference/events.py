"""The machine-readable record of a prediction that nnui supervises (`nnui-predict --events
FILE`): the same JSON lines as a training's events.jsonl (docs/contract.md), so the app follows,
stops and shows a prediction with the code it uses for trainings.

FILE lives in the job's own folder of nnui's state directory, never among the predictions
or in nnU-Net's folders. Kinds: `prediction_started`, `topology` (the one worker: this
process, so `nnui stop` can check and signal it), `case_predicted` per written case,
`stop_requested`, `stopped`, `finished`, `failed`. Without a FILE every call is a no-op and
the console output stays what it always was. Writes come from the main thread and the
writer thread, hence the lock; each event is one write() + flush.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from trainer import stop
from trainer.schema.events import Kind, encode_event

log = logging.getLogger("trainer.inference.predict")


class PredictionEvents:
    def __init__(self, path: str | Path | None) -> None:
        self._lock = threading.Lock()
        self._handle = None
        self.stop_recorded = False
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115

    def event(self, kind: str, **fields: Any) -> None:
        if self._handle is None:
            return
        with self._lock:
            self._handle.write(encode_event(kind, **fields))
            self._handle.flush()

    def started(self, num_cases: int, num_skipped: int, device: str, **fields: Any) -> None:
        """`prediction_started`, then the topology: this process is the one worker."""
        host = socket.gethostname()
        self.event(Kind.PREDICTION_STARTED, num_cases=num_cases, num_skipped=num_skipped,
                   device=device, host=host, argv=list(sys.argv), **fields)  # fmt: skip
        rank = {"global_rank": 0, "local_rank": 0, "host": host, "pid": os.getpid(),
                "device": device, "sigusr1_handler": stop.installed()}  # fmt: skip
        self.event(Kind.TOPOLOGY, ranks=[rank])

    def case(self, case_id: str, index: int, num_cases: int, seconds: float, shape: Any) -> None:
        shape_list = [int(s) for s in shape]
        self.event(Kind.CASE_PREDICTED, case=case_id, index=index, num_cases=num_cases,
                   seconds=float(seconds), shape=shape_list)  # fmt: skip

    def should_stop(self, num_done: int) -> bool:
        """Between cases: a SIGUSR1 since the start? Recorded once, when first seen."""
        stop.install()  # re-installed: a library may have replaced the handler meanwhile
        if not stop.requested():
            return False
        if not self.stop_recorded:
            self.stop_recorded = True
            log.info("SIGUSR1: stopping after the current case")
            self.event(Kind.STOP_REQUESTED, num_done=num_done)
        return True

    def failed(self, message: str, traceback_text: str = "") -> None:
        try:
            self.event(Kind.FAILED, message=message, traceback=traceback_text)
        except OSError as error:  # a full disk must not turn the error into a traceback
            log.warning("could not record the failure: %s", error)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
