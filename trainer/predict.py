"""`python -m trainer.predict ...`: the command line that prediction jobs start and record.

The app starts a prediction as `python -m trainer.predict` and a queued job runs the argv it
recorded, possibly after an upgrade, so this path keeps working. nnui-predict itself lives in
trainer/inference/predict.py.
"""

from __future__ import annotations

import sys

from trainer.inference.predict import main

if __name__ == "__main__":
    sys.exit(main())
