"""The agent's memory extension with PyTorch's CUDA entry points standing in for a GPU:
start-up at CUDA initialisation, OOM capture and its rate limit, commands."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from collectors.memory.policy import parse_policy
from dynprof.agent._ext_memory import MemoryController, MemoryOptions
from dynprof.agent._server import CommandError
from dynprof.identity import Identity
from dynprof.proto import pb
from dynprof.store import ArtifactStore

torch = pytest.importorskip("torch")
MB = 1 << 20


class FakeAgent:
    def __init__(self) -> None:
        import os

        self.pid = os.getpid()
        self.identity = Identity(host="h", rank=0, local_rank=0, world_size=1, job_id="job")
        self.handlers: dict = {}
        self.exit_callbacks: list = []
        self.steps = SimpleNamespace(hook_thread_id=None, step=0)
        self._stopped = False


@pytest.fixture
def cuda(monkeypatch):
    """torch's CUDA memory entry points, recorded instead of run."""
    calls: dict[str, list] = {"observers": [], "history": []}
    snapshot = {
        "segments": [
            {
                "device": 0,
                "address": 0,
                "total_size": 4 * MB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": 0,
                        "size": 4 * MB,
                        "requested_size": 4 * MB,
                        "state": "active_allocated",
                        "frames": [{"filename": "/job/train.py", "line": 7, "name": "forward"}],
                    }
                ],
            }
        ],
        "device_traces": [[]],
    }
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", calls["observers"].append, raising=False)

    def record(enabled="all", context="all", stacks="all", max_entries=0, clear_history=False):
        kw = {
            "enabled": enabled,
            "context": context,
            "stacks": stacks,
            "max_entries": max_entries,
            "clear_history": clear_history,
        }
        calls["history"].append({k: v for k, v in kw.items() if v or k == "enabled"})

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snapshot)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: {})
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda d=None: "summary")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (MB, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake")
    # The allocator's counters, as `auto` reads them: no events unless a test adds some.
    calls["events"] = [0]
    monkeypatch.setattr(
        torch._C,
        "_cuda_memoryStats",
        lambda d: {"allocation": {"all": {"allocated": calls["events"][0], "freed": 0}}},
        raising=False,
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls["queued"] = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn, **kw: calls["queued"].append(fn))
    return calls


_controllers: list[MemoryController] = []


@pytest.fixture(autouse=True)
def _stop_controllers():
    yield
    while _controllers:  # no `auto` thread outlives its test (and its fakes)
        _controllers.pop().at_exit()


def controller(**options) -> MemoryController:
    opts = MemoryOptions(host_fraction=0.0, **options)
    c = MemoryController(FakeAgent(), opts)  # type: ignore[arg-type]
    c.install()
    _controllers.append(c)
    return c


def test_default_policy_starts_the_auto_controller_and_says_why(cuda, monkeypatch):
    # GIVEN the default policy and an allocator making no events
    from dynprof.agent import _mem_auto

    monkeypatch.setattr(_mem_auto, "CHECK_S", 0.02)
    c = controller()

    # WHEN CUDA initialises
    c._on_cuda_init()

    # THEN the auto controller runs, records all the time (nothing to pay for) and says so
    assert c.agent.memory_history_policy == "auto" and c.auto is not None and c.auto.running
    deadline = __import__("time").monotonic() + 5
    while "recording all the time" not in c.agent.memory_history_detail:
        assert __import__("time").monotonic() < deadline, c.agent.memory_history_detail
        __import__("time").sleep(0.01)
    assert cuda["history"][0]["context"] == "alloc"

    # AND an explicit policy from `dynprof memory --history-stop` ends it and turns recording off
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    c.handle_history(pb.MemoryHistoryRequest(enable=False))
    assert c.auto is None and c.agent.memory_history_policy == "off" and cuda["history"][-1]["enabled"] is None


def test_cuda_start_attaches_the_observer_and_applies_the_policy(cuda):
    # GIVEN an agent with a fixed policy (torch.cuda is imported, CUDA not yet initialised)
    c = controller(history=parse_policy("100000"))
    assert c.agent.memory_history_policy == "off"

    # WHEN CUDA initialises (torch runs the queued callback; here we run it as torch would)
    c._on_cuda_init()

    # THEN the OOM observer is attached once and history records python stacks in a bounded ring
    assert cuda["observers"] == [c._on_oom]
    (kw,) = cuda["history"]
    assert kw["enabled"] == "all" and kw["stacks"] == "python" and kw["max_entries"] == 100_000
    assert c.agent.memory_history_policy == "python:100000"
    c._on_cuda_init()
    assert len(cuda["observers"]) == 1


def test_the_callback_is_queued_with_torch_not_run(cuda):
    c = controller()
    assert cuda["queued"] == [c._on_cuda_init] and cuda["observers"] == [] and cuda["history"] == []


def test_policy_off_records_nothing(cuda):
    c = controller(history=parse_policy("off"))
    c._on_cuda_init()
    assert cuda["history"] == [] and c.agent.memory_history_policy == "off"


def test_a_failing_start_up_never_reaches_the_job(cuda, monkeypatch):
    def broken(**kw):
        raise RuntimeError("allocator said no")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", broken)
    c = controller(history=parse_policy("100000"))
    c._on_cuda_init()  # must not raise: torch would fail the job's CUDA initialisation
    assert c.observer_attached


def test_oom_captures_are_rate_limited(cuda, tmp_path, monkeypatch, capsys):
    # GIVEN at most 2 captures per process, one per hour
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path))
    c = controller(oom_interval_s=3600, oom_max=2)
    c._on_cuda_init()

    # WHEN the allocator reports five OOMs in a row
    for _ in range(5):
        c._on_oom(0, 64 * MB, 80 * 2**30, MB)

    # THEN one artifact is written, the others are counted as skipped, and the user is told
    arts = ArtifactStore().list(kind="memory")
    assert len(arts) == 1 and c.oom_captures == 1 and c.oom_skipped == 4
    assert arts[0].manifest["summary"]["trigger"] == "oom"
    assert "dynprof: CUDA out of memory on cuda:0: memory snapshot written to" in capsys.readouterr().err

    # AND once the interval has passed, a second one is allowed, and no more after the cap
    c.last_oom_capture -= 3601
    c._on_oom(0, 64 * MB, 80 * 2**30, MB)
    c.last_oom_capture -= 3601
    c._on_oom(0, 64 * MB, 80 * 2**30, MB)
    assert len(ArtifactStore().list(kind="memory")) == 2 and c.oom_captures == 2


def test_an_oom_capture_that_fails_never_raises_into_the_allocator(cuda, monkeypatch, tmp_path):
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: 1 / 0)
    c = controller()
    c._on_oom(0, MB, 2 * MB, 0)  # would abort the allocation with a C++ exception if it raised
    assert c.oom_captures == 1


def test_snapshot_and_history_commands(cuda, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path))
    c = controller()
    field, reply = c.agent.handlers["memory_snapshot"](pb.MemorySnapshotRequest())
    assert field == "artifact" and reply.status == "complete"
    assert json.loads(reply.summary_json)["top_site"] == "/job/train.py:7 in forward"

    field, ack = c.agent.handlers["memory_history"](pb.MemoryHistoryRequest(enable=True, max_entries=500))
    assert (field, ack.detail) == ("ack", "python:500")
    assert cuda["history"][-1]["max_entries"] == 500 and cuda["history"][-1].get("clear_history") is True
    _, ack = c.agent.handlers["memory_history"](pb.MemoryHistoryRequest(enable=False))
    assert ack.detail == "off" and cuda["history"][-1]["enabled"] is None
    with pytest.raises(CommandError) as err:
        c.agent.handlers["memory_history"](pb.MemoryHistoryRequest(enable=True, stacks="cpp"))
    assert err.value.code == pb.INVALID_ARGUMENT


def test_commands_in_a_process_without_cuda(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    c = controller()
    for name, req in (
        ("memory_snapshot", pb.MemorySnapshotRequest()),
        ("memory_history", pb.MemoryHistoryRequest(enable=True)),
    ):
        with pytest.raises(CommandError) as err:
            c.agent.handlers[name](req)
        assert err.value.code == pb.NO_CUDA and "has not used CUDA" in err.value.message


def test_a_stopped_agent_leaves_cuda_and_ooms_alone(cuda, tmp_path, monkeypatch):
    # GIVEN an agent stopped before the job initialised CUDA (its callback stays queued in torch)
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path))
    c = controller()
    c.at_exit()

    # WHEN torch runs the callback and the allocator reports an OOM
    c._on_cuda_init()
    c._on_oom(0, MB, 2 * MB, 0)

    # THEN nothing is attached, recorded or written
    assert cuda["observers"] == [] and cuda["history"] == []
    assert ArtifactStore().list() == []
