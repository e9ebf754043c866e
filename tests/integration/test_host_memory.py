"""Host-memory pressure capture in real processes (CPU)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from dynprof.store import ArtifactStore

PROGRAM = "tests/integration/programs/host_memory_program.py"
LIMIT = 4 * 2**30
FRACTION = 0.25  # capture above 1 GiB of RSS
ENV = {
    "DYNPROF_HOST_MEMORY_LIMIT": str(LIMIT),
    "DYNPROF_HOST_MEMORY_FRACTION": str(FRACTION),
    "DYNPROF_HOST_MEMORY_INTERVAL_S": "0.1",
}


def _artifacts(kind: str = "host-memory") -> list:
    return ArtifactStore().list(kind=kind)


def test_capture_fires_above_the_limit_and_not_below(spawn, dynprof_dirs):
    # GIVEN two training processes under `dynprof run` with a 4 GiB limit and a 25 % threshold:
    # one steady at its baseline, one that grows 1.2 GiB of CPU tensors past it
    steady = spawn([PROGRAM, "--target-mb", "0", "--max-seconds", "240"], env=ENV)
    grower = spawn([PROGRAM, "--target-mb", "1280", "--chunk-mb", "64", "--max-seconds", "240"], env=ENV)
    steady_pid = steady.ready_pids()[0]
    baseline = int(steady.wait_for_line("READY")[0].split()[2])
    assert baseline < LIMIT * FRACTION * 0.8, (
        f"the steady program's baseline RSS {baseline} is too close to the threshold"
    )
    grower_pid = grower.ready_pids()[0]
    grower_baseline = int(grower.wait_for_line("READY")[0].split()[2])
    held_rss = int(grower.wait_for_line("HELD", timeout=120)[0].split()[1])
    assert held_rss > LIMIT * FRACTION

    # WHEN the watchers have had many checks (0.1 s apart) at those levels
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not [a for a in _artifacts() if a.manifest["pid"] == grower_pid]:
        time.sleep(0.1)
    time.sleep(1.0)

    # THEN exactly one artifact exists, from the grower, with its RSS, limit, stacks and tensors
    arts = _artifacts()
    assert [a.manifest["pid"] for a in arts] == [grower_pid], [a.manifest["pid"] for a in arts]
    assert steady_pid not in [a.manifest["pid"] for a in arts]
    (art,) = arts
    assert art.status == "complete"
    summary = json.loads((art.path / "summary.json").read_text())
    assert summary["limit_bytes"] == LIMIT and summary["limit_source"] == "configured"
    assert summary["rss_bytes"] >= LIMIT * FRACTION
    assert summary["usage_fraction"] >= FRACTION
    stacks = (art.path / "stacks.txt").read_text()
    assert "host_memory_program.py" in stacks and "in main" in stacks
    tensors = summary["largest_cpu_tensors"]
    chunk = 64 * 2**20
    assert tensors and tensors[0]["bytes"] == chunk, tensors[:3]
    # The capture came at the first check past the threshold: by then the cache held at least
    # the chunks needed to get there from the grower's own baseline (which is larger with a
    # CUDA build of torch), less the one that may have been in flight.
    needed = max(1, int((LIMIT * FRACTION - grower_baseline) // chunk) - 1)
    found = sum("activation_cache[" in t["where"] for t in tensors)
    assert found >= needed, (found, needed, [t["where"] for t in tensors])
    assert summary["cpu_tensor_bytes_found"] >= needed * chunk

    # AND `dynprof show` renders it
    from dynprof.renderers import render

    _, text = render(art)
    assert "% of the limit" in text and "activation_cache" in text


def test_watch_is_off_when_asked(spawn, dynprof_dirs):
    # GIVEN a grower whose watch is turned off
    env = dict(ENV, DYNPROF_HOST_MEMORY_FRACTION="off")
    grower = spawn([PROGRAM, "--target-mb", "1280", "--max-seconds", "20"], env=env)
    grower.ready_pids()
    grower.wait_for_line("HELD", timeout=60)

    # WHEN it holds the memory for a while
    time.sleep(1.5)

    # THEN nothing is captured
    assert _artifacts() == []
    assert Path(dynprof_dirs["artifacts"]).exists() is False or not any(
        Path(dynprof_dirs["artifacts"]).rglob("manifest.json")
    )
