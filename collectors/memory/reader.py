"""Memory snapshots read back: the untrusted unpickler, with limits.

A snapshot pickle comes from a file or an artifact, so it is untrusted input: only plain data
(dicts, lists, strings, numbers and a few builtin containers) is unpickled, never a class
reference, and the unpickling is bounded in size (:data:`MAX_SNAPSHOT_BYTES`), in memory
(:data:`MEMORY_GROWTH_MIN`) and in what ``bytearray`` may allocate. Every failure is an
:class:`~dynprof.errors.ArtifactError` that says what is wrong with the file.

Nothing here runs in the training process: the agent never loads this module.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collectors.memory import SNAPSHOT_FILE, SUMMARY_FILE
from collectors.memory.summary import summarize_snapshot
from dynprof.errors import ArtifactError
from dynprof.units import parse_size

MAX_SNAPSHOT_BYTES = 4 << 30
"""A snapshot pickle larger than this is refused (``DYNPROF_MAX_SNAPSHOT_BYTES`` overrides)."""
MAX_BYTEARRAY_ARG = 1 << 20


def max_snapshot_bytes() -> int:
    env = os.environ.get("DYNPROF_MAX_SNAPSHOT_BYTES")
    if not env:
        return MAX_SNAPSHOT_BYTES
    return max(1, parse_size(env))


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as a pickle may call it: from bytes already in the file (or a string and
    its encoding, protocols 0-2), never from a size, so a few bytes cannot allocate gigabytes."""
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytearray(args[0])
    if len(args) == 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return bytearray(args[0], args[1])
    if not args:
        return bytearray()
    raise pickle.UnpicklingError("it calls bytearray() with a size, which a memory snapshot never does")


MEMORY_GROWTH_MIN = 96 << 20
MEMORY_GROWTH_PER_BYTE = 24
"""Unpickling may grow the process by at most max(96 MiB, 24 x the pickle's size): a real
snapshot takes about 10x its pickle, while one-byte opcodes that each build an empty dict would
take 70x (a few MiB of them, hundreds of MB)."""
_CHECK_EVERY = 1 << 16


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _counting(op: Any) -> Any:
    def run(self: _SnapshotUnpickler) -> None:
        self._ops += 1
        if not self._ops % _CHECK_EVERY:
            self._check_memory()
        op(self)

    return run


class _WholeReads(io.BytesIO):
    """The pickle's bytes for the pure-Python unpickler: a read that the data cannot fill is
    the end of a cut-short file (EOFError, "truncated"), as the C unpickler says, where the
    pure-Python one would index past the short read (a 1-byte file: IndexError)."""

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if size is not None and size > 0 and len(data) < size:
            raise EOFError("the pickle ends early")
        return data


if TYPE_CHECKING:
    _UnpicklerBase = pickle.Unpickler
else:
    _UnpicklerBase = object


class _SnapshotClasses(_UnpicklerBase):
    """The class rules of both unpicklers below (mixed in before the unpickler they run on)."""

    _ALLOWED = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "bytearray"):
            return _bytearray
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which a memory snapshot never does")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which a memory snapshot never does")


class _SnapshotUnpickler(_SnapshotClasses, pickle._Unpickler):
    """Unpickles plain data only: a snapshot is dicts, lists, strings and numbers. Any other
    class reference is refused, so opening a file does not run code from it.

    The pure-Python unpickler: its memo is a dict, where the C unpickler sizes its memo array
    from the index a PUT names, so a 9-byte pickle could make it allocate gigabytes. Every
    65 536 opcodes it checks that the process has not grown past its budget
    (:data:`MEMORY_GROWTH_MIN`). It is about 6x slower than the C one, which is used instead
    where the process can cap its own address space (:func:`_unpickle`)."""

    dispatch = {code: _counting(op) for code, op in pickle._Unpickler.dispatch.items()}  # type: ignore[attr-defined]

    def __init__(self, file: Any, size: int = 0) -> None:
        super().__init__(file)
        self._ops = 0
        self._start_rss = _resident_bytes()
        self._budget = max(MEMORY_GROWTH_MIN, MEMORY_GROWTH_PER_BYTE * size)

    def _check_memory(self) -> None:
        grown = _resident_bytes() - self._start_rss
        if self._start_rss and grown > self._budget:
            raise pickle.UnpicklingError(
                f"it needs more than {self._budget >> 20} MiB of memory to load, far more than a "
                "snapshot of its size takes"
            )


class _FastSnapshotUnpickler(_SnapshotClasses, pickle.Unpickler):
    """The C unpickler with the same class rules, for a process that can bound its own
    address space while it runs (:func:`_address_space_limit`): its memo can then not
    allocate past the budget either."""


@contextlib.contextmanager
def _address_space_limit(extra: int) -> Iterator[bool]:
    """Cap the address space at its current size + ``extra`` (a failed allocation is then a
    MemoryError, not gigabytes of RSS); yields False where that is not possible or not safe
    (another thread running, no /proc), and the caller must bound memory another way."""
    if threading.active_count() != 1 or threading.current_thread() is not threading.main_thread():
        yield False
        return
    try:
        import resource

        with open("/proc/self/statm", "rb") as fh:
            current = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        old = resource.getrlimit(resource.RLIMIT_AS)
        limit = current + extra
        if old[1] != resource.RLIM_INFINITY and limit > old[1]:
            raise ValueError("hard limit")
        resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    except (OSError, ValueError, IndexError, ImportError):
        yield False
        return
    try:
        yield True
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def _unpickle(data: bytes) -> Any:
    budget = max(MEMORY_GROWTH_MIN, MEMORY_GROWTH_PER_BYTE * len(data))
    with _address_space_limit(budget) as limited:
        if limited:
            try:
                return _FastSnapshotUnpickler(io.BytesIO(data)).load()
            except MemoryError:
                raise pickle.UnpicklingError(
                    f"it needs more than {budget >> 20} MiB of memory to load, far more than a snapshot "
                    "of its size takes"
                ) from None
    return _SnapshotUnpickler(_WholeReads(data), len(data)).load()


def load_snapshot(path: Path | str) -> dict[str, Any]:
    """Read a memory-snapshot pickle, with a precise error for anything that is not one."""
    path = Path(path)
    return parse_snapshot(read_snapshot_file(path), str(path))


def load_artifact_snapshot(artifact: Any) -> dict[str, Any]:
    """The snapshot of a memory artifact: only its own file, never through a link."""
    data = artifact.read_bytes(SNAPSHOT_FILE, max_snapshot_bytes())
    return parse_snapshot(data, str(artifact.file(SNAPSHOT_FILE)))


def read_snapshot_file(path: Path) -> bytes:
    """The bytes of a snapshot pickle at ``path``: a regular file within the size limit."""
    cap = max_snapshot_bytes()
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ArtifactError(f"{path} is not a regular file")
            if st.st_size > cap:
                raise ArtifactError(
                    f"{path} is {st.st_size} bytes, over the {cap}-byte limit: refused",
                    help="Raise DYNPROF_MAX_SNAPSHOT_BYTES if it is a real snapshot.",
                )
            data = fh.read(cap + 1)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ArtifactError(
            f"{path} is a directory without a {SNAPSHOT_FILE}",
            help="Give a memory artifact (see `dynprof ls --kind memory`) or a snapshot pickle.",
        ) from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from None
    if len(data) > cap:
        raise ArtifactError(f"{path} is over the {cap}-byte limit: refused")
    return data


def parse_snapshot(data: bytes, name: str = "snapshot") -> dict[str, Any]:
    help_text = (
        "A snapshot is the pickle that torch.cuda.memory._dump_snapshot() or dynprof writes "
        f"({SNAPSHOT_FILE} in a memory artifact)."
    )
    if not data:
        raise ArtifactError(f"{name} is empty, not a PyTorch memory snapshot", help=help_text)
    if data[:1] != b"\x80":
        raise ArtifactError(f"{name} is not a pickle, so not a PyTorch memory snapshot", help=help_text)
    try:
        obj = _unpickle(data)
    except EOFError:
        raise ArtifactError(
            f"{name} is truncated ({len(data)} bytes): the pickle ends early",
            help="The file was cut short (a full disk, a copy that stopped?); capture again.",
        ) from None
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "truncated" in text or "ran out of input" in text.lower() or "exhausted before" in text:
            raise ArtifactError(
                f"{name} is truncated ({len(data)} bytes): {text}",
                help="The file was cut short (a full disk, a copy that stopped?); capture again.",
            ) from None
        raise ArtifactError(f"{name} is not a PyTorch memory snapshot: {text}", help=help_text) from None
    except RecursionError:
        raise ArtifactError(f"{name} nests too deeply to be a PyTorch memory snapshot", help=help_text) from None
    except MemoryError:
        raise ArtifactError(f"{name}: not enough memory to read it", help=help_text) from None
    except Exception as exc:  # malformed opcodes raise assorted errors
        raise ArtifactError(f"{name} is not a readable pickle: {type(exc).__name__}: {exc}", help=help_text) from None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("segments"), list)
        or not isinstance(obj.get("device_traces"), list)
    ):
        what = type(obj).__name__ + (f" with keys {sorted(map(str, obj))[:6]}" if isinstance(obj, dict) else "")
        raise ArtifactError(
            f"{name} is a pickle of a {what}, not a PyTorch memory snapshot (no 'segments' and 'device_traces')",
            help=help_text,
        )
    return obj


def read_summary(artifact: Any) -> dict[str, Any]:
    """The artifact's summary.json (read with limits), else a summary computed from its snapshot."""
    if artifact.has_file(SUMMARY_FILE):
        data = artifact.read_json(SUMMARY_FILE)
        if not isinstance(data, dict):
            raise ArtifactError(f"{SUMMARY_FILE} of {artifact.path} is not a JSON object")
        return data
    return summarize_snapshot(load_artifact_snapshot(artifact))
