"""The requests of ``dynprof ps``, ``ls`` and ``stop`` on this node: what each is asked, checked
when made, read from JSON without trusting it (:mod:`dynprof.requests`), whoever asks (the CLI's
options, or the sidecar's ``ps``, ``ls`` and ``stop`` actions).

    >>> PsRequest.from_json({"job": "j1"})
    PsRequest(job='j1', timeout=1.0)
    >>> LsRequest.from_json({"kind": "trace", "limit": 5}).to_json()
    {'kind': 'trace', 'limit': 5}

Each command does its own work (dynprof/cli/ps.py, ls.py, stop.py); this module holds only what
it is asked, so the command and the sidecar read one request. A bad one raises
:class:`~dynprof.errors.UsageError` in the words of the command's own parser (``ls: argument
--limit: ...``, ``stop: argument --pid: ...``): the sidecar's action refuses a value exactly as
it did when that parser read it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar

from dynprof import errors
from dynprof.arguments import MAX_PID, parse_int, parse_pid
from dynprof.requests import TARGETS, TargetedRequest, check_timeout, read_options

PS_TIMEOUT_S = 1.0  # seconds to wait for each agent
STOP_TIMEOUT_S = 120.0  # seconds to wait for the artifacts
MAX_LIMIT = 10**9  # `ls --limit`


@dataclass(frozen=True)
class PsRequest:
    """Whose agents: this node's, or job ``job``'s only; each waited for ``timeout`` seconds."""

    job: str | None = None
    timeout: float = PS_TIMEOUT_S

    def __post_init__(self) -> None:
        check_timeout(self.timeout)

    OPTIONS: ClassVar[dict[str, str]] = {"job": "str", "timeout": "float"}

    @classmethod
    def from_json(cls, doc: Any) -> PsRequest:
        """The request of a JSON object of the ``ps`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "ps")
        return cls(job=o.get("job"), timeout=o.get("timeout", PS_TIMEOUT_S))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timeout": self.timeout}
        if self.job is not None:
            out["job"] = self.job
        return out


@dataclass(frozen=True)
class LsRequest:
    """Which artifacts of this node's store: job ``job``'s, of kind ``kind``, the newest
    ``limit`` (0: all); with ``all``, the directories still being written too."""

    job: str | None = None
    kind: str | None = None
    limit: int = 0
    all: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int):
            raise errors.UsageError("ls: argument --limit: an integer", help="See `dynprof ls --help`.")
        if 0 <= self.limit <= MAX_LIMIT:
            return
        why = f"out of range (0..{MAX_LIMIT})"
        if self.limit.bit_length() < 1000:
            try:
                parse_int(str(self.limit), 0, MAX_LIMIT)
            except argparse.ArgumentTypeError as exc:  # the words of the command's own parser
                why = str(exc)
        raise errors.UsageError(f"ls: argument --limit: {why}", help="See `dynprof ls --help`.")

    OPTIONS: ClassVar[dict[str, str]] = {"job": "str", "kind": "str", "limit": "int", "all": "bool"}

    @classmethod
    def from_json(cls, doc: Any) -> LsRequest:
        """The request of a JSON object of the ``ls`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "ls")
        return cls(job=o.get("job"), kind=o.get("kind"), limit=o.get("limit", 0), all=o.get("all", False))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("job", "kind"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.limit:
            out["limit"] = self.limit
        if self.all:
            out["all"] = True
        return out


_STOP_HELP = "See `dynprof stop --help`."


def _refuse_targets(named: list[str]) -> None:
    """A usage error unless exactly one of --pid, --job, --all is named (``named``, in the
    order given), in the words of the command's parser (one group of the three)."""
    if not named:
        raise errors.UsageError("stop: one of the arguments --pid --job --all is required", help=_STOP_HELP)
    if len(named) > 1:
        raise errors.UsageError(f"stop: argument --{named[1]}: not allowed with argument --{named[0]}", help=_STOP_HELP)


@dataclass(frozen=True)
class StopRequest(TargetedRequest):
    """Whose trace ends: exactly one of ``pids``, ``job`` (its trainers on this node) or ``all``
    (every agent here); the artifacts waited for ``timeout`` seconds, or not at all (``no_wait``)."""

    no_wait: bool = False
    timeout: float = STOP_TIMEOUT_S

    def __post_init__(self) -> None:
        # named as the command's parser counts them: a job named "" is named (and selects every
        # agent, as --all does); `all` only when true
        _refuse_targets(
            [name for name, given in (("pid", self.pids), ("job", self.job is not None), ("all", self.all)) if given]
        )
        for pid in self.pids:
            if isinstance(pid, bool) or not isinstance(pid, int):
                raise errors.UsageError("stop: argument --pid: a process id is an integer", help=_STOP_HELP)
            if not 0 < pid <= MAX_PID:
                why = f"a process id is 1-{MAX_PID}"
                if pid.bit_length() < 1000:
                    try:
                        parse_pid(str(pid))
                    except argparse.ArgumentTypeError as exc:  # the words of the command's own parser
                        why = str(exc)
                raise errors.UsageError(f"stop: argument --pid: {why}", help=_STOP_HELP)
        check_timeout(self.timeout)

    OPTIONS: ClassVar[dict[str, str]] = {
        **TARGETS,
        "no_wait": "bool",
        "timeout": "float",
    }

    @classmethod
    def from_json(cls, doc: Any) -> StopRequest:
        """The request of a JSON object of the ``stop`` action's options (:meth:`to_json`)."""
        o = read_options(doc, cls.OPTIONS, "stop")
        # in the document's order, as the command's parser reads its arguments
        _refuse_targets([key for key in o if key in ("pid", "job") or (key == "all" and o[key])])
        return cls(
            **cls.targets_of(o),
            no_wait=o.get("no_wait", False),
            timeout=o.get("timeout", STOP_TIMEOUT_S),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"timeout": self.timeout}
        if self.pids:
            out["pid"] = list(self.pids)
        if self.job is not None:
            out["job"] = self.job
        if self.all:
            out["all"] = True
        if self.no_wait:
            out["no_wait"] = True
        return out
