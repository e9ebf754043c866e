"""Memory snapshots: reading, summarising, capturing into an artifact, the offline report.

A synthetic snapshot (built here, in PyTorch's format) checks the arithmetic; the real one in
tests/data (written by dynprof at a real CUDA OOM on an H200, see tests/data/make_memory_snapshot.py)
checks that the same code reads what PyTorch really produces.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest

from collectors.memory import MEMORY_SUMMARY_FILE, SNAPSHOT_FILE, STACK_FILE, SUMMARY_FILE
from collectors.memory.capture import capture, thread_stack
from collectors.memory.reader import load_snapshot
from collectors.memory.render import format_summary
from collectors.memory.summary import NO_STACK, summarize_snapshot
from dynprof.cli import main
from dynprof.errors import ArtifactError
from dynprof.store import Artifact, ArtifactStore

MB = 1 << 20
DATA = Path(__file__).resolve().parent.parent / "data"
REAL_ARTIFACT = DATA / "memory_oom_artifact"

TORCH_FRAME = {
    "filename": "/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py",
    "line": 125,
    "name": "forward",
}
STDLIB_FRAME = {"filename": "/usr/lib/python3.12/threading.py", "line": 1010, "name": "run"}


def frames(*sites: tuple[str, int, str]) -> list[dict]:
    return [TORCH_FRAME] + [{"filename": f, "line": n, "name": fn} for f, n, fn in sites] + [STDLIB_FRAME]


def block(addr: int, size: int, state: str, fr: list | None = None, requested: int | None = None) -> dict:
    return {
        "address": addr,
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": fr or [],
    }


def synthetic(with_history: bool = True) -> dict:
    step = frames(("/home/u/train.py", 40, "step"), ("/home/u/train.py", 80, "main"))
    fwd = frames(("/home/u/model.py", 10, "forward"))
    base, small = 0x7F0000000000, 0x7F1000000000
    segments = [
        {
            "device": 0,
            "address": base,
            "total_size": 20 * MB,
            "stream": 0,
            "segment_type": "large",
            "blocks": [
                block(base, 8 * MB, "active_allocated", step),
                block(base + 8 * MB, 2 * MB, "inactive"),
                block(base + 10 * MB, 4 * MB, "active_allocated", fwd, 4 * MB - 100),
                block(base + 14 * MB, 6 * MB, "inactive"),
            ],
        },
        {
            "device": 0,
            "address": small,
            "total_size": 2 * MB,
            "stream": 0,
            "segment_type": "small",
            "blocks": [block(small, 512, "active_pending_free", step), block(small + 512, 2 * MB - 512, "inactive")],
        },
        {
            "device": 1,
            "address": base,
            "total_size": 4 * MB,
            "stream": 0,
            "segment_type": "large",
            "blocks": [block(base, 4 * MB, "active_allocated", fwd)],
        },
    ]
    traces: list[list[dict]] = [[], []]
    if with_history:
        traces[0] = [
            {"action": "segment_alloc", "addr": base, "size": 20 * MB, "stream": 0, "frames": step, "time_us": 1000},
            {"action": "alloc", "addr": base, "size": 8 * MB, "stream": 0, "frames": step, "time_us": 1001},
            {"action": "alloc", "addr": base + 10 * MB, "size": 4 * MB, "stream": 0, "frames": fwd, "time_us": 1002},
            {"action": "oom", "device_free": MB, "size": 64 * MB, "stream": 0, "frames": step, "time_us": 3000},
        ]
    else:
        for seg in segments:
            for b in seg["blocks"]:
                b["frames"] = []
    return {"segments": segments, "device_traces": traces}


# -- summary arithmetic ------------------------------------------------------------------------
def test_summary_totals_and_fragmentation():
    s = summarize_snapshot(synthetic())
    d0, d1 = s["devices"]
    assert d0["reserved_bytes"] == 22 * MB and d0["segments"] == 2 and d0["blocks"] == 6
    assert d0["allocated_bytes"] == 12 * MB
    assert d0["active_bytes"] == 12 * MB + 512 and d0["pending_free_bytes"] == 512
    assert d0["inactive_bytes"] == 10 * MB - 512
    assert d0["largest_inactive_block"] == 6 * MB
    assert d0["fragmentation"] == pytest.approx(1 - 6 * MB / (10 * MB - 512), abs=1e-4)
    assert d1["allocated_bytes"] == d1["reserved_bytes"] == 4 * MB and d1["fragmentation"] == 0.0
    assert s["totals"]["allocated_bytes"] == 16 * MB


def test_sites_skip_torch_and_stdlib_frames_and_rank_by_bytes():
    s = summarize_snapshot(synthetic())
    sites = [(x["site"], x["bytes"], x["blocks"], x["devices"]) for x in s["top_sites"]]
    assert sites[0] == ("/home/u/train.py:40 in step", 8 * MB + 512, 2, [0])
    assert sites[1] == ("/home/u/model.py:10 in forward", 8 * MB, 2, [0, 1])
    assert s["largest_blocks"][0]["size"] == 8 * MB
    assert s["largest_blocks"][0]["site"] == "/home/u/train.py:40 in step"


def test_history_and_recorded_oom():
    s = summarize_snapshot(synthetic())
    (h,) = s["history"]
    assert h["entries"] == 4 and h["actions"]["alloc"] == 2 and h["span_s"] == 0.002
    (oom,) = s["oom_events"]
    assert oom["requested_bytes"] == 64 * MB and oom["device_free_bytes"] == MB
    assert oom["site"] == "/home/u/train.py:40 in step"
    assert s["history_recorded"] and s["stacks_recorded"]


def test_snapshot_without_history_says_so():
    s = summarize_snapshot(synthetic(with_history=False))
    assert not s["history_recorded"] and not s["stacks_recorded"]
    assert s["top_sites"][0]["site"] == NO_STACK
    assert "memory history was off" in format_summary(s)


# -- reading files ---------------------------------------------------------------------------------
def test_a_pickle_round_trips(tmp_path):
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(synthetic(), protocol=4))
    assert load_snapshot(path) == synthetic()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"hello, not a pickle\n", "is not a pickle"),
        (pickle.dumps({"a": 1}), "not a PyTorch memory snapshot"),
        (pickle.dumps([1, 2, 3]), "a pickle of a list"),
        (pickle.dumps(synthetic())[:200], "is truncated"),
        (b"\x80\x04\x95" + b"\x00" * 20, "not"),
    ],
)
def test_files_that_are_not_snapshots_get_a_clear_error(tmp_path, content, message):
    path = tmp_path / "x.pickle"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message):
        load_snapshot(path)


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [Evil()], "device_traces": []}))
    with pytest.raises(ArtifactError, match="refers to pathlib"):
        load_snapshot(path)
    assert not marker.exists()


# -- capture into an artifact (torch's CUDA functions stand in for a GPU) ----------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    snap = synthetic()
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: snap)
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats",
        lambda d=None: {"allocated_bytes.all.current": 12 * MB, "reserved_bytes.all.current": 22 * MB, "num_ooms": 1},
    )
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda d=None: f"summary of device {d}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (5 * MB, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    return snap


def test_capture_writes_a_complete_self_describing_artifact(fake_cuda, tmp_path):
    # GIVEN a process whose allocator holds the synthetic state, at an OOM on device 0
    oom = {"device": 0, "requested_bytes": 66 * MB, "device_limit_bytes": 80 * 2**30, "device_free_bytes": MB}

    # WHEN it is captured
    art = capture(
        ArtifactStore(tmp_path),
        trigger="oom",
        job="j",
        host="h",
        rank=3,
        history_policy="python:100000",
        oom=oom,
        stack=thread_stack(),
    )

    # THEN the artifact holds the pickle, the summary, memory_summary per device and the stack
    assert art.status == "complete" and not art.verify()
    assert {f["name"] for f in art.manifest["files"]} == {
        SNAPSHOT_FILE,
        SUMMARY_FILE,
        MEMORY_SUMMARY_FILE,
        STACK_FILE,
    }
    assert pickle.loads(art.file(SNAPSHOT_FILE).read_bytes()) == fake_cuda
    summary = json.loads(art.file(SUMMARY_FILE).read_text())
    failing = summary["failing_allocation"]
    # the allocator's own record of the OOM gives the caller's size and site
    assert failing["requested_bytes"] == 64 * MB and failing["segment_request_bytes"] == 66 * MB
    assert failing["site"] == "/home/u/train.py:40 in step"
    assert summary["device_memory"]["0"]["free_bytes"] == MB  # from the observer, not queried
    assert summary["device_memory"]["1"]["free_bytes"] == 5 * MB
    assert "summary of device 0" in art.file(MEMORY_SUMMARY_FILE).read_text()
    assert "test_capture_writes_a_complete_self_describing_artifact" in art.file(STACK_FILE).read_text()
    assert art.manifest["summary"]["failing_bytes"] == 64 * MB
    assert art.manifest["rank"] == 3 and art.manifest["options"]["trigger"] == "oom"
    assert summary["capture"]["pickle_bytes"] == art.file(SNAPSHOT_FILE).stat().st_size


def test_show_renders_a_memory_artifact(fake_cuda, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path))
    art = capture(
        ArtifactStore(),
        trigger="oom",
        job="j",
        host="h",
        rank=0,
        history_policy="python:100000",
        oom={"device": 0, "requested_bytes": 66 * MB, "device_limit_bytes": 80 * 2**30, "device_free_bytes": MB},
        stack=thread_stack(),
    )
    assert main(["show", str(art.path)]) == 0
    out = capsys.readouterr().out
    assert "CUDA out of memory on cuda:0: tried to allocate 64.00 MiB at /home/u/train.py:40 in step" in out
    assert "stack of the thread that hit the OOM" in out


# -- the offline report ------------------------------------------------------------------------------
def _no_network(page: str) -> None:
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "@import" not in page and "url(http" not in page


def test_report_on_a_pickle_writes_offline_html(tmp_path, capsys):
    path = tmp_path / "dump.pickle"
    path.write_bytes(pickle.dumps(synthetic(), protocol=4))
    out = tmp_path / "r.html"
    assert main(["memory-report", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "/home/u/model.py:10 in forward" in text and f"HTML report: {out}" in text
    page = out.read_text()
    _no_network(page)
    assert "<svg" in page and "/home/u/train.py:40 in step" in page
    assert 'download="snapshot.pickle"' in page


def test_report_json(tmp_path, capsys):
    path = tmp_path / "dump.pickle"
    path.write_bytes(pickle.dumps(synthetic(), protocol=4))
    assert main(["memory-report", str(path), "--no-html", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["html"] is None and data["summary"]["totals"]["allocated_bytes"] == 16 * MB


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"plain text\n", "is not a pickle"),
        (pickle.dumps(synthetic())[:300], "is truncated"),
        (pickle.dumps({"x": 1}), "not a PyTorch memory snapshot"),
    ],
)
def test_report_on_bad_input_fails_clearly(tmp_path, capsys, content, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    assert main(["memory-report", str(path)]) == 1
    err = capsys.readouterr().err
    assert message in err and "what to do:" in err
    assert not list(tmp_path.glob("*.html"))


def test_report_on_a_missing_path(tmp_path, capsys):
    assert main(["memory-report", str(tmp_path / "nope.pickle")]) == 1
    assert "no such file or artifact" in capsys.readouterr().err


def test_report_on_a_snapshot_without_history_warns(tmp_path, capsys):
    path = tmp_path / "nohist.pickle"
    path.write_bytes(pickle.dumps(synthetic(with_history=False), protocol=4))
    out = tmp_path / "r.html"
    assert main(["memory-report", str(path), "-o", str(out)]) == 0
    assert "no allocation history or stacks" in capsys.readouterr().out
    assert "memory history was off" in out.read_text()


# -- real PyTorch output (recorded on an H200) --------------------------------------------------------
real = pytest.mark.skipif(not (REAL_ARTIFACT / SNAPSHOT_FILE).exists(), reason="no recorded snapshot in tests/data")


@real
def test_real_snapshot_is_readable_and_consistent():
    snapshot = load_snapshot(REAL_ARTIFACT / SNAPSHOT_FILE)
    s = summarize_snapshot(snapshot)
    # the summary agrees with the allocator's own per-segment counters
    for d in s["devices"]:
        segs = [x for x in snapshot["segments"] if x["device"] == d["device"]]
        assert d["reserved_bytes"] == sum(x["total_size"] for x in segs)
        assert d["allocated_bytes"] == sum(x["allocated_size"] for x in segs)
        assert d["active_bytes"] == sum(x["active_size"] for x in segs)
    assert s["history_recorded"] and s["stacks_recorded"]
    assert 0 < s["history"][0]["entries"] <= 1000  # recorded with --memory-history 1000
    (oom,) = s["oom_events"]
    assert "oom_program.py" in oom["site"] and "make_inputs" in oom["site"]
    assert "oom_program.py" in s["top_sites"][0]["site"]


@real
def test_real_artifact_matches_its_saved_summary():
    art = Artifact.load(REAL_ARTIFACT)
    assert art.kind == "memory" and not art.verify()
    saved = json.loads((REAL_ARTIFACT / SUMMARY_FILE).read_text())
    fresh = summarize_snapshot(load_snapshot(REAL_ARTIFACT / SNAPSHOT_FILE))
    for key in ("devices", "totals", "top_sites", "largest_blocks", "history", "oom_events"):
        assert json.loads(json.dumps(fresh[key])) == saved[key], key
    assert saved["failing_allocation"]["requested_bytes"] == saved["oom_events"][0]["requested_bytes"]


@real
def test_real_artifact_report_and_show(tmp_path, capsys):
    out = tmp_path / "real.html"
    assert main(["memory-report", str(REAL_ARTIFACT), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "CUDA out of memory on cuda:0" in text and "make_inputs" in text
    page = out.read_text()
    _no_network(page)
    assert page.count("<svg") >= 2 and "torch.cuda._memory_viz.segsum" in page
    assert main(["show", str(REAL_ARTIFACT)]) == 0
    assert "top allocation sites" in capsys.readouterr().out
