#!/usr/bin/env python3
"""A stand-in for nnui-predict in the TUI tests: the real stop handler and events writer
(trainer.stop, trainer.inference.events), no model. It reports its start and topology,
then waits for SIGUSR1 and ends `stopped` with exit 0, as the predictor does between cases."""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer import stop

stop.install_at_start()

from trainer.inference.events import PredictionEvents  # noqa: E402 (after the handler)
from trainer.schema.events import Kind  # noqa: E402

parser = argparse.ArgumentParser(allow_abbrev=False)
parser.add_argument("--events", required=True)
parser.add_argument("-num_parts", type=int, default=1)
parser.add_argument("-part_id", type=int, default=0)
parser.add_argument("-device", default="cpu")
args, _ = parser.parse_known_args()
events = PredictionEvents(args.events)
events.started(3, 0, args.device, part_id=args.part_id, num_parts=args.num_parts)
deadline = time.monotonic() + 600  # never outlives a forgotten test by much
while not events.should_stop(0) and time.monotonic() < deadline:
    time.sleep(0.05)
events.event(Kind.STOPPED, reason="SIGUSR1", num_done=0, num_cases=3)
events.close()
