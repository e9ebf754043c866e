"""CUDA memory-history recording policies: parsing, naming and applying them.

A policy says what PyTorch's caching allocator records for the memory snapshot:

``off``            nothing: a snapshot still has segments and blocks, but no allocation stacks
``N``              the last N allocator events, each with its Python stack (``python:N``)
``all-stacks[:N]`` the same with C++ frames too (``all:N``); much slower to record and to dump
``state``          Python stacks of the blocks alive now, no event history (``state``)

The default (:data:`DEFAULT_POLICY`) is chosen from the step-time figures that
``scripts/bench_memory_history.py`` measures; docs/memory.md quotes them.

Nothing here imports torch at module level: the CLI parses policies without it, and the agent
applies them only in a process that has already initialised CUDA.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_ENTRIES = 100_000
STACKS = ("python", "all")


class PolicyError(ValueError):
    """A history policy that cannot be parsed or is out of range."""


@dataclass(frozen=True)
class HistoryPolicy:
    mode: str  # "off", "all" (event history + live stacks) or "state" (live stacks only)
    stacks: str = "python"  # "python" or "all" (with C++ frames)
    max_entries: int = DEFAULT_MAX_ENTRIES

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        """The name shown in ``Status.memory_history`` and artifact manifests."""
        if self.mode == "off":
            return "off"
        if self.mode == "state":
            return "state" if self.stacks == "python" else "state:all"
        return f"{self.stacks}:{self.max_entries}"

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.describe(), "mode": self.mode, "stacks": self.stacks, "max_entries": self.max_entries}


OFF = HistoryPolicy("off")
DEFAULT_POLICY = HistoryPolicy("all", "python", DEFAULT_MAX_ENTRIES)


def parse_policy(text: str | None, default: HistoryPolicy = DEFAULT_POLICY) -> HistoryPolicy:
    """Parse ``off``, ``N``, ``all-stacks``, ``all-stacks:N``, ``state`` (and the names
    :meth:`HistoryPolicy.describe` gives: ``python:N``, ``all:N``). Empty means ``default``."""
    if text is None or not text.strip():
        return default
    value = text.strip().lower()
    if value in ("off", "none", "0", "false", "no"):
        return OFF
    if value in ("default", "on"):
        return default
    if value == "state":
        return HistoryPolicy("state", "python", 0)
    if value in ("state:all", "state-all-stacks"):
        return HistoryPolicy("state", "all", 0)
    stacks = "python"
    number = value
    for prefix, kind in (("all-stacks", "all"), ("all", "all"), ("python", "python")):
        if value == prefix:
            return HistoryPolicy("all", kind, default.max_entries if default.enabled else DEFAULT_MAX_ENTRIES)
        if value.startswith(prefix + ":"):
            stacks, number = kind, value[len(prefix) + 1 :]
            break
    try:
        entries = int(number.replace("_", ""))
    except ValueError:
        raise PolicyError(f"memory history {text!r} is not off, a number of entries, all-stacks[:N] or state") from None
    if entries <= 0:
        raise PolicyError(f"memory history entries must be positive (got {entries}); use 'off' to disable")
    if entries > 100_000_000:
        raise PolicyError(f"memory history of {entries} entries would take tens of GB of host memory")
    return HistoryPolicy("all", stacks, entries)


def apply(policy: HistoryPolicy, clear: bool = False) -> None:
    """Start (or stop) recording in this process. Only call once CUDA is initialised:
    the allocator's recording functions do not initialise CUDA themselves, but their
    absence of a device context is not something to rely on."""
    import torch

    record = torch.cuda.memory._record_memory_history
    if not policy.enabled:
        record(enabled=None)
        return
    kwargs: dict[str, Any] = {
        "enabled": "all" if policy.mode == "all" else "state",
        "context": "all" if policy.mode == "all" else "state",
        "stacks": policy.stacks,
    }
    if policy.mode == "all":
        kwargs["max_entries"] = policy.max_entries
    try:
        params = inspect.signature(record).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    if clear and "clear_history" in params:
        kwargs["clear_history"] = True
    record(**kwargs)
