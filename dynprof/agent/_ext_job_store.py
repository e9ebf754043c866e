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
import sys
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dynprof import _settings
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
# The registrations of a job: ~200 bytes a rank; this bounds what a reader accepts.
MAX_RANKS_BYTES = 64 * 1024 * 1024
MAX_FIELD_CHARS = 512
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
    return value[:MAX_FIELD_CHARS] if isinstance(value, str) else None


def _int(value: Any, low: int = -1, high: int = 1 << 31) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value < high else None


def parse_registrations(data: bytes) -> list[pb.RankRegistration]:
    """The ``dynprof/ranks`` value: JSON lines, untrusted. Malformed lines are skipped; the
    latest registration of each rank wins. Ordered by rank."""
    latest: dict[int, pb.RankRegistration] = {}
    for line in data.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        rank = _int(entry.get("rank"), 0)
        host, sidecar = _text(entry.get("host")), _text(entry.get("sidecar"))
        at = entry.get("registered_at")
        if rank is None or not host or not sidecar or not isinstance(at, (int, float)):
            continue
        local_rank = _int(entry.get("local_rank"))
        reg = pb.RankRegistration(
            rank=rank,
            local_rank=local_rank if local_rank is not None else -1,
            host=host,
            sidecar=sidecar,
            pid=_int(entry.get("pid"), 0, 1 << 62) or 0,
            job_id=_text(entry.get("job_id")) or "",
            registered_at=float(at),
        )
        old = latest.get(rank)
        if old is None or reg.registered_at >= old.registered_at:
            latest[rank] = reg
    return [latest[r] for r in sorted(latest)]


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
        from dynprof.agent._pg_watch import WATCH

        WATCH.install()  # normally done already by the agent's start-up
        WATCH.listeners.append(self.schedule)
        self.schedule()  # a group created before now (dynprof attach, or a fast job)
        # Backstop for a job that bound init_process_group under its own name before the agent
        # wrapped it: look once more at the first step boundary, then never again.
        self.agent.steps.add_listener(self._first_step_listener)
        self.agent.exit_callbacks.append(self.uninstall)

    def uninstall(self) -> None:
        from dynprof.agent._pg_watch import WATCH

        with contextlib.suppress(ValueError):
            WATCH.listeners.remove(self.schedule)
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
    def _per_rank_keys(store: Any, data: bytes, world: int, deadline: float) -> bytes:
        """The registrations of ranks whose store could not append: one key each, looked up for
        the ranks missing from ``data`` (none, normally), until the deadline."""
        seen = {r.rank for r in parse_registrations(data)}
        found = b""
        for rank in range(min(world, MAX_PER_RANK_LOOKUPS)):
            if rank in seen:
                continue
            if time.monotonic() > deadline:
                break
            key = f"{RANK_KEY_PREFIX}{rank}"
            if store.check([key]):
                found += store.get(key)[: MAX_FIELD_CHARS * 8] + b"\n"
        return found

    def handle_discover(self, msg: Any) -> tuple[str, Any]:
        timeout = msg.timeout_s if msg.timeout_s > 0 else DEFAULT_READ_TIMEOUT_S
        if not timeout <= MAX_READ_TIMEOUT_S:
            raise CommandError(pb.INVALID_ARGUMENT, f"timeout_s must be at most {MAX_READ_TIMEOUT_S:g}")
        # This rank registers now if nothing noticed its group yet. Its line is usually in within
        # milliseconds; a registration stuck on an unreachable store is not waited for long
        # (the read below would fail the same way, and the client's patience is timeout + 3 s).
        self.schedule()
        self.wait(min(1.0, timeout / 4))
        try:
            store, where = open_job_store(timeout)
            world = sys.modules["torch.distributed"].get_world_size()
            data = store.get(RANKS_KEY) if store.check([RANKS_KEY]) else b""
            data += self._per_rank_keys(store, data, world, time.monotonic() + timeout)
        except StoreUnavailable as exc:
            raise CommandError(
                pb.UNSUPPORTED,
                f"process {self.agent.pid}: {exc}",
                "The job's ranks register in its rendezvous store once torch.distributed.init_process_group "
                "has returned; ask again then, or name the nodes with --hosts/--hostfile/--slurm.",
            ) from None
        except Exception as exc:
            raise CommandError(
                pb.INTERNAL,
                f"process {self.agent.pid} could not read the job's store: {type(exc).__name__}: {exc}",
                "The store lives in the job's rank 0 process (MASTER_ADDR:MASTER_PORT); if that process "
                "is gone or stuck, name the nodes with --hosts/--hostfile/--slurm.",
            ) from None
        if len(data) > MAX_RANKS_BYTES:
            raise CommandError(pb.INTERNAL, f"the job's dynprof/{RANKS_KEY} key holds {len(data)} bytes; refused")
        return "job_nodes", pb.JobNodes(ranks=parse_registrations(data), world_size=world, store=where)


def install(agent: Agent) -> JobStoreRegistration:
    reg = JobStoreRegistration(agent)
    reg.install()
    agent.handlers["discover_nodes"] = reg.handle_discover
    return reg
