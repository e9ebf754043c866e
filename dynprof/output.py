"""Text for a terminal: escaping what other processes and files say, tables, strict JSON.

Used by every face that prints (the CLI, the healthcheck). Job ids, command lines and
manifests come from other processes and from files: whatever they hold must not move the
cursor, recolour or clear the screen of whoever runs dynprof.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from dynprof import jsontext


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON (RFC 8259) on stdout: NaN and infinities, which some readers
    refuse (``jq``, browsers' JSON.parse), are written as null."""
    print(jsontext.dumps(obj, indent=2, default=str))


# Characters that must not reach a terminal raw: C0/C1 controls (escape sequences, carriage
# returns, backspaces), bidirectional overrides (text that reads differently from what it is)
# and lone surrogates (undecodable bytes, which would also fail to encode).
_BIDI = set(range(0x202A, 0x202F)) | set(range(0x2066, 0x206A)) | {0x200E, 0x200F, 0x061C}


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(text: object) -> str:
    """``text`` safe to show on a terminal: control characters and the like as ``\\xNN`` escapes.

    Job ids, command lines and manifests come from other processes and from files: whatever
    they hold must not move the cursor, recolour or clear the screen of whoever runs dynprof."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        code = ord(ch)
        if ch.isprintable() and code not in _BIDI:
            out.append(ch)
        elif ch == " ":
            out.append(ch)
        else:
            out.append(_escape_char(ch))
    return "".join(out)


def printable_lines(text: str) -> str:
    """Like :func:`printable`, line by line: newlines kept, everything else escaped."""
    return "\n".join(printable(line) for line in text.split("\n"))


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
