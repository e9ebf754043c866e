"""collectors.memory.capture: what runs in the training process (the snapshot written as an
artifact, the failing thread's stack, who holds the memory).

torch's CUDA functions stand in for a GPU (monkeypatched); the attribution's walk runs on CPU
tensors, whose storages stand in for device ones where a test says so.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
from typing import Any

import pytest
import torch

from collectors.memory import MEMORY_SUMMARY_FILE, SNAPSHOT_FILE, STACK_FILE, SUMMARY_FILE, capture
from collectors.memory.capture import job_attribution, thread_stack
from dynprof.store import ArtifactStore

MB = 1 << 20
GB = 1 << 30
USER = {"filename": "/home/u/train.py", "line": 40, "name": "step"}


def snapshot(oom_device: int | None = 0) -> dict:
    base = 0x7F0000000000
    traces: list[list[dict]] = [[], []]
    if oom_device is not None:
        traces[oom_device] = [
            {"action": "alloc", "addr": base, "size": 4 * MB, "frames": [USER], "time_us": 1},
            {"action": "oom", "size": 64 * MB, "device_free": MB, "frames": [USER], "time_us": 2},
        ]
    return {
        "segments": [
            {
                "device": 0,
                "address": base,
                "total_size": 8 * MB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": base,
                        "size": 4 * MB,
                        "requested_size": 4 * MB,
                        "state": "active_allocated",
                        "frames": [USER],
                    },
                    {"address": base + 4 * MB, "size": 4 * MB, "state": "inactive", "frames": []},
                ],
            }
        ],
        "device_traces": traces,
    }


class FakeCuda:
    """What capture asks torch.cuda, answered from here; ``broken`` names the calls that raise."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, snap: dict, broken: tuple[str, ...] = ()) -> None:
        self.snap = snap
        self.asked: list[tuple[str, int]] = []

        def answer(name: str, value: Any) -> Any:
            def call(index: Any = None, *args: Any, **kwargs: Any) -> Any:
                self.asked.append((name, index))
                if name in broken:
                    raise RuntimeError(f"{name} is broken")
                return value(index) if callable(value) else value

            return call

        class Props:
            total_memory = 80 * GB

        monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: self.snap)
        monkeypatch.setattr(
            torch.cuda,
            "memory_stats",
            answer(
                "memory_stats",
                {"allocated_bytes.all.current": 4 * MB, "reserved_bytes.all.peak": 9 * MB, "num_ooms": None},
            ),
        )
        monkeypatch.setattr(torch.cuda, "memory_summary", answer("memory_summary", lambda i: f"summary of {i}"))
        monkeypatch.setattr(torch.cuda, "mem_get_info", answer("mem_get_info", (5 * MB, 80 * GB)))
        monkeypatch.setattr(torch.cuda, "get_device_name", answer("get_device_name", "Fake GPU"))
        monkeypatch.setattr(torch.cuda, "get_device_properties", answer("get_device_properties", Props()))


def _summary(art: Any) -> dict:
    return json.loads(art.file(SUMMARY_FILE).read_text())


# -- the stack ---------------------------------------------------------------------------------------
def test_the_stack_is_the_caller_s_innermost_last_with_its_thread():
    text = thread_stack()
    head, *frames = text.splitlines()
    me = threading.current_thread()
    assert head == f'Thread {threading.get_ident()} "{me.name}" (most recent call last):'
    assert "test_the_stack_is_the_caller_s_innermost_last_with_its_thread" in frames[-2]
    assert "collectors/memory/capture.py" not in text  # its own frame is not in the stack


def test_the_stack_of_another_frame_names_the_thread_it_is_given():
    def inner() -> Any:
        return sys._getframe()

    text = thread_stack(inner(), ident=42, name=None, limit=1)
    head, *rest = text.splitlines()
    assert head == 'Thread 42 "?" (most recent call last):'
    assert "in inner" in rest[0] and len(rest) == 2  # limit: the one innermost frame


# -- who holds the memory ------------------------------------------------------------------------------
def test_a_storage_key_is_for_device_tensors_only():
    assert capture._storage_key(torch.zeros(4)) is None
    assert capture._storage_key(object()) is None

    class Broken:
        is_cuda = True

        def untyped_storage(self) -> Any:
            raise RuntimeError("freed")

    assert capture._storage_key(Broken()) is None

    class Device:
        is_cuda = True

        class device:  # torch's attribute
            index = None

        def untyped_storage(self) -> Any:
            class S:
                def data_ptr(self) -> int:
                    return 4096

                def nbytes(self) -> int:
                    return 512

            return S()

    assert capture._storage_key(Device()) == (0, 4096, 512)


@pytest.fixture
def cpu_as_device(monkeypatch):
    """CPU storages counted as device 0's, so the walk's arithmetic can be checked without a GPU."""

    def key(t: Any) -> tuple[int, int, int] | None:
        if not isinstance(t, torch.Tensor):
            return None
        st = t.untyped_storage()
        return (0, int(st.data_ptr()), int(st.nbytes()))

    monkeypatch.setattr(capture, "_storage_key", key)


def _optimizer_with_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 4)  # weight 128 B, bias 16 B
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_parameters_gradients_and_state_are_counted_once_each(cpu_as_device):
    _model, opt = _optimizer_with_state()
    out = job_attribution(None, [opt, opt])  # the same optimizer twice: nothing counted twice
    assert out["optimizers"] == 2
    assert out["parameters_bytes"] == 128 + 16
    assert out["gradients_bytes"] == 128 + 16
    # Adam: exp_avg and exp_avg_sq per parameter (its step counter is a CPU scalar tensor, 4 bytes each)
    assert out["optimizer_state_bytes"] == 2 * (128 + 16) + 2 * 4
    assert out["frame_tensors"] == [] and out["frame_tensors_bytes"] == 0
    assert out["complete"] and "error" not in out
    assert out["tensors_looked_at"] > 0 and out["took_s"] >= 0


def test_the_failing_frames_tensors_are_named_ranked_and_not_counted_twice(cpu_as_device):
    model, opt = _optimizer_with_state()

    def failing_frame() -> Any:
        acts = [torch.zeros(256), torch.zeros(256), "not a tensor"]  # 2 KiB as a list
        table = {"a": torch.zeros(2, 3, 4, 5, 6, 7, 8, 9, 10, dtype=torch.float16)}
        weight = model.weight  # already counted as a parameter
        view = acts[0][:10]  # a view of a storage already counted
        held = torch.zeros(1024, dtype=torch.int8)
        assert weight is not None and view is not None and held is not None and table
        return sys._getframe()

    frame = failing_frame()
    out = job_attribution(frame, [opt])
    names = [(t["name"], t["bytes"], t["tensors"]) for t in out["frame_tensors"]]
    big = 2 * 3 * 4 * 5 * 6 * 7 * 8 * 9 * 10 * 2
    assert names == [
        ("table (dict of tensors)", big, 1),
        ("acts (list of tensors)", 2048, 2),
        ("held", 1024, 1),
    ]
    assert out["frame_tensors_bytes"] == big + 2048 + 1024
    first = out["frame_tensors"][0]
    assert first["shape"] == [2, 3, 4, 5, 6, 7, 8, 9] and first["dtype"] == "float16"
    assert first["frame"].startswith("failing_frame (") and __file__ in first["frame"]


def test_the_callers_are_walked_and_only_the_ten_largest_frame_tensors_kept(cpu_as_device):
    def caller() -> Any:
        outer = torch.zeros(10_000)  # noqa: F841 - a local of the caller
        return callee()

    def callee() -> Any:
        t1, t2, t3, t4 = torch.zeros(1), torch.zeros(2), torch.zeros(3), torch.zeros(4)
        t5, t6, t7, t8 = torch.zeros(5), torch.zeros(6), torch.zeros(7), torch.zeros(8)
        t9, t10, t11, t12 = torch.zeros(9), torch.zeros(10), torch.zeros(11), torch.zeros(12)
        assert all(t is not None for t in (t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12))
        return sys._getframe()

    out = job_attribution(caller(), [])
    assert [t["name"] for t in out["frame_tensors"]] == [
        "outer",
        "t12",
        "t11",
        "t10",
        "t9",
        "t8",
        "t7",
        "t6",
        "t5",
        "t4",
    ]
    assert out["frame_tensors"][0]["frame"].startswith("caller (")
    # the total is of every tensor found, not only of the ten named
    assert out["frame_tensors_bytes"] == 40_000 + sum(range(1, 13)) * 4
    assert out["parameters_bytes"] == 0 and out["optimizers"] == 0


def test_the_walk_is_bounded_in_frames_and_in_a_container_s_items(cpu_as_device, monkeypatch):
    monkeypatch.setattr(capture, "MAX_FRAMES", 2)
    monkeypatch.setattr(capture, "MAX_CONTAINER", 5)

    def outer() -> Any:
        far = torch.zeros(100)  # noqa: F841 - three frames up: not looked at
        return middle()

    def middle() -> Any:
        return inner()

    def inner() -> Any:
        many = [torch.zeros(1) for _ in range(50)]
        return sys._getframe(), many

    frame, _keep = outer()
    out = job_attribution(frame, [])
    assert [(t["name"], t["tensors"]) for t in out["frame_tensors"]] == [("many (list of tensors)", 5)]


def test_the_walk_stops_at_its_tensor_bound_and_says_it_is_incomplete(cpu_as_device, monkeypatch):
    monkeypatch.setattr(capture, "MAX_TENSORS", 3)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(10)]
    out = job_attribution(sys._getframe(), [torch.optim.SGD(params, lr=0.1)])
    assert not out["complete"] and out["tensors_looked_at"] == 4
    assert out["parameters_bytes"] == 4 * 4


def test_odd_optimizers_are_walked_past():
    class Odd:
        param_groups = ["not a dict", {"no params": 1}, {"params": ["not a tensor", torch.zeros(1)]}]
        state = {"x": "not a dict", "y": {"v": 3}}

    out = job_attribution(None, [Odd(), object()])
    assert out["complete"] and out["parameters_bytes"] == 0 and out["tensors_looked_at"] == 1


def test_a_failure_in_the_walk_is_reported_never_raised():
    class NotAFrame:
        f_code = None  # what the walk reads first: an AttributeError on co_name

    out = job_attribution(NotAFrame(), [])
    assert out["complete"] is False
    assert out["error"].startswith("AttributeError: ") and len(out["error"]) <= 200
    assert "took_s" in out and "tensors_looked_at" in out


# moved whole from test_collectors_memory_advice.py
def test_attribution_counts_parameters_gradients_state_and_frame_tensors_once():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        # CPU tensors are never counted (they hold no device memory): the walk still runs
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        big = torch.zeros(8)  # noqa: F841 - a local the walk must look at
        out = job_attribution(__import__("sys")._getframe(), [opt])
        assert out["parameters_bytes"] == 0 and out["frame_tensors_bytes"] == 0 and out["complete"]
        assert out["tensors_looked_at"] >= 2 + 2 + 4  # params, grads, Adam's exp_avg/exp_avg_sq
        return
    pytest.skip("the CUDA case runs in tests/gpu/test_memory_auto_gpu.py")


def test_attribution_is_bounded(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(capture, "MAX_TENSORS", 3)
    import torch

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(10)]
    opt = torch.optim.SGD(params, lr=0.1)
    out = job_attribution(None, [opt])
    assert not out["complete"] and out["tensors_looked_at"] <= 10


# -- the artifact -------------------------------------------------------------------------------------
def test_a_requested_snapshot_writes_every_file_and_the_manifest_s_summary(monkeypatch, tmp_path):
    cuda = FakeCuda(monkeypatch, snapshot(oom_device=None))
    attribution = {"parameters_bytes": 1}
    plan = {"schema": 2}
    art = capture.capture(
        ArtifactStore(tmp_path),
        trigger="request",
        job="j",
        host="h",
        rank=None,
        history_policy="off",
        options={"extra": 1},
        attribution=attribution,
        plan_measurement=plan,
    )
    assert art.status == "complete" and not art.verify()
    assert {f["name"] for f in art.manifest["files"]} == {SNAPSHOT_FILE, SUMMARY_FILE, MEMORY_SUMMARY_FILE, STACK_FILE}
    assert art.manifest["options"] == {"trigger": "request", "memory_history": "off", "extra": 1}
    # the pickle is the snapshot, at the protocol torch's viewer reads
    raw = art.file(SNAPSHOT_FILE).read_bytes()
    assert raw[:2] == b"\x80\x04" and pickle.loads(raw) == cuda.snap
    s = _summary(art)
    assert s["trigger"] == "request" and s["memory_history"] == "off" and s["torch_version"] == torch.__version__
    assert s["failing_allocation"] is None
    assert s["attribution"] == attribution and s["memory_plan_measurement"] == plan
    assert isinstance(s["advice"], list) and isinstance(s["size_classes"], list)
    # only devices with segments are asked, and asked nothing that allocates
    assert s["device_memory"] == {
        "0": {
            "allocated_bytes": 4 * MB,
            "reserved_bytes": 0,
            "active_bytes": 0,
            "inactive_split_bytes": 0,
            "peak_allocated_bytes": 0,
            "peak_reserved_bytes": 9 * MB,
            "num_ooms": 0,
            "num_alloc_retries": 0,
            "num_device_alloc": 0,
            "free_bytes": 5 * MB,
            "total_bytes": 80 * GB,
            "name": "Fake GPU",
        }
    }
    assert {index for _name, index in cuda.asked} == {0}
    assert art.file(MEMORY_SUMMARY_FILE).read_text() == "==== cuda:0 ====\nsummary of 0"
    assert art.file(STACK_FILE).read_text() == "(no stack)\n"
    cap = s["capture"]
    assert cap["pickle_bytes"] == len(raw) and cap["history_entries"] == 0
    assert set(cap) == {"snapshot_s", "pickle_s", "summary_s", "total_s", "pickle_bytes", "history_entries"}
    assert art.manifest["summary"]["trigger"] == "request"
    assert art.manifest["summary"]["allocated_bytes"] == 4 * MB
    assert art.manifest["summary"]["top_site"] == "/home/u/train.py:40 in step"


def test_an_oom_takes_the_observer_s_figures_and_the_allocator_s_record(monkeypatch, tmp_path):
    cuda = FakeCuda(monkeypatch, snapshot(oom_device=0))
    oom = {"device": 0, "requested_bytes": 66 * MB, "device_limit_bytes": 40 * GB, "device_free_bytes": MB}
    art = capture.capture(
        ArtifactStore(tmp_path),
        trigger="oom",
        job="j",
        host="h",
        rank=1,
        history_policy="python:10",
        oom=oom,
        stack="S\n",
    )
    s = _summary(art)
    assert s["failing_allocation"] == {
        **oom,
        "requested_bytes": 64 * MB,  # the caller's request, as the allocator recorded it
        "site": "/home/u/train.py:40 in step",
        "segment_request_bytes": 66 * MB,  # the cudaMalloc that failed
    }
    entry = s["device_memory"]["0"]
    assert entry["free_bytes"] == MB and entry["limit_bytes"] == 40 * GB and entry["total_bytes"] == 80 * GB
    assert ("mem_get_info", 0) not in cuda.asked  # the failing device is not queried at the OOM
    assert art.file(STACK_FILE).read_text() == "S\n"
    assert s["capture"]["history_entries"] == 2
    assert art.manifest["summary"]["failing_device"] == 0 and art.manifest["summary"]["failing_bytes"] == 64 * MB


def test_an_oom_on_a_device_without_segments_or_history_keeps_the_observer_s_figures(monkeypatch, tmp_path):
    FakeCuda(monkeypatch, snapshot(oom_device=None), broken=("get_device_properties",))
    oom = {"device": 1, "requested_bytes": 2 * MB, "device_limit_bytes": 40 * GB, "device_free_bytes": 0}
    art = capture.capture(
        ArtifactStore(tmp_path), trigger="oom", job=None, host=None, rank=None, history_policy="off", oom=oom
    )
    s = _summary(art)
    assert sorted(s["device_memory"]) == ["0", "1"]
    one = s["device_memory"]["1"]
    # the device's size unknown: the observer's limit stands in
    assert one["total_bytes"] == 40 * GB and one["limit_bytes"] == 40 * GB and one["free_bytes"] == 0
    assert s["failing_allocation"]["requested_bytes"] == 2 * MB and "site" not in s["failing_allocation"]
    assert "==== cuda:1 ====" in art.file(MEMORY_SUMMARY_FILE).read_text()


def test_every_device_query_that_fails_is_said_and_the_capture_completes(monkeypatch, tmp_path):
    FakeCuda(
        monkeypatch,
        snapshot(oom_device=None),
        broken=("memory_stats", "mem_get_info", "get_device_name", "memory_summary"),
    )
    art = capture.capture(ArtifactStore(tmp_path), trigger="request", job="j", host="h", rank=0, history_policy="off")
    assert art.status == "complete"
    entry = _summary(art)["device_memory"]["0"]
    assert entry == {
        "stats_error": "RuntimeError: memory_stats is broken",
        "mem_info_error": "RuntimeError: mem_get_info is broken",
    }
    assert art.file(MEMORY_SUMMARY_FILE).read_text() == (
        "==== cuda:0 ====\n(memory_summary failed: RuntimeError: memory_summary is broken)\n"
    )


def test_a_capture_that_fails_leaves_a_failed_artifact_and_raises(monkeypatch, tmp_path):
    FakeCuda(monkeypatch, {"segments": [{"device": 0, "blocks": [object()]}], "device_traces": []})
    store = ArtifactStore(tmp_path)
    with pytest.raises(Exception) as raised:
        capture.capture(store, trigger="request", job="j", host="h", rank=0, history_policy="off")
    (art,) = store.list(kind="memory")
    assert art.status == "failed"
    assert art.manifest["error"].startswith(type(raised.value).__name__ + ": ")
