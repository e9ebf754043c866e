"""Reading a kind's request from JSON: the bounded, checked decoder every ``<Kind>Request.from_json``
uses, whoever sends the document (the sidecar's action options, a saved request).

    >>> read_options({"job": "j1", "pid": 7}, {"job": "str", "pid": "ints"}, "memory")
    {'job': 'j1', 'pid': [7]}

A document is a JSON object of options, each of a kind: ``bool``, ``int``, ``float`` (an integer
is a number too), ``str``, ``ints`` or ``strs`` (a list, or one item standing for a list of one).
``None`` is an option left unset. An unknown key, a value of the wrong type, a string over
:data:`MAX_TEXT` characters (or holding NUL) or a list over :data:`MAX_ITEMS` items is a
:class:`~dynprof.errors.UsageError`; nothing in the document is trusted further than that.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dynprof import errors
from dynprof.arguments import MAX_PID, MAX_SECONDS

MAX_TEXT = 4096
MAX_ITEMS = 1024
KINDS = ("bool", "int", "float", "str", "ints", "strs")
# The options that name the processes a request acts on, as every command that takes them lists
# them: a job, process ids, or every agent of this node.
TARGETS: dict[str, str] = {"job": "str", "pid": "ints", "all": "bool"}


def check_timeout(timeout: float) -> None:
    """A usage error unless ``timeout`` is more than 0 seconds and at most MAX_SECONDS."""
    if not 0 < timeout <= MAX_SECONDS:
        raise errors.UsageError(f"a timeout of {timeout:g} s: more than 0, at most {MAX_SECONDS:g}")


@dataclass(frozen=True)
class TargetedRequest:
    """The processes a request acts on, its first fields: process ids (``pids``), the trainers
    of job ``job`` on this node, or every agent here (``all``). Read from and written to the
    options of :data:`TARGETS` (``pid``, ``job``, ``all``).

    >>> TargetedRequest.targets_of({"pid": [7, 8]})
    {'pids': (7, 8), 'job': None, 'all': False}
    >>> TargetedRequest(job="j1").targets_json()
    {'job': 'j1'}
    """

    pids: tuple[int, ...] = ()
    job: str | None = None
    all: bool = False

    def check_one_target(self, command: str) -> None:
        """A usage error unless exactly one of the targets is given (``command``: the command
        whose help the error points to)."""
        if len([x for x in (self.pids, self.job, self.all) if x]) != 1:
            raise errors.UsageError(
                "give exactly one of --pid, --job or --all", help=f"See `dynprof {command} --help`."
            )

    def check_pids(self, pids: tuple[int, ...] | None = None, what: str = "a process id") -> None:
        """A usage error unless every one of ``pids`` (the targets' unless given) is a process id
        (an integer, 1 to MAX_PID)."""
        given = self.pids if pids is None else pids
        if any(isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= MAX_PID for pid in given):
            raise errors.UsageError(f"{what} is 1-{MAX_PID}")

    def targets_json(self) -> dict[str, Any]:
        """The targets as options of :data:`TARGETS` (those left unset out)."""
        out: dict[str, Any] = {}
        if self.pids:
            out["pid"] = list(self.pids)
        if self.job:
            out["job"] = self.job
        if self.all:
            out["all"] = True
        return out

    @staticmethod
    def targets_of(options: Mapping[str, Any]) -> dict[str, Any]:
        """The targets' fields of the options :func:`read_options` read with :data:`TARGETS`."""
        return {"pids": tuple(options.get("pid", ())), "job": options.get("job"), "all": options.get("all", False)}


def read_options(doc: Any, spec: Mapping[str, str], what: str) -> dict[str, Any]:
    """The options of ``doc`` that ``spec`` (``{name: kind}``) knows, checked; unset ones left out."""
    if not isinstance(doc, dict):
        raise errors.UsageError(f"{what}: the options must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        kind = spec.get(key) if isinstance(key, str) else None
        if kind is None:
            known = ", ".join(sorted(spec))
            raise errors.UsageError(f"{what}: unknown option {str(key)[:80]!r}; known: {known}")
        if value is not None:
            out[key] = _value(what, key, kind, value)
    return out


def _value(what: str, key: str, kind: str, value: Any) -> Any:
    def bad(must: str) -> errors.UsageError:
        return errors.UsageError(f"{what}: option {key!r} must be {must}")

    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad("a finite number")
        return float(value)
    if kind == "str":
        return _text(value, bad)
    if kind in ("ints", "strs"):
        items = value if isinstance(value, list) else [value]
        if not items or len(items) > MAX_ITEMS:
            raise bad(f"a list of 1 to {MAX_ITEMS} items")
        if kind == "ints":
            if any(isinstance(v, bool) or not isinstance(v, int) for v in items):
                raise bad("a list of integers")
            return list(items)
        return [_text(v, lambda _: bad("a list of strings")) for v in items]
    raise bad("of a known kind")  # a table error of the request


def _text(value: Any, bad: Any) -> str:
    if not isinstance(value, str):
        raise bad("a string")
    if len(value) > MAX_TEXT or "\x00" in value:
        raise bad(f"a string of at most {MAX_TEXT} characters, without NUL")
    return value
