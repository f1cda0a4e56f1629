#!/usr/bin/env python3
"""nnui-predict that holds after writing its first case until the file $NNUI_TEST_GATE
exists (tests/app/launch/test_predict_jobs.py): a stop sent meanwhile arrives while a case is being
predicted, whatever the machine's speed. Everything else is the real trainer.predict."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.inference import engine

_real_write = engine.write_prediction
_gate = Path(os.environ["NNUI_TEST_GATE"]) if os.environ.get("NNUI_TEST_GATE") else None
_written: list[str] = []


def _gated_write(*args, **kwargs):
    _real_write(*args, **kwargs)
    _written.append("x")
    while _gate is not None and len(_written) == 1 and not _gate.exists():  # the test opens it
        time.sleep(0.02)


engine.write_prediction = _gated_write

from trainer.inference.predict import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
