"""The harness of scripts/bench_fanout.py at a tiny scale: simulated nodes start, answer, are
measured, and leave no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_starts_answers_and_stops(cli: Any) -> None:
    bench = load_script("bench_fanout")
    # GIVEN two simulated nodes of two light ranks each
    cluster = bench.Cluster(2, 2, job="tiny")
    try:
        ready = cluster.start(timeout=120)
        assert ready["all_ready_s"] > 0 and len(cluster.rank_pids) == 4
        # THEN each node's own CLI sees its own ranks, under the node's host name
        out = cli(
            "ps", "--job", "tiny", "--json", env={**cluster.env(), "DYNPROF_RUN_DIR": str(cluster.nodes[1].run_dir)}
        )
        assert out.returncode == 0, out.stderr
        agents = json.loads(out.stdout)["agents"]
        assert sorted((a["rank"], a["host"]) for a in agents) == [(2, "node-001"), (3, "node-001")]
        # and the memory of sidecars and ranks is measured
        mem = cluster.memory()
        assert mem["rank_pss_mib"] > 0 and mem["sidecar_rss_mib"] > 0
        assert cluster.hostfile(2).read_text().splitlines() == [n.address for n in cluster.nodes]
        pids = [*cluster.rank_pids, *cluster.sidecar_pids(), cluster.ranks_proc.pid]
    finally:
        left = cluster.stop()
    # WHEN stopped THEN nothing is left, not even a zombie, and the directories are gone
    assert left == []
    assert not any(bench._alive(pid) for pid in pids)
    assert not cluster.root.exists()


def test_interrupted_bench_leaves_nothing(tmp_path: Path) -> None:
    # GIVEN the bench running (memory only, no timed part)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "bench_fanout.py"), "--nodes", "2", "--ranks-per-node", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(ROOT),
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("memory:") or not line:
                break
        assert lines[-1].startswith("memory:"), "".join(lines)
        children = subprocess.run(["pgrep", "-f", "_fanout_ranks.py|dynprof serve"], capture_output=True, text=True)
        ours = [int(p) for p in children.stdout.split() if _descends_from(int(p), proc.pid)]
        assert ours
        # WHEN interrupted as by Ctrl-C
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # THEN it stops every node and says so
    assert "all nodes and ranks stopped" in rest, rest
    deadline = time.monotonic() + 60  # (gone: reaped, or a zombie that init is about to reap)
    while [p for p in ours if _running(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in ours if _running(p)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


def test_report_states_the_model(capsys: Any) -> None:
    bench = load_script("bench_fanout")
    # GIVEN runs whose wall time grows by 20 ms a node over 0.5 s, and 4 ms of CLI CPU a node
    results = {
        ("ps", n): [bench.Run(0.5 + 0.02 * n, 0.3 + 0.004 * n, 0.05 * n, 8 * n, 0) for _ in range(3)]
        for n in (1, 8, 16, 32, 64)
    }
    bench.report(results, 8)
    out = capsys.readouterr().out
    # THEN the line, the per-node costs, the verdict at 512 ranks and both 1024-node estimates
    assert "ps: wall = 0.500 s + 20.0 ms x nodes here" in out
    assert "per node: 20.0 ms of wall time here, 4.0 ms of the CLI's own CPU, 50 ms of CPU on the node" in out
    assert "512 ranks: 1.780 s; target <= 3 s for 512: meets" in out
    assert "1024 nodes x 8 ranks: 21.0 s if every node shared this machine's CPUs" in out
    assert "one node's time 0.52 s + 1024 x 4.0 ms of CLI CPU" in out
