"""CUDA memory capture on a real GPU: OOM under `dynprof run`, snapshots and history on demand.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_memory_gpu.py -s`` (the OOM capture
time and the history overhead are printed).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynprof.client import AgentClient
from dynprof.store import ArtifactStore

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent.parent
OOM_PROGRAM = "tests/integration/programs/oom_program.py"
TRAIN_PROGRAM = "tests/integration/programs/train_program.py"


def _memory_artifacts() -> list:
    return ArtifactStore().list(kind="memory")


def _wait_exit(target, timeout: float = 180.0) -> int:
    try:
        return target.proc.wait(timeout=timeout)
    finally:
        target._reader.join(timeout=5)


def test_real_oom_under_dynprof_run_writes_the_snapshot(spawn):
    # GIVEN a training loop whose batch grows until the whole GPU is used, under `dynprof run`
    # with the default history policy (warm-up steps fill the history first)
    # (a fixed policy: this test reads the full event history; `auto` has its own, test_memory_auto_gpu)
    target = spawn(
        [OOM_PROGRAM, "--warmup-steps", "2000", "--grow-mb", "1024"], env={"DYNPROF_MEMORY_HISTORY": "100000"}
    )

    # WHEN it runs out of CUDA memory and dies of it
    rc = _wait_exit(target)

    # THEN it failed with a real OutOfMemoryError, and one memory artifact was written at the OOM
    out = "\n".join(target.lines)
    assert rc != 0 and "OutOfMemoryError" in out, out[-3000:]
    assert "dynprof: CUDA out of memory on cuda:0: memory snapshot written to" in out, out[-3000:]
    (art,) = _memory_artifacts()
    assert art.status == "complete" and art.manifest["options"]["trigger"] == "oom"

    # AND the pickle loads with plain pickle and holds segments and device traces
    with open(art.path / "snapshot.pickle", "rb") as fh:
        snapshot = pickle.load(fh)
    assert snapshot["segments"] and any(snapshot["device_traces"])
    assert any(e["action"] == "oom" for e in snapshot["device_traces"][0])

    # AND the summary names the failing allocation's size and the program's allocation site
    summary = json.loads((art.path / "summary.json").read_text())
    last_alloc = int([line for line in target.lines if line.startswith("ALLOC ")][-1].split()[1])
    failing = summary["failing_allocation"]
    assert failing["device"] == 0
    assert failing["requested_bytes"] == last_alloc, (failing, last_alloc)
    assert "oom_program.py" in failing["site"] and "make_inputs" in failing["site"], failing
    assert failing["device_free_bytes"] < last_alloc
    top = summary["top_sites"][0]
    assert "oom_program.py" in top["site"] and "make_inputs" in top["site"], summary["top_sites"][:3]
    assert top["bytes"] > 0.5 * summary["totals"]["allocated_bytes"]
    dev = summary["device_memory"]["0"]
    assert dev["total_bytes"] > 0 and dev["allocated_bytes"] > 0.5 * dev["total_bytes"]
    assert summary["memory_history"] == "python:100000"
    assert "make_inputs" in (art.path / "stack.txt").read_text()
    assert (
        "Memory Allocator" in (art.path / "memory_summary.txt").read_text()
        or "allocated" in (art.path / "memory_summary.txt").read_text().lower()
    )
    cap = summary["capture"]
    print(
        f"\nOOM capture on {dev.get('name')}: total {cap['total_s']} s (snapshot {cap['snapshot_s']} s, "
        f"pickle {cap['pickle_s']} s, summary {cap['summary_s']} s), pickle {cap['pickle_bytes'] / 2**20:.1f} MiB, "
        f"{cap['history_entries']} history events; {dev['allocated_bytes'] / 2**30:.1f} GiB allocated of "
        f"{dev['total_bytes'] / 2**30:.1f} GiB"
    )

    # AND the offline report reads it
    from dynprof.cli import main

    assert main(["memory-report", str(art.path), "-o", str(art.path.parent / "report.html")]) == 0


def test_oom_retry_loop_is_rate_limited(spawn):
    # GIVEN a job that catches OOMs and retries (five more OOMs within seconds), with a cap
    target = spawn(
        [OOM_PROGRAM, "--warmup-steps", "5", "--grow-mb", "1024", "--limit-gb", "8", "--retries", "5"],
        env={"DYNPROF_MEMORY_OOM_INTERVAL_S": "600", "DYNPROF_MEMORY_OOM_MAX": "3"},
    )

    # WHEN it runs to the end
    rc = _wait_exit(target)

    # THEN six OOMs happened and only the first was captured
    assert rc == 0, "\n".join(target.lines[-40:])
    assert len([line for line in target.lines if line.startswith("OOM ")]) == 6
    arts = _memory_artifacts()
    assert len(arts) == 1, [a.path for a in arts]


def test_on_demand_snapshot_and_history_control(spawn, cli):
    # GIVEN a GPU training loop under `dynprof run`
    target = spawn(
        [TRAIN_PROGRAM, "--device", "cuda", "--width", "512", "--step-sleep", "0.002", "--max-seconds", "120"],
        env={"DYNPROF_MEMORY_HISTORY": "100000"},
    )
    (pid,) = target.ready_pids()
    client = AgentClient.for_pid(pid)
    deadline = time.monotonic() + 120
    while client.status().memory_history != "python:100000" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.status().cuda_initialized
    assert client.status().memory_history == "python:100000"

    # WHEN a snapshot is asked for
    t0 = time.perf_counter()
    res = cli("memory", "--pid", str(pid), "--json")
    took = time.perf_counter() - t0

    # THEN it is written, loads, and names the program's allocation sites
    assert res.returncode == 0, res.stderr
    (result,) = json.loads(res.stdout)["results"]
    art_path = Path(result["artifact"])
    snapshot = pickle.loads((art_path / "snapshot.pickle").read_bytes())
    assert snapshot["segments"]
    summary = json.loads((art_path / "summary.json").read_text())
    assert summary["trigger"] == "on-demand" and summary["failing_allocation"] is None
    assert any("train_program.py" in s["site"] for s in summary["top_sites"]), summary["top_sites"]
    assert "train_program.py" in (art_path / "stack.txt").read_text()
    print(f"\non-demand snapshot: CLI round trip {took:.2f} s, capture {summary['capture']['total_s']} s")

    # WHEN history is stopped, then restarted with a small ring
    stop = cli("memory", "--pid", str(pid), "--history-stop")
    assert stop.returncode == 0, stop.stderr
    assert client.status().memory_history == "off"
    start = cli("memory", "--pid", str(pid), "--history-start", "500", "--json")
    assert start.returncode == 0, start.stderr
    assert json.loads(start.stdout)["results"][0]["memory_history"] == "python:500"
    time.sleep(1.0)

    # THEN the next snapshot holds at most that many events, all recorded since the restart
    res = cli("memory", "--pid", str(pid), "--json")
    assert res.returncode == 0, res.stderr
    snap2 = pickle.loads((Path(json.loads(res.stdout)["results"][0]["artifact"]) / "snapshot.pickle").read_bytes())
    events = snap2["device_traces"][0]
    assert 0 < len(events) <= 500


def test_agent_never_initialises_cuda_in_a_cpu_process(spawn, cli):
    # GIVEN a CPU-only training loop under `dynprof run` on a machine with GPUs
    target = spawn([TRAIN_PROGRAM, "--max-seconds", "60"])
    (pid,) = target.ready_pids()

    # WHEN a memory snapshot and history are asked for
    snap = cli("memory", "--pid", str(pid))
    hist = cli("memory", "--pid", str(pid), "--history-start", "1000")

    # THEN both say the process has no CUDA (exit 7), and CUDA is still not initialised there
    assert snap.returncode == 7 and "has not used CUDA" in snap.stderr, snap.stderr
    assert hist.returncode == 7, hist.stderr
    status = AgentClient.for_pid(pid).status()
    assert not status.cuda_initialized and status.memory_history == "off"


def test_history_overhead_benchmark_prints_ratios():
    # GIVEN the benchmark script, short settings
    cmd = [
        sys.executable,
        "scripts/bench_memory_history.py",
        "--workloads",
        "small",
        "--seconds",
        "1",
        "--warmup-seconds",
        "0.6",
        "--rounds",
        "2",
        "--policies",
        "off,auto,100000",
        "--no-dump",
    ]

    # WHEN it runs
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)

    # THEN it reports a ratio for the default policy against off
    assert proc.returncode == 0, proc.stderr
    print("\n" + proc.stdout)
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.startswith(("off ", "auto ", "100000 "))
    }
    assert float(rows["off"][2]) == 1.0
    assert 0.5 < float(rows["100000"][2]) < 5.0 and 0.5 < float(rows["auto"][2]) < 5.0
