"""CUDA memory-history recording policies: parsing, naming and applying them.

A policy says what PyTorch's caching allocator records for the memory snapshot:

``off``            nothing: a snapshot still has segments and blocks, but no allocation stacks
``N``              the last N allocator events, each with its Python stack (``python:N``)
``all-stacks[:N]`` the same with C++ frames too (``all:N``); much slower to record and to dump
``state``          Python stacks of the blocks alive now, no event history (``state``)
``auto[:B%]``      the default: recording with Python stacks only as much of the time as keeps
                   its estimated step-time cost under B % (0.5 % unless given); see
                   :mod:`dynprof.agent._mem_auto`

The default (:data:`DEFAULT_POLICY`) is chosen from the step-time figures that
``scripts/bench_memory_history.py`` measures; docs/memory.md quotes them.

Nothing here imports torch at module level: the CLI parses policies without it, and the agent
applies them only in a process that has already initialised CUDA.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

from dynprof.units import ascii_float

DEFAULT_MAX_ENTRIES = 100_000
STACKS = ("python", "all")


class PolicyError(ValueError):
    """A history policy that cannot be parsed or is out of range."""


@dataclass(frozen=True)
class HistoryPolicy:
    mode: str  # "off", "all" (event history + live stacks), "state" (live stacks only), "auto"
    stacks: str = "python"  # "python" or "all" (with C++ frames)
    max_entries: int = DEFAULT_MAX_ENTRIES
    budget: float = 0.0  # auto: the step-time fraction recording may cost

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        """The name shown in ``Status.memory_history`` and artifact manifests."""
        if self.mode == "off":
            return "off"
        if self.mode == "window":
            return "window"
        if self.mode == "auto":
            return "auto" if self.budget == DEFAULT_BUDGET else f"auto:{self.budget * 100:g}%"
        if self.mode == "state":
            return "state" if self.stacks == "python" else "state:all"
        return f"{self.stacks}:{self.max_entries}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.describe(),
            "mode": self.mode,
            "stacks": self.stacks,
            "max_entries": self.max_entries,
        }
        if self.mode == "auto":
            d["budget"] = self.budget
        return d


DEFAULT_BUDGET = 0.005
MAX_BUDGET = 0.5
OFF = HistoryPolicy("off")
AUTO = HistoryPolicy("auto", "python", DEFAULT_MAX_ENTRIES, DEFAULT_BUDGET)
DEFAULT_POLICY = AUTO
# What `auto` records while it records: the allocator's events, and the Python stack of each
# allocation (not of each free: half the cost, and the stacks of live blocks are what an OOM
# report needs).
WINDOW_POLICY = HistoryPolicy("window", "python", DEFAULT_MAX_ENTRIES)


def parse_policy(text: str | None, default: HistoryPolicy = DEFAULT_POLICY) -> HistoryPolicy:
    """Parse ``off``, ``auto``, ``auto:B%``, ``N``, ``all-stacks``, ``all-stacks:N``, ``state``
    (and the names :meth:`HistoryPolicy.describe` gives: ``python:N``, ``all:N``). Empty means
    ``default``."""
    if text is None or not text.strip():
        return default
    value = text.strip().lower()
    if value in ("off", "none", "0", "false", "no"):
        return OFF
    if value in ("default", "on"):
        return default
    if value == "auto":
        return AUTO
    if value == "window":  # what auto records in its windows, all the time (for benchmarks)
        return WINDOW_POLICY
    if value.startswith("auto:"):
        return HistoryPolicy("auto", "python", DEFAULT_MAX_ENTRIES, _parse_budget(text.strip()[5:]))
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
        if not re.fullmatch(r"[0-9][0-9_]*", number, re.ASCII):  # int() takes other scripts' digits
            raise ValueError(number)
        entries = int(number.replace("_", ""))
    except ValueError:
        raise PolicyError(f"memory history {text!r} is not off, a number of entries, all-stacks[:N] or state") from None
    if entries <= 0:
        raise PolicyError(f"memory history entries must be positive (got {entries}); use 'off' to disable")
    if entries > 100_000_000:
        raise PolicyError(f"memory history of {entries} entries would take tens of GB of host memory")
    return HistoryPolicy("all", stacks, entries)


def _parse_budget(text: str) -> float:
    raw = text.strip().rstrip("%").strip()
    try:
        percent = ascii_float(raw)
    except ValueError:
        raise PolicyError(f"auto:{text}: the budget is a percentage of step time, e.g. auto:0.5%") from None
    if not 0 < percent <= MAX_BUDGET * 100 or percent != percent:
        raise PolicyError(f"auto:{text}: the budget must be above 0 % and at most {MAX_BUDGET * 100:g} %")
    return percent / 100


def apply(policy: HistoryPolicy, clear: bool = False) -> None:
    """Start (or stop) recording in this process. Only call once CUDA is initialised:
    the allocator's recording functions do not initialise CUDA themselves, but their
    absence of a device context is not something to rely on."""
    import torch

    record = torch.cuda.memory._record_memory_history
    if not policy.enabled or policy.mode == "auto":  # auto's recording is its controller's
        record(enabled=None)
        return
    if policy.mode == "window":
        record(enabled="all", context="alloc", stacks=policy.stacks, max_entries=policy.max_entries)
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
