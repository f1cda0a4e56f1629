"""`python -m trainer ...` (also what `torchrun -m trainer` runs).

Only stdlib imports here: `trainer.run.main` installs the SIGUSR1 handler before torch.
"""

from __future__ import annotations

import sys

from trainer.run import main

if __name__ == "__main__":
    sys.exit(main())
