"""Settings the agent reads from its environment, with in-process overrides.

``dynprof run`` configures the agent through environment variables set at launch. ``dynprof
attach`` cannot change a running process's environment safely (``setenv`` from one thread races
with ``getenv`` in the job's native threads), so it hands the same settings to the agent as
overrides held here, which win over ``os.environ`` and never leak into child processes.
"""

from __future__ import annotations

import os
from collections import ChainMap
from collections.abc import Mapping

_overrides: dict[str, str] = {}


def set_overrides(values: Mapping[str, str]) -> None:
    """Make ``values`` win over the environment for this process's agent."""
    _overrides.update({str(k): str(v) for k, v in values.items()})


def getenv(name: str, default: str | None = None) -> str | None:
    if name in _overrides:
        return _overrides[name]
    return os.environ.get(name, default)


def environ() -> Mapping[str, str]:
    """The environment as the agent sees it: overrides first, then ``os.environ``."""
    if not _overrides:
        return os.environ
    return ChainMap(_overrides, os.environ)  # type: ignore[arg-type]
