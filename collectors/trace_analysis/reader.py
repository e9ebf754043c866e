"""Reading a Chrome trace (as :mod:`collectors.torch_trace` writes it, gzipped) safely, one
event at a time.

:func:`iter_trace` parses the top-level JSON object incrementally and yields the events of
``traceEvents`` one at a time (stdlib ``json`` scanner over a sliding text buffer), so the
event list is never held. It refuses a file whose decompressed size exceeds ``max_bytes``
(default :data:`DEFAULT_MAX_TRACE_BYTES`, 2 GiB) and a single JSON value larger than
:data:`MAX_VALUE_CHARS` (64 Mi characters), reads a regular file only (never through a link),
and says what is wrong with a file it cannot read as a :class:`TraceError`.
"""

from __future__ import annotations

import codecs
import gzip
import json
import json.scanner
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from dynprof.errors import ArtifactError
from dynprof.untrusted import DecompressedReader, open_in

DEFAULT_MAX_TRACE_BYTES = 2 * 1024**3
MAX_VALUE_CHARS = 64 * 1024**2
_CHUNK = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*(?:,[ \t\n\r]*)?")


class TraceError(Exception):
    """A trace file that cannot be analysed (too large, not JSON, not a Chrome trace)."""


class _Text:
    """A sliding window of decoded text over a (gzipped) byte stream, with a size cap."""

    def __init__(self, fh: IO[bytes], max_bytes: int, name: str) -> None:
        self.fh = fh
        self.max_bytes = max_bytes
        self.name = name
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.total = 0
        self.eof = False

    def more(self, need: int = _CHUNK) -> bool:
        """Append at least ``need`` bytes of input (fewer at the end); False at end of input."""
        if self.eof:
            return False
        if self.pos:
            self.buf = self.buf[self.pos :]
            self.pos = 0
        if len(self.buf) > MAX_VALUE_CHARS:
            raise TraceError(f"{self.name}: a JSON value longer than {MAX_VALUE_CHARS} characters")
        try:
            data = self.fh.read(max(need, _CHUNK))
        except (OSError, EOFError, gzip.BadGzipFile, ArtifactError) as exc:
            raise TraceError(f"{self.name}: cannot read: {exc}") from None
        if not data:
            self.eof = True
            self.buf += self.decoder.decode(b"", final=True)
            return False
        self.total += len(data)
        if self.total > self.max_bytes:
            raise TraceError(
                f"{self.name}: more than {self.max_bytes} bytes once decompressed; refusing to read it "
                "(raise the limit with --max-trace-bytes)"
            )
        try:
            self.buf += self.decoder.decode(data)
        except UnicodeDecodeError as exc:
            raise TraceError(f"{self.name}: not UTF-8 text: {exc}") from None
        return True

    def skip_ws(self) -> str:
        """Skip whitespace; return the next character ('' at end of input)."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def value(self, scan: Callable[[str, int], tuple[Any, int]]) -> Any:
        """Decode one JSON value at the cursor, reading more input until it is complete."""
        while True:
            try:
                obj, end = scan(self.buf, self.pos)
            except (StopIteration, json.JSONDecodeError, ValueError) as exc:
                if self.more(len(self.buf)):
                    continue
                raise TraceError(f"{self.name}: truncated or not valid JSON (at byte {self.total}): {exc}") from None
            except RecursionError:
                raise TraceError(f"{self.name}: JSON nested too deeply") from None
            # A number at the very end of the buffer may continue in the next chunk.
            if end >= len(self.buf) and not self.eof and self.more():
                continue
            self.pos = end
            return obj


def iter_trace(
    path: Path | str, header: dict[str, Any] | None = None, max_bytes: int = DEFAULT_MAX_TRACE_BYTES
) -> Iterator[dict[str, Any]]:
    """Yield the events of a Chrome trace one by one; top-level keys other than
    ``traceEvents`` go into ``header`` (those after the event array only once it is exhausted)."""
    header = {} if header is None else header
    scan = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
    path = Path(path)
    try:
        raw = open_in(path.parent, path.name)  # a regular file, never through a link
    except ArtifactError as exc:
        raise TraceError(str(exc)) from None
    # Gunzipped with the size cap a chunk above ours (ours says it first) and the ratio cap.
    gunzip = DecompressedReader(raw, max_bytes + _CHUNK, str(path)) if path.name.endswith(".gz") else None
    with raw, gunzip or raw as fh:
        text = _Text(fh, max_bytes, str(path))  # type: ignore[arg-type]
        if text.skip_ws() != "{":
            raise TraceError(f"{path}: not a Chrome trace (no JSON object)")
        text.pos += 1
        while True:
            c = text.skip_ws()
            if c == "}":
                return
            if c == ",":
                text.pos += 1
                continue
            if c != '"':
                raise TraceError(f"{path}: not valid JSON (expected a key)")
            key = text.value(scan)
            if text.skip_ws() != ":":
                raise TraceError(f"{path}: not valid JSON (expected ':')")
            text.pos += 1
            if key != "traceEvents":
                text.skip_ws()
                header[key] = text.value(scan)
                continue
            if text.skip_ws() != "[":
                raise TraceError(f"{path}: traceEvents is not a list")
            text.pos += 1
            while True:
                # Fast path: decode events back to back while the buffer holds whole ones.
                buf = text.buf
                pos = _SEP.match(buf, text.pos).end()  # type: ignore[union-attr]
                limit = len(buf)
                try:
                    while True:
                        event, end = scan(buf, pos)
                        pos = _SEP.match(buf, end).end()  # type: ignore[union-attr]
                        if pos >= limit:
                            text.pos = end
                            if isinstance(event, dict):
                                yield event
                            break
                        if isinstance(event, dict):
                            yield event
                except (StopIteration, ValueError):
                    text.pos = pos
                except RecursionError:
                    raise TraceError(f"{path}: JSON nested too deeply") from None
                c = text.skip_ws()
                if c == "]":
                    text.pos += 1
                    break
                if c == ",":
                    text.pos += 1
                    continue
                if c == "":
                    raise TraceError(f"{path}: truncated (traceEvents never ends)")
                event = text.value(scan)
                if isinstance(event, dict):
                    yield event
