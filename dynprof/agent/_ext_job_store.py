"""Agent extension: register this rank in the job's own rendezvous store, and read the job's
node list back from it (``discover_nodes``).

Once the job's default process group exists, the agent appends one JSON line to the key
``dynprof/ranks`` of the job's c10d store (the TCPStore every rank already reaches): its rank,
host, pid and its node's sidecar address (``DYNPROF_SIDECAR=HOST:PORT``, else ``<host>:8787``).
A ``dynprof ... --discover`` on any node of the job asks a local agent, which reads that one
key back: every node of the job, in one store round trip.

Noticing the process group costs the training thread nothing measurable:
``init_process_group`` is wrapped when ``torch.distributed`` is imported (``_pg_watch``), and
the wrapper only starts a daemon thread after the job's own call has returned. A process whose group already
existed when the agent started (``dynprof attach``) registers at once; the first step boundary
is a backstop (a job that bound ``init_process_group`` under its own name before the agent
started in it). All store traffic goes
through a separate client connection with its own short timeout (never the job's store object,
whose timeout is the job's), on the registration thread or the agent's server thread; a store
that is gone or slow is logged in the agent's log and nothing else happens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dynprof import _settings
from dynprof.agent import _pg_watch
from dynprof.agent._server import CommandError
from dynprof.proto import pb

if TYPE_CHECKING:
    from dynprof.agent._agent import Agent

log = logging.getLogger("dynprof.agent")

C10D_MODULE = "torch.distributed.distributed_c10d"
KEY_PREFIX = "dynprof"
RANKS_KEY = "ranks"
RANK_KEY_PREFIX = "rank/"  # where a rank registers when its store cannot append
MAX_PER_RANK_LOOKUPS = 65536
SIDECAR_ENV = "DYNPROF_SIDECAR"
DEFAULT_SIDECAR_PORT = 8787
REGISTER_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 3.0
MAX_READ_TIMEOUT_S = 30.0
# The registrations of a job: ~200 bytes a rank. The key is untrusted (the store has no
# authentication): its size is read first, and a larger value is refused unread.
MAX_RANKS_BYTES = 32 * 1024 * 1024
MAX_FIELD_CHARS = 512
MAX_LINE_BYTES = 4096
MAX_CLAIMS_PER_RANK = 4  # distinct sidecars kept for one rank (restarts); the first ones in the key
# What one reply carries at most: well under the protocol's 16 MiB frame.
MAX_REPLY_BYTES = 12 * 1024 * 1024
MAX_JITTER_S = 4.0


class StoreUnavailable(Exception):
    """No process group, or its store cannot be reached from here."""


def sidecar_address(host: str) -> str:
    return _settings.getenv(SIDECAR_ENV) or f"{host}:{DEFAULT_SIDECAR_PORT}"


def open_job_store(timeout_s: float) -> tuple[Any, str]:
    """A store client for the ``dynprof/`` keys of the job's default process group, with its own
    timeout, and a description of it. Raises :class:`StoreUnavailable`."""
    c10d = sys.modules.get(C10D_MODULE)
    if c10d is None:
        raise StoreUnavailable("torch.distributed is not in use in this process")
    if not c10d.is_initialized():
        raise StoreUnavailable("this process has no torch.distributed process group (yet)")
    dist = sys.modules["torch.distributed"]
    store = c10d._get_default_store()
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    if isinstance(base, dist.TCPStore):
        # Our own connection: the job's store object keeps its own (long) timeout, and our
        # requests never queue behind the job's own store calls.
        client = dist.TCPStore(
            base.host, base.port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        return dist.PrefixStore(KEY_PREFIX, client), f"TCPStore {base.host}:{base.port}"
    # FileStore, HashStore: local and non-blocking for the calls made here (no get of a
    # missing key: ``check`` comes first).
    return dist.PrefixStore(KEY_PREFIX, store), type(base).__name__


def registration(agent: Agent) -> dict[str, Any]:
    dist = sys.modules["torch.distributed"]
    ident = agent.identity
    return {
        "rank": dist.get_rank(),
        "local_rank": ident.local_rank if ident.local_rank is not None else -1,
        "world_size": dist.get_world_size(),
        "host": ident.host,
        "sidecar": sidecar_address(ident.host),
        "pid": agent.pid,
        "job_id": ident.job_id or "",
        "registered_at": time.time(),
    }


def _text(value: Any) -> str | None:
    """A field of a registration: text that protobuf can carry (no lone surrogate) and a
    terminal can show (no control character), cut to ``MAX_FIELD_CHARS``."""
    if not isinstance(value, str):
        return None
    text: str = value[:MAX_FIELD_CHARS]
    if not text.isprintable():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return text


def _int(value: Any, low: int = -1, high: int = 1 << 31) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value < high else None


def _lines(data: bytes, max_lines: int) -> Any:
    """The lines of ``data`` one at a time (no list of them all), at most ``max_lines``."""
    start, count = 0, 0
    while start < len(data) and count < max_lines:
        end = data.find(b"\n", start)
        if end < 0:
            end = len(data)
        if end - start <= MAX_LINE_BYTES:
            count += 1
            yield data[start:end]
        start = end + 1


def parse_registrations(data: bytes, world_size: int | None = None) -> list[pb.RankRegistration]:
    """The ``dynprof/ranks`` value: JSON lines, untrusted (anyone who reaches the store can
    write it). Malformed lines, lines over 4 KiB and ranks not below ``world_size`` are
    skipped. A rank keeps up to ``MAX_CLAIMS_PER_RANK`` distinct sidecars, the first ones in
    the key (a line added later cannot push out the rank's own), each with its latest
    registration; the reader (the CLI) decides which it believes. Ordered by rank, and at most
    ``MAX_REPLY_BYTES`` of them: every rank's first sidecar before any second one."""
    high = world_size if world_size is not None and world_size > 0 else 1 << 31
    max_lines = min(1 << 20, max(4096, 4 * min(high, 1 << 20)))
    claims: dict[int, dict[str, pb.RankRegistration]] = {}
    for line in _lines(data, max_lines):
        if not line.startswith(b"{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        rank = _int(entry.get("rank"), 0, high)
        host, sidecar = _text(entry.get("host")), _text(entry.get("sidecar"))
        at = entry.get("registered_at")
        if rank is None or not host or not sidecar or isinstance(at, bool) or not isinstance(at, (int, float)):
            continue
        if not -1e12 < at < 1e12:
            continue
        mine = claims.setdefault(rank, {})
        old = mine.get(sidecar)
        if old is None and len(mine) >= MAX_CLAIMS_PER_RANK:
            continue
        if old is not None and float(at) < old.registered_at:
            continue
        local_rank = _int(entry.get("local_rank"))
        mine[sidecar] = pb.RankRegistration(
            rank=rank,
            local_rank=local_rank if local_rank is not None else -1,
            host=host,
            sidecar=sidecar,
            pid=_int(entry.get("pid"), 0, 1 << 62) or 0,
            job_id=_text(entry.get("job_id")) or "",
            registered_at=float(at),
        )
    out: list[tuple[int, int, pb.RankRegistration]] = []
    for rank, mine in claims.items():
        out.extend((nth, rank, reg) for nth, reg in enumerate(mine.values()))
    out.sort(key=lambda x: (x[0], x[1]))
    kept: list[tuple[int, int, pb.RankRegistration]] = []
    size = 0
    for item in out:
        size += item[2].ByteSize() + 8
        if size > MAX_REPLY_BYTES:
            log.info(
                "the job's store holds more registrations than one reply carries; %d left out", len(out) - len(kept)
            )
            break
        kept.append(item)
    kept.sort(key=lambda x: (x[1], x[0]))
    return [reg for _, _, reg in kept]


class ValueTooLarge(Exception):
    pass


class StoreReader:
    """Reads ``dynprof/`` keys with their size known before their bytes: a value over the
    limit is refused unread, so that whatever someone wrote into the job's store costs the
    training process at most the limit."""

    def check(self, key: str) -> bool:
        raise NotImplementedError

    def get(self, key: str, max_bytes: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _TCPStoreReader(StoreReader):
    """The c10d TCPStore's own wire protocol (TCPStoreBackend.hpp: a query byte, then values
    in native byte order, strings and vectors prefixed by their uint64 length), on a socket of
    our own, with a deadline. VALIDATE, CHECK and GET only."""

    VALIDATE, GET, CHECK = 0, 3, 5
    MAGIC = 0x3C85F7CE
    KEY_PREFIX = "/"  # what TCPStore puts in front of every key

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.deadline = time.monotonic() + timeout
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.sendall(struct.pack("=BI", self.VALIDATE, self.MAGIC))

    def _key(self, key: str) -> bytes:
        raw = f"{self.KEY_PREFIX}{KEY_PREFIX}/{key}".encode()
        return struct.pack("=Q", len(raw)) + raw

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the job's store did not answer in time")
            self.sock.settimeout(left)
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the job's store closed the connection")
            got += k
        return bytes(buf)

    def check(self, key: str) -> bool:
        self.sock.sendall(struct.pack("=BQ", self.CHECK, 1) + self._key(key))
        return self._recv(1) == b"\x00"  # READY

    def get(self, key: str, max_bytes: int) -> bytes:
        self.sock.sendall(struct.pack("=B", self.GET) + self._key(key))
        (size,) = struct.unpack("=Q", self._recv(8))
        if size > max_bytes:
            self._discard(size)
            raise ValueTooLarge(f"the job's dynprof/{key} key holds {size} bytes, over {max_bytes}; refused unread")
        return self._recv(size)

    def _discard(self, size: int) -> None:
        """Read the rest of a refused value into one small buffer, until the deadline, and close:
        the store's server (in rank 0) logs a warning into the job's output when a client leaves
        in the middle of an answer."""
        scratch = memoryview(bytearray(1 << 16))
        try:
            while size > 0:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    break
                self.sock.settimeout(left)
                k = self.sock.recv_into(scratch[: min(size, len(scratch))])
                if not k:
                    break
                size -= k
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _ApiStoreReader(StoreReader):
    """Another store (FileStore, HashStore: local to the node) through its own API."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def check(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def get(self, key: str, max_bytes: int) -> bytes:
        data = bytes(self.store.get(key))
        if len(data) > max_bytes:
            raise ValueTooLarge(f"the job's dynprof/{key} key holds {len(data)} bytes, over {max_bytes}; refused")
        return data


def store_reader(store: Any, timeout: float) -> StoreReader:
    dist = sys.modules["torch.distributed"]
    base = store
    if isinstance(base, dist.PrefixStore):
        base = base.underlying_store
        if isinstance(base, dist.TCPStore):
            return _TCPStoreReader(base.host, base.port, timeout)
    return _ApiStoreReader(store)


class JobStoreRegistration:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._lock = threading.Lock()
        self._registered_group: int | None = None  # id() of the default group registered
        self._thread: threading.Thread | None = None
        self.last_error = ""
        # One bound method, kept: the step tracker removes listeners by identity.
        self._first_step_listener = self._first_step

    # -- noticing the process group ---------------------------------------------------------
    def install(self) -> None:
        _pg_watch.WATCH.install()  # normally done already by the agent's start-up
        _pg_watch.WATCH.listeners.append(self.schedule)
        self.schedule()  # a group created before now (dynprof attach, or a fast job)
        # Backstop for a job that bound init_process_group under its own name before the agent
        # wrapped it: look once more at the first step boundary, then never again.
        self.agent.steps.add_listener(self._first_step_listener)
        self.agent.exit_callbacks.append(self.uninstall)

    def uninstall(self) -> None:
        with contextlib.suppress(ValueError):
            _pg_watch.WATCH.listeners.remove(self.schedule)
        self.agent.steps.remove_listener(self._first_step_listener)

    def _first_step(self, _step: int) -> None:
        self.agent.steps.remove_listener(self._first_step_listener)
        self.schedule()

    def schedule(self) -> None:
        """Register from a daemon thread if the default group is new. Cheap; never raises."""
        try:
            c10d = sys.modules.get(C10D_MODULE)
            if self.agent.pid != os.getpid() or c10d is None or not c10d.is_initialized():
                return
            group = id(c10d._get_default_group())
            with self._lock:
                if group == self._registered_group or (self._thread is not None and self._thread.is_alive()):
                    return
                self._registered_group = group
                self._thread = threading.Thread(target=self._register, name="dynprof-store", daemon=True)
                self._thread.start()
        except Exception:
            log.info("could not schedule the registration in the job's store", exc_info=True)

    def _register(self) -> None:
        try:
            entry = registration(self.agent)
            # Every rank connects to the store's one server at once: spread the connections of a
            # big job over a few seconds (none for a small one).
            time.sleep(random.uniform(0.0, min(MAX_JITTER_S, entry["world_size"] / 2000)))
            store, where = open_job_store(REGISTER_TIMEOUT_S)
            line = (json.dumps(entry, separators=(",", ":")) + "\n").encode()
            try:
                store.append(RANKS_KEY, line)
            except (AttributeError, NotImplementedError, RuntimeError):
                # A torch whose stores cannot append: one key per rank, read one by one.
                store.set(f"{RANK_KEY_PREFIX}{entry['rank']}", line)
            log.info("registered rank %s (sidecar %s) in the job's store (%s)", entry["rank"], entry["sidecar"], where)
            self.last_error = ""
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self._registered_group = None  # try again on the next occasion
            log.info("registration in the job's store failed", exc_info=True)

    def wait(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # -- the command ------------------------------------------------------------------------
    @staticmethod
    def _per_rank_keys(reader: StoreReader, data: bytes, world: int, deadline: float) -> bytes:
        """The registrations of ranks whose store could not append: one key each, looked up for
        the ranks missing from ``data`` (none, normally), until the deadline."""
        seen = {r.rank for r in parse_registrations(data, world)}
        found = bytearray()
        for rank in range(min(world, MAX_PER_RANK_LOOKUPS)):
            if rank in seen:
                continue
            if time.monotonic() > deadline:
                break
            key = f"{RANK_KEY_PREFIX}{rank}"
            if reader.check(key):
                try:
                    found += reader.get(key, MAX_LINE_BYTES) + b"\n"
                except ValueTooLarge:
                    return bytes(found)  # the reader's connection is closed: what was found so far
        return bytes(found)

    def handle_discover(self, msg: Any) -> tuple[str, Any]:
        timeout = msg.timeout_s if msg.timeout_s > 0 else DEFAULT_READ_TIMEOUT_S
        if not timeout <= MAX_READ_TIMEOUT_S:
            raise CommandError(pb.INVALID_ARGUMENT, f"timeout_s must be at most {MAX_READ_TIMEOUT_S:g}")
        # This rank registers now if nothing noticed its group yet. Its line is usually in within
        # milliseconds; a registration stuck on an unreachable store is not waited for long
        # (the read below would fail the same way, and the client's patience is timeout + 3 s).
        self.schedule()
        self.wait(min(1.0, timeout / 4))
        reader: StoreReader | None = None
        try:
            store, where = open_job_store(timeout)
            world = sys.modules["torch.distributed"].get_world_size()
            reader = store_reader(store, timeout)
            data = reader.get(RANKS_KEY, MAX_RANKS_BYTES) if reader.check(RANKS_KEY) else b""
            data += self._per_rank_keys(reader, data, world, time.monotonic() + timeout)
        except StoreUnavailable as exc:
            raise CommandError(
                pb.UNSUPPORTED,
                f"process {self.agent.pid}: {exc}",
                "The job's ranks register in its rendezvous store once torch.distributed.init_process_group "
                "has returned; ask again then, or name the nodes with --hosts/--hostfile/--slurm.",
            ) from None
        except ValueTooLarge as exc:
            raise CommandError(
                pb.INTERNAL,
                str(exc),
                "Someone wrote more into the job's store than its ranks register (the store is not "
                "authenticated); name the nodes with --hosts/--hostfile/--slurm.",
            ) from None
        except Exception as exc:
            raise CommandError(
                pb.INTERNAL,
                f"process {self.agent.pid} could not read the job's store: {type(exc).__name__}: {exc}",
                "The store lives in the job's rank 0 process (MASTER_ADDR:MASTER_PORT); if that process "
                "is gone or stuck, name the nodes with --hosts/--hostfile/--slurm.",
            ) from None
        finally:
            if reader is not None:
                reader.close()
        return "job_nodes", pb.JobNodes(ranks=parse_registrations(data, world), world_size=world, store=where)


def install(agent: Agent) -> JobStoreRegistration:
    reg = JobStoreRegistration(agent)
    reg.install()
    agent.handlers["discover_nodes"] = reg.handle_discover
    return reg
