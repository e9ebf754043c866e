"""What an action came to (:class:`Outcome`): the answer of a kind's collect, its JSON checked
and bounded, or the error it stopped on, with the lines the CLI would print on stderr."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dynprof import errors, jsontext
from dynprof.result import error_json

MAX_OUTPUT_BYTES = 64 * 1024 * 1024  # an answer's JSON larger than this is refused, not buffered on


@runtime_checkable
class Answer(Protocol):
    """What a kind's collect returns, as an action sends it: its document (``to_json()``, what
    the CLI's ``--json`` prints), its exit code and its stderr lines
    (:class:`dynprof.result.Result` is one; so is a kind's own collected answer)."""

    exit_code: Any
    messages: Any

    def to_json(self) -> dict[str, Any]: ...


@dataclass
class Outcome:
    """What an action came to: the fields of its answer."""

    exit_code: int
    result: Any = None  # what the CLI's --json prints (None: the command gave no answer)
    messages: list[str] = field(default_factory=list)  # its stderr lines, as the CLI prints them
    error: dict[str, Any] | None = None  # the DynprofError it stopped on (type, message, help, exit_code)


def error_lines(exc: errors.DynprofError) -> list[str]:
    """The stderr lines of an error, as the CLI prints them."""
    lines = [f"dynprof: error: {exc.message}"]
    if exc.help:
        lines.append(f"  what to do: {exc.help}")
    return [part for line in lines for part in line.splitlines() if part.strip()]


def failed(exc: errors.DynprofError) -> Outcome:
    """An action that gave no answer of its own (ran past its limit, killed, no such command)."""
    return Outcome(exc.exit_code, None, error_lines(exc), error_json(exc))


def answered_error(exc: errors.DynprofError) -> Outcome:
    """The command stopped on ``exc``: its answer is the CLI's --json error document."""
    doc = error_json(exc)
    return Outcome(exc.exit_code, {"error": doc}, error_lines(exc), doc)


def outcome_of(name: str, result: Any) -> Outcome:
    """The answer of a kind's collect (an :class:`Answer`): its JSON as strict JSON (no NaN, no
    Infinity: every reader takes it), bounded, and its messages as the CLI prints them."""
    if not isinstance(result, Answer):
        return failed(errors.DynprofError(f"internal error: {name} answered a {type(result).__name__}, not an answer"))
    try:
        text = jsontext.dumps(result.to_json(), default=str)
    except (TypeError, ValueError, RecursionError) as exc:
        return failed(errors.DynprofError(f"internal error: the answer of {name} is not JSON: {exc}"))
    if len(text) > MAX_OUTPUT_BYTES:
        return failed(
            errors.DynprofError(
                f"the answer of {name} is over {MAX_OUTPUT_BYTES >> 20} MiB: refused",
                help="Narrow the request (--job, --pid), or run the command on the node itself.",
            )
        )
    code = result.exit_code
    if isinstance(code, bool) or not isinstance(code, int):
        code = 1
    return Outcome(code, json.loads(text), message_lines(result.messages))


def message_lines(messages: Any) -> list[str]:
    lines: list[str] = []
    for message in messages if isinstance(messages, list) else []:
        first, *more = str(message).splitlines() or [""]
        lines.append(f"dynprof: {first}")
        lines.extend(more)  # continuation lines, as the CLI prints them (not prefixed)
    return [line for line in lines if line.strip()]
