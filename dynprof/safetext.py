"""Untrusted text made safe to show: one printable line, of bounded length.

Everything a node or an agent says (a frame's function name, a job id, a host name, a command
line, an error message) and everything read from the environment or a file may hold bytes that
are not UTF-8, newlines that would forge whole lines of a verdict, escape sequences that move
a terminal's cursor, and bidirectional overrides that make text read differently from what it
is. This module is the one place that turns such text into what dynprof shows: every face
(the CLI's tables and verdicts, ``dynprof show``, the sidecar's pages and metrics, the watch's
log) calls it. It is part of the floor: it imports nothing of dynprof.

- :func:`valid_text`: bytes, or a str holding undecodable bytes (``os.environ`` gives
  ``'\\udcff'`` for a byte 0xff), as text that every encoder takes: each such byte becomes
  ``\\xff``, stable from one read to the next.
- :func:`one_line`: any value as one printable line: C0 and C1 controls, DEL, bidirectional
  overrides and isolates, line and paragraph separators and every other character that is not
  printable shown as a visible escape (``\\n``, ``\\x1b``, ``\\u202e``), cut at ``limit``
  characters with a visible mark of what was cut.
- :func:`lines`: the same, line by line, for text whose newlines are dynprof's own.
- :func:`shell_word`: text as one word a person can paste into a shell to give it back
  (a job id in ``dynprof ps --job ...``), every character that is not printable escaped.
"""

from __future__ import annotations

MAX_LINE = 2000  # characters of one line, escapes included, before it is cut
CUT = "…"  # ends a line that was cut, followed by how much was cut

# Characters escaped although Python calls them printable: the bidirectional marks, embeddings,
# overrides and isolates (text that reads differently from what it is).
_BIDI = frozenset({0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)})
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def valid_text(value: str | bytes) -> str:
    """``value`` as text every encoder takes: bytes that are not UTF-8 (and the lone surrogates
    through which Python carries them in a str) become ``\\xNN``, any other lone surrogate
    ``\\udNNN``. Text that is valid already comes back unchanged."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    out = []
    for ch in value:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, as surrogateescape carries it
            out.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def _escape(ch: str) -> str:
    short = _SHORT.get(ch)
    if short is not None:
        return short
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte: shown as the byte it was
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _safe(ch: str) -> bool:
    return ch == " " or (ch.isprintable() and ord(ch) not in _BIDI)


def one_line(value: object, limit: int | None = MAX_LINE) -> str:
    """``value`` (``str()`` of it; bytes decoded as UTF-8, what is not UTF-8 escaped) as one
    printable line of at most ``limit`` characters plus the mark of a cut (``…(+N)``, N the
    characters of ``value`` left out); ``limit`` None: no cut."""
    s = valid_text(value) if isinstance(value, bytes) else str(value)
    fast = s.isprintable() and (s.isascii() or not any(ord(ch) in _BIDI for ch in s))
    if fast and (limit is None or len(s) <= limit):
        return s
    out: list[str] = []
    size = 0
    for i, ch in enumerate(s):
        piece = ch if _safe(ch) else _escape(ch)
        if limit is not None and size + len(piece) > limit:
            return "".join(out) + f"{CUT}(+{len(s) - i})"
        out.append(piece)
        size += len(piece)
    return "".join(out)


def lines(text: object, limit: int | None = MAX_LINE) -> str:
    """Like :func:`one_line`, line by line: the newlines of ``text`` kept (they are the
    caller's own), everything else in each line escaped and each line cut at ``limit``."""
    return "\n".join(one_line(line, limit) for line in str(text).split("\n"))


_SHELL_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789@%+=:,./_-")


def shell_word(value: str) -> str:
    """``value`` as one word of a POSIX shell command line that gives ``value`` back when
    pasted: as it is when it needs no quoting, in single quotes when it is printable, else in
    bash's ``$'...'`` with every other character escaped (``\\x1b``, ``\\u202e``). Bytes that
    are not UTF-8 are spelled as :func:`valid_text` spells them (``\\xff``, four characters),
    which is how dynprof records such a job id."""
    value = valid_text(value)
    if value and all(ch in _SHELL_PLAIN for ch in value):
        return value
    if all(_safe(ch) for ch in value):
        return "'" + value.replace("'", "'\\''") + "'"
    out = []
    for ch in value:
        code = ord(ch)
        if ch in "\\'":
            out.append("\\" + ch)
        elif _safe(ch):
            out.append(ch)
        elif code < 0x80:  # $'\xNN' above 0x7f is a raw byte, not the character
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "$'" + "".join(out) + "'"
