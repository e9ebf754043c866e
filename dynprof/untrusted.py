"""Reading untrusted artifact files safely.

Every file in a store is untrusted input: whoever can write to the store (or hands over a
directory to ``dynprof show``) controls its bytes, its names and its links. The readers here
apply the limits that docs/security.md promises:

* a file of an artifact is opened only by a plain name (no ``/``, no ``..``), relative to the
  artifact's directory, with ``O_NOFOLLOW`` (a link is refused, never followed), and only if it
  is a regular file; the artifact directory itself must resolve inside the store;
* small JSON files (manifests, summaries, stack dumps) are read whole only up to a size cap and
  parsed with a nesting-depth cap;
* gzipped traces are decompressed as a stream with a cap on the uncompressed bytes
  (``DYNPROF_MAX_TRACE_BYTES``) and on the compression ratio (``DYNPROF_MAX_GZIP_RATIO``, past
  the first 64 MiB), and parsed one event at a time (:func:`iter_json_document`), so memory
  stays bounded whatever the compression ratio, and a gzip bomb is refused after a fraction of
  a second instead of the time it takes to inflate the whole cap.

Every refusal is an :class:`~dynprof.errors.ArtifactError` with a reason a person can act on.
"""

from __future__ import annotations

import codecs
import itertools
import json
import os
import re
import stat
import zlib
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from dynprof.errors import ArtifactError, DynprofError, MissingFile
from dynprof.units import parse_size

MANIFEST_MAX_BYTES = 1 << 20
"""A manifest larger than this is refused (real ones are a few KiB)."""
JSON_MAX_BYTES = 32 << 20
"""Other JSON files read whole (summaries, stack dumps, analyses)."""
JSON_MAX_VALUES = 1_000_000
"""At most this many JSON values in a file read whole (bounded from the count of ``,``, ``[``
and ``{``): ``[{},{},...]`` costs ~70 bytes of memory per 3 bytes of file."""
TEXT_MAX_BYTES = 64 << 20
"""Text files shown whole (stack.txt, memory_summary.txt)."""
JSON_MAX_DEPTH = 64
"""Nesting depth cap of every JSON document dynprof reads (real ones nest < 12 deep)."""
DEFAULT_MAX_TRACE_BYTES = 2 << 30
"""Uncompressed bytes of one trace read at most (``DYNPROF_MAX_TRACE_BYTES`` overrides)."""
DEFAULT_MAX_GZIP_RATIO = 200
"""Uncompressed bytes per compressed byte read at most (``DYNPROF_MAX_GZIP_RATIO`` overrides):
a torch Chrome trace inflates about 13 times (measured: a CPU trace with stacks); deflate's own
limit, on runs of one byte, is about 1030."""
GZIP_RATIO_FLOOR = 64 << 20
"""The ratio is judged only past this many uncompressed bytes (a small file may inflate much)."""
STREAM_VALUE_MAX_BYTES = 16 << 20
"""One value of a streamed document (one trace event, or one top-level field) at most."""
_CHUNK = 1 << 20
_WS = re.compile(r"[ \t\r\n]*")
# The depth of JSON text, from its bytes: escapes dropped (so no quote is escaped), then every
# byte but quotes and brackets (bytes.translate), then strings (one cut at the end included).
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_QUOTE_OR_BRACKET = bytes(c for c in range(256) if c not in b'"[]{}')
_STRING_LEFT = re.compile(rb'"[^"]*"?')
_DEPTH_STEP = tuple(1 if c in b"[{" else -1 if c in b"]}" else 0 for c in range(256))


def max_trace_bytes() -> int:
    """The cap on a trace's uncompressed size: ``DYNPROF_MAX_TRACE_BYTES`` (bytes, or 4G, 512M...)."""
    env = os.environ.get("DYNPROF_MAX_TRACE_BYTES")
    if not env:
        return DEFAULT_MAX_TRACE_BYTES
    return max(1, parse_size(env))


def max_gzip_ratio() -> int:
    """The cap on a gzip stream's compression ratio: ``DYNPROF_MAX_GZIP_RATIO`` (an integer)."""
    env = os.environ.get("DYNPROF_MAX_GZIP_RATIO", "").strip()
    if not env:
        return DEFAULT_MAX_GZIP_RATIO
    try:
        return max(1, int(env))
    except ValueError:
        raise ArtifactError(
            f"DYNPROF_MAX_GZIP_RATIO={env[:40]!r} is not an integer", help="Write it like 200 (the default)."
        ) from None


# -- names and paths ----------------------------------------------------------------------------
def check_name(name: object) -> str:
    """``name`` if it is a plain file name inside a directory, else :class:`ArtifactError`."""
    try:
        unusable = isinstance(name, str) and len(name.encode("utf-8", "surrogateescape")) > 255
    except UnicodeEncodeError:  # a lone surrogate no file name holds (a manifest's "\ud800")
        unusable = True
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\x00" in name or unusable:
        raise ArtifactError(f"refused file name {str(name)[:80]!r}: not a plain name inside the artifact")
    return name


def is_inside(root: Path | str, path: Path | str) -> bool:
    """Whether ``path``, with every link resolved, is ``root`` itself or lies under it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or real.startswith(real_root.rstrip("/") + "/")


def open_in(directory: Path | str, name: str) -> IO[bytes]:
    """Open ``directory/name`` for reading: a plain name, never through a link, a regular file."""
    check_name(name)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ArtifactError(f"cannot open {directory}: {exc.strerror}") from None
    try:
        # O_NONBLOCK: a FIFO put in place of a file must not block the reader forever.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        raise MissingFile(f"{name}: no such file in {directory}") from None
    except OSError as exc:
        if os.path.islink(os.path.join(directory, name)):
            raise ArtifactError(f"{name} in {directory} is a symbolic link: refused") from None
        raise ArtifactError(f"cannot open {name} in {directory}: {exc.strerror}") from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{name} in {directory} is not a regular file: refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str, cannot_open: str, not_regular: str, error: type[DynprofError]) -> IO[bytes]:
    """Open ``path`` (a file a person named) for reading: a regular file only, and a FIFO put in
    its place never blocks the reader. ``error`` is raised with ``cannot_open`` and the reason
    when it cannot be opened, with ``not_regular`` when it is no regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise error(f"{cannot_open}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory itself
        os.close(fd)
        raise error(not_regular)
    return os.fdopen(fd, "rb")


def stat_in(directory: Path | str, name: str) -> os.stat_result:
    """``fstat`` of an artifact file opened as :func:`open_in` does (so never of a link's target)."""
    with open_in(directory, name) as fh:
        return os.fstat(fh.fileno())


def read_bytes_in(directory: Path | str, name: str, max_bytes: int) -> bytes:
    """The whole file, refused when it is larger than ``max_bytes``."""
    with open_in(directory, name) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            raise ArtifactError(f"{name} in {directory} is {size} bytes, over the {max_bytes}-byte limit: refused")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read it
        raise ArtifactError(f"{name} in {directory} is over the {max_bytes}-byte limit: refused")
    return data


def read_text_in(directory: Path | str, name: str, max_bytes: int = TEXT_MAX_BYTES) -> str:
    return read_bytes_in(directory, name, max_bytes).decode("utf-8", "replace")


# -- JSON with limits ---------------------------------------------------------------------------
def json_depth_exceeds(obj: Any, max_depth: int) -> bool:
    """Whether ``obj`` nests deeper than ``max_depth`` containers (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def text_depth(text: str, start: int = 0, end: int | None = None) -> tuple[int, bool]:
    """How deep the JSON value that starts at ``text[start]`` nests, read from the text itself
    before it is decoded (its strings skipped), at C speed (``bytes.translate``, regular
    expressions; ~200 MB/s): what decoding a deeply nested value costs (lists by the million,
    ~1 MB/s) is known before it is paid.
    Returns (depth, whether the value closes before ``end``); text after it is not counted."""
    if text[start : start + 1] not in ("[", "{"):
        return 0, True
    data = _ESCAPE.sub(b"", text[start:end].encode("utf-8", "surrogatepass"))
    # Two quotes side by side are an empty string, or the end of one string and the start of
    # the next with no bracket between: dropping them leaves the same brackets outside strings
    # (most strings hold no bracket: they all go here, at C speed).
    quoted = data.translate(None, _NOT_QUOTE_OR_BRACKET).replace(b'""', b"")
    brackets = _STRING_LEFT.sub(b"", quoted)
    depths = list(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)))
    try:
        close = depths.index(0)
    except ValueError:
        return max(depths), False
    return max(itertools.islice(depths, close + 1)), True


def value_depth_exceeds(text: str, start: int, max_depth: int, max_chars: int) -> bool:
    """Whether the value at ``text[start]`` nests deeper than ``max_depth``, looked at in spans
    growing fourfold (a row of a few KiB costs a scan of a few KiB, not of the window)."""
    span = 4096
    while True:
        depth, closed = text_depth(text, start, start + span)
        if depth > max_depth:
            return True
        if closed or start + span >= len(text) or span > max_chars:
            return False
        span *= 4


def count_json_values(data: bytes | bytearray | str) -> int:
    """An upper bound on the values that parsing ``data`` makes (every value but the first
    follows a ``,`` or opens a ``[``/``{``), counted without parsing: what decoding will cost
    in objects is known before it is paid (``[{},{},...]`` is ~70 bytes of memory per 3 bytes)."""
    if isinstance(data, str):
        return data.count(",") + data.count("[") + data.count("{")
    return data.count(b",") + data.count(b"[") + data.count(b"{")


def loads_json(
    data: bytes | bytearray | str, what: str, max_depth: int = JSON_MAX_DEPTH, max_values: int | None = None
) -> Any:
    """Parse JSON text with a depth cap (and, given ``max_values``, a cap on the values it holds,
    checked before parsing); any malformed input is an :class:`ArtifactError`."""
    if max_values is not None and count_json_values(data) > max_values:
        raise ArtifactError(f"{what}: holds over {max_values} JSON values: refused")
    try:
        obj = json.loads(data)
    except RecursionError:
        # Deeper than Python's parser follows, so deeper than the cap too: the cap is the limit named.
        raise ArtifactError(f"{what}: JSON nested deeper than {max_depth} levels: refused") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{what}: not valid JSON ({str(exc)[:120]})") from None
    if json_depth_exceeds(obj, max_depth):
        raise ArtifactError(f"{what}: JSON nested deeper than {max_depth} levels: refused")
    return obj


def read_json_in(
    directory: Path | str, name: str, max_bytes: int = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH
) -> Any:
    data = read_bytes_in(directory, name, max_bytes)
    if count_json_values(data) > JSON_MAX_VALUES:
        raise ArtifactError(f"{name} in {directory} holds over {JSON_MAX_VALUES} JSON values: refused")
    return loads_json(data, f"{name} in {directory}", max_depth)


# -- bounded decompression ----------------------------------------------------------------------
def iter_decompressed(
    fh: IO[bytes], max_bytes: int, what: str = "file", max_ratio: int | None = None, gzip_only: bool = False
) -> Generator[bytes, None, None]:
    """The bytes of ``fh``, gunzipped when they are gzip, in chunks; stops with an
    :class:`ArtifactError` as soon as more than ``max_bytes`` come out, or (past
    :data:`GZIP_RATIO_FLOOR`) more than ``max_ratio`` (default :func:`max_gzip_ratio`) times the
    compressed bytes consumed so far: a gzip bomb costs at most one chunk of memory and the time
    to inflate the floor, not the cap."""
    ratio = max_gzip_ratio() if max_ratio is None else max_ratio
    head = fh.read(2)
    total = 0
    if head != b"\x1f\x8b" and gzip_only:
        raise ArtifactError(f"{what} is not a gzip file")
    if head != b"\x1f\x8b":  # plain (uncompressed) JSON
        block = head
        while block:
            total += len(block)
            if total > max_bytes:
                raise ArtifactError(f"{what} is over the {max_bytes}-byte limit: refused")
            yield block
            block = fh.read(_CHUNK)
        return
    pending = head
    read = len(head)
    dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        while True:
            if not pending:
                pending = fh.read(_CHUNK)
                read += len(pending)
                if not pending:
                    if not dec.eof:
                        raise ArtifactError(f"{what} is truncated: the gzip stream ends early")
                    return
            out = dec.decompress(pending, _CHUNK)
            pending = dec.unconsumed_tail
            if out:
                total += len(out)
                if total > max_bytes:
                    raise ArtifactError(
                        f"{what} inflates to more than {max_bytes} bytes: refused "
                        "(raise DYNPROF_MAX_TRACE_BYTES if it is a real trace)"
                    )
                consumed = max(1, read - len(pending))
                if total > GZIP_RATIO_FLOOR and total > ratio * consumed:
                    raise ArtifactError(
                        f"{what} inflates more than {ratio} times its compressed size (a compression "
                        f"ratio of {total // consumed}:1 after {consumed} compressed bytes): refused as a "
                        "gzip bomb (raise DYNPROF_MAX_GZIP_RATIO if it is a real trace)"
                    )
                yield out
            if dec.eof:  # another gzip member may follow
                rest = dec.unused_data + pending
                dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
                pending = rest
                if not rest:
                    more = fh.read(_CHUNK)
                    read += len(more)
                    if not more:
                        return
                    pending = more
    except zlib.error as exc:
        raise ArtifactError(f"{what} is not a readable gzip file: {exc}") from None


class DecompressedReader:
    """A file object whose ``read`` returns the chunks of a gzip stream from
    :func:`iter_decompressed` (its caps and errors included), for readers that pull bytes as
    from ``gzip.GzipFile``."""

    def __init__(self, fh: IO[bytes], max_bytes: int, what: str = "file") -> None:
        self._chunks = iter_decompressed(fh, max_bytes, what, gzip_only=True)

    def read(self, size: int = -1) -> bytes:
        return next(self._chunks, b"")

    def close(self) -> None:
        self._chunks.close()

    def __enter__(self) -> DecompressedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- streaming JSON -----------------------------------------------------------------------------
class _TextStream:
    """UTF-8 text over byte chunks, with a window that drops what was consumed."""

    def __init__(self, chunks: Iterator[bytes], what: str) -> None:
        self.chunks = chunks
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.what = what

    def fill(self, at_least: int = 1) -> bool:
        """Read until ``at_least`` more characters are buffered past :attr:`pos`, or EOF."""
        if self.pos > _CHUNK:
            self.buf = self.buf[self.pos :]
            self.pos = 0
        want = len(self.buf) - self.pos + at_least
        parts = [self.buf]
        have = len(self.buf) - self.pos
        while have < want and not self.eof:
            chunk = next(self.chunks, None)
            if chunk is None:
                self.eof = True
                parts.append(self.decoder.decode(b"", final=True))
                break
            text = self.decoder.decode(chunk)
            parts.append(text)
            have += len(text)
        self.buf = "".join(parts)
        return len(self.buf) > self.pos

    def skip_ws(self) -> str:
        """The next non-space character (not consumed); ``""`` at the end."""
        while True:
            end = _WS.match(self.buf, self.pos)
            self.pos = end.end() if end else self.pos
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill(_CHUNK):
                return ""

    def closes(self, close: str, malformed: str) -> bool:
        """After a value of an array or object: True at its ``close``, False at a comma (either
        consumed); :class:`ArtifactError` ``malformed`` at anything else."""
        sep = self.skip_ws()
        self.pos += 1
        if sep == close:
            return True
        if sep != ",":
            raise ArtifactError(malformed)
        return False

    def expect(self, char: str) -> None:
        if self.skip_ws() != char:
            got = self.buf[self.pos : self.pos + 20] or "the end of the file"
            raise ArtifactError(f"{self.what}: expected {char!r} in the JSON, found {got!r}")
        self.pos += 1

    def value(
        self, decoder: json.JSONDecoder, max_chars: int, check_depth: bool = True, max_depth: int | None = None
    ) -> Any:
        """Decode one JSON value, growing the window until it is complete (at most ``max_chars``);
        with ``max_depth``, the window's text is checked for depth before each decoding try."""
        self.skip_ws()
        while True:
            if max_depth is not None and value_depth_exceeds(self.buf, self.pos, max_depth, max_chars):
                raise ArtifactError(f"{self.what}: JSON nested deeper than {max_depth} levels: refused")
            try:
                obj, end = decoder.raw_decode(self.buf, self.pos)
            except RecursionError:
                limit = JSON_MAX_DEPTH if max_depth is None else max_depth
                raise ArtifactError(f"{self.what}: JSON nested deeper than {limit} levels: refused") from None
            except ValueError:
                end = -1
                obj = None
            # A value that ends exactly at the window's end may be cut (a number), so it counts
            # only when something follows it or the file has ended.
            if end != -1 and (end < len(self.buf) or self.eof):
                if end - self.pos > max_chars:
                    raise ArtifactError(f"{self.what}: one JSON value is over {max_chars} characters: refused")
                if check_depth and max_depth is None and json_depth_exceeds(obj, JSON_MAX_DEPTH):
                    raise ArtifactError(f"{self.what}: JSON nested deeper than {JSON_MAX_DEPTH} levels: refused")
                self.pos = end
                return obj
            if self.eof:
                raise ArtifactError(f"{self.what}: malformed or truncated JSON")
            pending = len(self.buf) - self.pos
            if pending > max_chars:
                raise ArtifactError(f"{self.what}: one JSON value is over {max_chars} characters: refused")
            self.fill(max(pending, _CHUNK))


def iter_json_document(
    chunks: Iterator[bytes],
    stream_keys: Iterable[str],
    what: str,
    max_value_chars: int = STREAM_VALUE_MAX_BYTES,
    max_depth: int | None = None,
) -> Iterator[tuple[str, Any, bool]]:
    """Parse a top-level JSON object piece by piece: yields ``(key, value, False)`` for each
    field, except that the elements of an array under one of ``stream_keys`` come one at a
    time as ``(key, element, True)``. No value larger than ``max_value_chars`` is built, and
    memory holds one value at a time (plus a window of the text). With ``max_depth``, no value
    (a field's, an element's) nesting deeper is decoded: its text is checked first."""
    streamed = set(stream_keys)
    decoder = json.JSONDecoder()
    text = _TextStream(chunks, what)
    text.expect("{")
    if text.skip_ws() == "}":
        text.pos += 1
        return
    while True:
        key = text.value(decoder, 1 << 16)
        if not isinstance(key, str):
            raise ArtifactError(f"{what}: malformed JSON object (a key that is not a string)")
        text.expect(":")
        if key in streamed and text.skip_ws() == "[":
            text.pos += 1
            if text.skip_ws() == "]":
                text.pos += 1
            else:
                malformed = f"{what}: malformed JSON array under {key!r}"
                while True:
                    # Elements are checked for depth only by the parser's own recursion limit:
                    # walking each of millions of events again would double the cost.
                    yield key, text.value(decoder, max_value_chars, check_depth=False, max_depth=max_depth), True
                    if text.closes("]", malformed):
                        break
        else:
            yield key, text.value(decoder, max_value_chars, max_depth=max_depth), False
        if text.closes("}", f"{what}: malformed JSON object"):
            break
    if text.skip_ws() != "":
        raise ArtifactError(f"{what}: unexpected data after the JSON document")
