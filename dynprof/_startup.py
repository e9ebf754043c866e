"""Process start-up hook: starts the agent when ``DYNPROF`` is set to a true value.

Called from the ``dynprof-agent.pth`` file that the package installs into site-packages, and
from the ``sitecustomize`` that ``dynprof run`` puts on ``PYTHONPATH``. Without the variable,
the .pth line never imports this module, so an idle installation costs one dictionary lookup.
"""

from __future__ import annotations

import os
import sys

_started = False


def enabled() -> bool:
    return os.environ.get("DYNPROF", "").strip().lower() not in ("", "0", "false", "no", "off")


# Helper interpreters that multiprocessing starts for itself: never training processes.
_SERVICES = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "multiprocessing.semaphore_tracker")


def is_multiprocessing_service(argv: list[str] | None = None) -> bool:
    argv = list(getattr(sys, "orig_argv", sys.argv) if argv is None else argv)
    return "-c" in argv and any(service in arg for arg in argv for service in _SERVICES)


def autostart(activation: str) -> None:
    global _started
    if _started or not enabled() or is_multiprocessing_service():
        return
    _started = True
    try:
        from dynprof.agent import start

        start(activation=activation)
    except BaseException as exc:  # never let the agent stop the job from starting
        try:
            sys.stderr.write(f"dynprof: agent not started: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass
