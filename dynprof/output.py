"""Text for a terminal: escaping what other processes and files say, tables, strict JSON.

Used by every face that prints (the CLI, the healthcheck). Job ids, command lines and
manifests come from other processes and from files: whatever they hold must not move the
cursor, recolour or clear the screen of whoever runs dynprof.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from dynprof import jsontext, safetext


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (RFC 8259) on stdout: NaN and infinities, which some readers
    refuse (``jq``, browsers' JSON.parse), are written as null."""
    print(jsontext.dumps(obj, indent=2, default=str))


def printable(text: object) -> str:
    """``text`` safe to show on a terminal, on one line: control characters, newlines,
    bidirectional overrides and the like as visible escapes (``\\x1b``, ``\\n``, ``\\u202e``),
    cut at :data:`dynprof.safetext.MAX_LINE` characters (:func:`dynprof.safetext.one_line`).

    Job ids, command lines and manifests come from other processes and from files: whatever
    they hold must not move the cursor, recolour or clear the screen of whoever runs dynprof."""
    return safetext.one_line(text)


def printable_lines(text: str) -> str:
    """Like :func:`printable`, line by line: newlines kept, everything else escaped."""
    return safetext.lines(text)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[printable(h) for h in headers]] + [[("" if c is None else printable(c)) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit cannot raise again (the reader of
    a pipe went away: ``dynprof ls | head -1``)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (captured by a test, say)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class Progress:
    """A one-line progress display on stderr (rewritten in place on a terminal)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._last = ""
        self._last_print = 0.0

    def update(self, text: str) -> None:
        if not self.enabled or text == self._last:
            return
        now = time.monotonic()
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif now - self._last_print >= 1.0:
            sys.stderr.write(text + "\n")
            self._last_print = now
        self._last = text

    def done(self) -> None:
        if self.enabled and self.tty and self._last:
            sys.stderr.write("\n")
        self._last = ""
