"""The agent's registration in the job's rendezvous store, on a real one-process gloo group."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from dynprof.agent import _ext_job_store as js
from dynprof.agent._pg_watch import ProcessGroupWatch
from dynprof.agent._server import CommandError
from dynprof.identity import Identity
from dynprof.proto import pb
from tests._ports import free_port


class _Steps:
    def __init__(self) -> None:
        self.listeners: list[Any] = []

    def add_listener(self, fn: Any) -> None:
        self.listeners.append(fn)

    def remove_listener(self, fn: Any) -> None:
        # As the agent's step tracker: by identity (a new bound method is another listener).
        self.listeners = [x for x in self.listeners if x is not fn]


def _agent() -> Any:
    import os

    ident = Identity(host="node-7", rank=0, local_rank=0, world_size=1, job_id="J")
    return types.SimpleNamespace(pid=os.getpid(), identity=ident, steps=_Steps(), handlers={}, exit_callbacks=[])


@pytest.fixture
def process_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_registers_and_reads_back(process_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an agent of rank 0 whose node's sidecar is on port 9999
    monkeypatch.setenv("DYNPROF_SIDECAR", "10.0.0.7:9999")
    reg = js.JobStoreRegistration(_agent())
    # WHEN it notices the process group, and is asked for the job's nodes
    reg.schedule()
    reg.wait(10)
    kind, nodes = reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=3))
    # THEN its registration comes back from the store
    assert kind == "job_nodes" and nodes.world_size == 1
    assert [(r.rank, r.host, r.sidecar) for r in nodes.ranks] == [(0, "node-7", "10.0.0.7:9999")]
    assert nodes.store.startswith("TCPStore 127.0.0.1:")
    # and the same group is registered once only
    reg.schedule()
    reg.wait(10)
    store, _ = js.open_job_store(3)
    assert store.get(js.RANKS_KEY).count(b"\n") == 1
    # garbage written to the key by someone else is skipped
    store.append(js.RANKS_KEY, b"\x00\xff not json\n[]\n")
    assert len(reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=3))[1].ranks) == 1


def test_store_failures_are_structured_errors(process_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = js.JobStoreRegistration(_agent())

    def gone(timeout_s: float) -> Any:
        raise RuntimeError("Connection refused")

    monkeypatch.setattr(js, "open_job_store", gone)
    with pytest.raises(CommandError) as info:
        reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=1))
    assert info.value.code == pb.INTERNAL and "Connection refused" in info.value.message
    assert "--hosts/--hostfile/--slurm" in info.value.help
    with pytest.raises(CommandError) as info:
        reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=1000))
    assert info.value.code == pb.INVALID_ARGUMENT
    # a failed registration is only logged, and tried again on the next occasion
    reg.schedule()
    reg.wait(10)
    assert "Connection refused" in reg.last_error and reg._registered_group is None


def test_without_a_process_group() -> None:
    pytest.importorskip("torch.distributed")
    reg = js.JobStoreRegistration(_agent())
    reg.schedule()  # nothing to do, nothing started
    assert reg._thread is None
    with pytest.raises(CommandError) as info:
        reg.handle_discover(pb.DiscoverNodesRequest())
    assert info.value.code == pb.UNSUPPORTED


def test_the_wrapper_calls_listeners_after_the_jobs_own_call() -> None:
    # GIVEN a module with an init_process_group, wrapped
    calls: list[str] = []

    def init_process_group(backend: str, **kwargs: Any) -> str:
        calls.append(f"init {backend}")
        if kwargs.get("fail"):
            raise ValueError("bad init")
        return "group"

    module = types.SimpleNamespace(init_process_group=init_process_group)
    watch = ProcessGroupWatch()
    watch.listeners.append(lambda: calls.append("listener"))
    watch.listeners.append(lambda: 1 / 0)  # a failing listener never reaches the job
    watch.wrap(module)
    watch.wrap(module)  # idempotent
    # WHEN the job calls it THEN its result is the job's, and listeners run after it
    assert module.init_process_group("gloo") == "group"
    assert calls == ["init gloo", "listener"]
    assert module.init_process_group.__name__ == "init_process_group"
    # an init that fails raises as before, and no listener runs
    with pytest.raises(ValueError, match="bad init"):
        module.init_process_group("gloo", fail=True)
    assert calls == ["init gloo", "listener", "init gloo"]


def test_the_first_step_is_a_one_time_backstop(monkeypatch: pytest.MonkeyPatch) -> None:
    from dynprof.agent import _pg_watch

    watch = ProcessGroupWatch()
    monkeypatch.setattr(watch, "install", lambda: None)
    monkeypatch.setattr(_pg_watch, "WATCH", watch)
    agent = _agent()
    reg = js.JobStoreRegistration(agent)
    seen = threading.Event()
    monkeypatch.setattr(reg, "schedule", seen.set)
    reg.install()
    assert seen.is_set()  # looked at once on install
    seen.clear()
    (listener,) = agent.steps.listeners
    listener(1)
    assert seen.is_set() and agent.steps.listeners == []
    # and the agent's stop forgets it
    assert watch.listeners == [seen.set]
    (stop,) = agent.exit_callbacks
    stop()
    assert watch.listeners == []


def test_a_real_agent_drops_the_backstop_after_one_step() -> None:
    torch = pytest.importorskip("torch")
    import dynprof.agent

    # GIVEN a real agent in this process (no process group here)
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10)
    reg = agent.extensions["dynprof.agent._ext_job_store"]
    assert reg._first_step_listener in agent.steps._listeners
    # WHEN the job steps its optimizer twice
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    # THEN no step listener is left: idle steps cost what they cost before
    assert agent.steps.step >= 2 and agent.steps._listeners == ()
    dynprof.agent.shutdown()
    from dynprof.agent._pg_watch import WATCH

    assert reg.schedule not in WATCH.listeners


def test_an_agent_without_the_command_is_named_as_older(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynprof.agent
    from dynprof import errors
    from dynprof.job import discovery

    # GIVEN an agent of job "old" that does not know discover_nodes (as an older dynprof)
    monkeypatch.setenv("DYNPROF_JOB_ID", "old")
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10)
    agent.handlers.pop("discover_nodes")
    # WHEN the job's nodes are asked for THEN the error says why and what to do
    with pytest.raises(errors.DynprofError) as info:
        discovery.discover_job("old", timeout=30)  # an in-process agent: a bound on a hang only
    assert "older than this one" in info.value.message and "--hostfile" in info.value.help


def test_a_store_that_cannot_append(process_group: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN stores without append (an older torch)
    real_open = js.open_job_store

    class NoAppend:
        def __init__(self, store: Any) -> None:
            self.store = store

        def append(self, key: str, value: bytes) -> None:
            raise NotImplementedError("append")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.store, name)

    monkeypatch.setattr(js, "open_job_store", lambda t: (NoAppend(real_open(t)[0]), "old store"))
    reg = js.JobStoreRegistration(_agent())
    # WHEN the rank registers and the nodes are read back
    reg.schedule()
    reg.wait(10)
    _, nodes = reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=3))
    # THEN its one key per rank is found
    assert [(r.rank, r.host) for r in nodes.ranks] == [(0, "node-7")]


# -- the store is untrusted: anyone who reaches its port can write dynprof/ keys ----------------
def _append_big(store: Any, key: str, size: int) -> None:
    """``size`` bytes appended in pieces (the store's libuv server takes at most 8 MiB a message)."""
    piece = b"x" * (4 << 20)
    while size > 0:
        store.append(key, piece[:size])
        size -= len(piece)


def test_a_huge_ranks_key_is_refused_before_it_is_read(process_group: Any) -> None:
    import tracemalloc

    # GIVEN a ranks key of 40 MB written by someone (over the 32 MiB a job's registrations may take)
    reg = js.JobStoreRegistration(_agent())
    store, _ = js.open_job_store(3)
    _append_big(store, js.RANKS_KEY, 40 << 20)
    # WHEN the job's nodes are asked for
    tracemalloc.start()
    try:
        with pytest.raises(CommandError) as info:
            reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=5))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # THEN a structured error says why, and the key's bytes never came into this process
    assert info.value.code == pb.INTERNAL and "refused unread" in info.value.message
    assert "--hosts/--hostfile/--slurm" in info.value.help
    assert peak < 8 << 20, f"reading the key allocated {peak} bytes"
    # and the store still answers the next reader
    assert store.check([js.RANKS_KEY])


def test_lines_that_protobuf_or_a_terminal_cannot_take_are_skipped(process_group: Any) -> None:
    # GIVEN this rank's registration, and lines with a lone surrogate and a control character
    reg = js.JobStoreRegistration(_agent())
    reg.schedule()
    reg.wait(10)
    store, _ = js.open_job_store(3)
    store.append(js.RANKS_KEY, b'{"rank":0,"host":"\\udc80","sidecar":"\\udc80:1","registered_at":1e10}\n')
    store.append(js.RANKS_KEY, b'{"rank":0,"host":"a\\u0007","sidecar":"b\\u001b:1","registered_at":1e10}\n')
    # WHEN the job's nodes are asked for
    _, nodes = reg.handle_discover(pb.DiscoverNodesRequest(timeout_s=3))
    # THEN the bad lines are skipped, as the docs say, and the real registration comes back
    assert [(r.rank, r.host) for r in nodes.ranks] == [(0, "node-7")]


def test_ranks_past_the_world_size_and_extra_claims_are_dropped() -> None:
    # GIVEN lines for ranks 0-9 of a world of 2, and rank 0 claimed by ten sidecars
    lines = [b'{"rank":%d,"host":"h","sidecar":"s%d:1","registered_at":1}' % (r, r) for r in range(10)]
    lines += [b'{"rank":0,"host":"h","sidecar":"x%d:1","registered_at":2}' % i for i in range(10)]
    # WHEN they are parsed for a world of 2
    regs = js.parse_registrations(b"\n".join(lines), world_size=2)
    # THEN ranks 0 and 1 only, rank 0 with its first four sidecars (its own line first)
    assert [(r.rank, r.sidecar) for r in regs] == [
        (0, "s0:1"),
        (0, "x0:1"),
        (0, "x1:1"),
        (0, "x2:1"),
        (1, "s1:1"),
    ]


def test_a_reply_always_fits_one_frame() -> None:
    from dynprof.proto import MAX_FRAME_BYTES

    # GIVEN 60 000 ranks registered with 512-character fields (about 90 MB of lines)
    field = "h" * 600
    line = '{"rank":%d,"host":"' + field + '","sidecar":"' + field + '","job_id":"' + field + '","registered_at":1}'
    data = "\n".join(line % r for r in range(60_000)).encode()
    # WHEN they are parsed (the key itself is refused over 32 MiB; this bounds the reply)
    regs = js.parse_registrations(data, world_size=60_000)
    reply = pb.Reply(job_nodes=pb.JobNodes(ranks=regs, world_size=60_000, store="s"))
    # THEN the reply fits the protocol's frame, every rank's first sidecar before anything else
    assert len(reply.SerializeToString()) < MAX_FRAME_BYTES
    assert [r.rank for r in regs] == list(range(len(regs)))
