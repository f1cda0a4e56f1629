"""How long torch's idle OpenMP threads spin on CPU before they sleep.

libgomp (torch's OpenMP on Linux) lets a thread that waits, for the next parallel region
or at a barrier, spin 300000 times (~10-20 ms here) before it sleeps. In a CPU training
step that spinning burns a core between parallel regions (autograd, Python and the small
serial ops in between) and whenever the partner thread is descheduled, which on a shared
machine is often: perf put 30 % of a 2d step's CPU in libgomp on the 2-core bench machine.
10000 spins (well under 1 ms) still bridge the short gaps between kernels, so the threads
stay hot within a step and sleep in the long waits: -30..-40 % CPU for the same step,
identical results (bench/history.md, 2026-12-01 22:40).

libgomp reads the setting once, when it is loaded (with torch), so this runs before
`import torch`. Stdlib only. A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = "10000"


def limit_spinning(device_type: str, env: MutableMapping[str, str] = os.environ) -> bool:
    """On CPU, set GOMP_SPINCOUNT unless the user chose a wait policy; True when set."""
    if device_type != "cpu" or "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return False
    env["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
