"""A plain Python process (no dynprof run) in which the agent's server module cannot be
imported, as when part of dynprof's dependencies is missing from the job's environment: the
bootstrap of `dynprof attach` imports dynprof and starts the agent, but its server thread dies.

Prints ``READY <pid>``, then sleeps in time.sleep (so attach takes the PyGILState path).
"""

from __future__ import annotations

import os
import sys
import time

sys.modules["dynprof.agent._server"] = None  # type: ignore[assignment]  # import fails: ImportError
print(f"READY {os.getpid()}", flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(5)
