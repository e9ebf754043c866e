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


def autostart(activation: str) -> None:
    global _started
    if _started or not enabled():
        return
    try:
        from dynprof.roles import is_multiprocessing_service

        if is_multiprocessing_service():
            return
        _started = True
        from dynprof.agent import start

        start(activation=activation)
    except BaseException as exc:  # never let the agent stop the job from starting
        try:
            sys.stderr.write(f"dynprof: agent not started: {type(exc).__name__}: {exc}\n")
        except Exception:
            pass
