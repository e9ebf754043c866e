"""Attach to a CUDA training loop started with plain python, then trace it and snapshot its
memory. Run on the GPU machine: gdb must be on PATH for Python < 3.14 (a gdb unpacked from
Debian's .deb files works, see docs/attach.md): PATH=/path/to/gdb-dir:$PATH pytest -m gpu
tests/gpu/test_attach_gpu.py -s"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from collectors.torch_trace import profiler_steps, read_trace, summarize

PROGRAM = "tests/integration/programs/attach_program.py"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ptrace,
    pytest.mark.skipif(
        shutil.which("gdb") is None and sys.version_info < (3, 14),
        reason="attach to Python < 3.14 needs gdb on PATH (see docs/attach.md for a gdb unpacked from .deb files)",
    ),
]


def test_attach_to_a_plain_cuda_loop_then_trace_and_snapshot(spawn, cli, dynprof_dirs):
    # GIVEN a CUDA training loop started with plain python (no dynprof env)
    target = spawn([PROGRAM, "--device", "cuda", "--width", "1024", "--step-sleep", "0.002"], under_run=False)
    (pid,) = target.ready_pids(timeout=120)

    # WHEN dynprof attaches to it
    attached = cli("attach", str(pid), "--json")

    # THEN the agent runs there, started by attach
    assert attached.returncode == 0, attached.stderr
    (proc,) = json.loads(attached.stdout)["processes"]
    assert proc["status"] == "attached", proc
    print(f"\nattach: {proc['method']}, agent ready after {proc['seconds']:.2f} s (gdb ran {proc['inject_s']:.2f} s)")

    # WHEN three steps are traced THEN the trace holds them, with GPU kernels
    traced = cli("start", "--pid", str(pid), "--steps", "3", "--json")
    assert traced.returncode == 0, traced.stderr
    (res,) = json.loads(traced.stdout)["results"]
    trace = read_trace(Path(res["artifact"]) / "trace.json.gz")
    assert len(profiler_steps(trace)) == 3
    summary = summarize(trace)
    assert summary["gpu_kernel_count"] > 0, "no GPU kernels in the trace"
    print(f"GPU kernels traced: {summary['gpu_kernel_count']}")

    # WHEN a memory snapshot is taken on demand
    snap = cli("memory", "--pid", str(pid), "--json")

    # THEN it loads, and the allocator history, recorded since the attach (the default
    # policy, as under `dynprof run`), holds the loop's forward-pass allocations with their stacks
    assert snap.returncode == 0, snap.stderr
    (result,) = json.loads(snap.stdout)["results"]
    art = Path(result["artifact"])
    snapshot = pickle.loads((art / "snapshot.pickle").read_bytes())
    assert snapshot["segments"]
    summary = json.loads((art / "summary.json").read_text())
    assert summary["trigger"] == "on-demand"
    events = [e for trace in snapshot["device_traces"] for e in trace]
    print(f"memory snapshot: {len(snapshot['segments'])} segments, {len(events)} history events")
    assert events, "no allocator history recorded since the attach"
    assert any("attach_program.py" in str(f.get("filename")) for e in events for f in e.get("frames", []))
    assert target.proc.poll() is None
