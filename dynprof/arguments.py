"""Argument types: every number, pid, port, host and file name a person types, checked.

Every number a person types is checked at the edge: finite, in range, or a usage error (exit 2)
naming the option, before anything is sent to a process. The bounds are documented in
docs/cli.md through the help texts. Used by the CLI and the healthcheck's command line.
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from dynprof.units import ascii_float

MAX_SECONDS = 86_400.0  # one day: no wait, trace or timeout dynprof offers is longer
MAX_TRACE_STEPS = 1_000_000  # well inside the wire's uint32
MAX_STEP_NUMBER = 2**63 - 1  # an optimizer step number (the wire carries uint64)
MAX_PID = 2**22  # Linux's PID_MAX_LIMIT
MAX_HISTORY_EVENTS = 10**9  # CUDA allocator history entries


def _number_text(text: str) -> str:
    shown = text if len(text) <= 40 else text[:37] + "..."
    return ascii(shown)[1:-1]


# What a person types for a whole number: ASCII digits with an optional sign (int() would also
# take "1_000" and other scripts' digits, which no command documents).
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _base10(digits: str, shown: str, what: str) -> int:
    """``digits`` as a base-10 integer (a sign and ASCII digits); where it is not one,
    :class:`argparse.ArgumentTypeError` "``shown`` is not ``what``"."""
    try:
        if not _INTEGER.fullmatch(digits):
            raise ValueError(digits)
        return int(digits, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_number_text(shown)!r} is not {what}") from None


def parse_int(text: str, low: int, high: int, what: str = "an integer") -> int:
    value = _base10(text.strip(), text, what)
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"{value if len(str(value)) <= 40 else _number_text(text)} is out of range ({low}..{high})"
        )
    return value


def parse_float(text: str, low: float, high: float, low_open: bool = True, what: str = "a number") -> float:
    try:
        value = ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not {what}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not a finite number")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        bracket = "(" if low_open else "["
        raise argparse.ArgumentTypeError(f"{value:g} is out of range {bracket}{low:g}, {high:g}]")
    return value


def bounded_int(low: int, high: int) -> Any:
    """An argparse ``type``: a base-10 integer in ``low..high``."""

    def parse(text: str) -> int:
        return parse_int(text, low, high)

    parse.__name__ = "integer"
    return parse


def positive_float(high: float = MAX_SECONDS) -> Any:
    """An argparse ``type``: a finite number in ``(0, high]``."""

    def parse(text: str) -> float:
        return parse_float(text, 0.0, high)

    parse.__name__ = "number"
    return parse


def nonnegative_float(high: float) -> Any:
    """An argparse ``type``: a finite number in ``[0, high]``."""

    def parse(text: str) -> float:
        return parse_float(text, 0.0, high, low_open=False)

    parse.__name__ = "number"
    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a finite positive number of seconds, at most a day."""
    return parse_float(text, 0.0, MAX_SECONDS, what="a number of seconds")


MAX_PATH_BYTES = 4095  # PATH_MAX, less the terminating NUL


def path_arg(text: str) -> str:
    """An argparse ``type``: a file name the system can take (no NUL byte, not empty, not
    longer than PATH_MAX). Whether it exists is for the command to say."""
    if not text:
        raise argparse.ArgumentTypeError("empty file name")
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r}: a file name cannot hold a NUL byte")
    if len(text.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r}: file name longer than {MAX_PATH_BYTES} bytes")
    return text


def host_arg(text: str) -> str:
    """An argparse ``type``: an IP address or a host name (RFC 1123 labels), nothing else."""
    import ipaddress
    import re

    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    labels = text[:-1].split(".") if text.endswith(".") else text.split(".")
    if (
        not text
        or len(text) > 253
        or not all(re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label) for label in labels)
    ):
        raise argparse.ArgumentTypeError(f"{_number_text(text)!r} is not an IP address or a host name")
    return text


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 1..65535."""
    return parse_int(text, 1, 65535, what="a port number")


def parse_pid(text: str) -> int:
    """An argparse ``type``: one process id, a base-10 integer in ``1..MAX_PID``."""
    part = text.strip()
    pid = _base10(part, part, "a pid")
    if not 0 < pid <= MAX_PID:
        raise argparse.ArgumentTypeError(f"{pid if len(part) <= 40 else _number_text(part)} is not a valid pid")
    return pid


parse_pid.__name__ = "pid"


def parse_pids(text: str) -> list[int]:
    pids = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        pids.append(parse_pid(part))
    if not pids:
        raise argparse.ArgumentTypeError("no pid given")
    return pids
