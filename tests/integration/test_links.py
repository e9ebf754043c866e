"""Link tests between simulated nodes (sidecars), through the sidecars' link-test action.

With root, `ip` and `tc`, each node is a network namespace of its own and one node's link is
shaped with tbf; elsewhere those tests skip. The hung-peer tests run on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dynprof.job.client import SidecarClient
from healthcheck.links.rounds import CODE_HUNG, CODE_SLOW, LinkReport, run_link_rounds
from tests.support.links import ROOT, TOKEN, NetnsNodes, SimNodes, netns_usable

# One network (10.213.0.0/24 or the next free one, its bridge and namespaces) and fixed store
# ports: these cases never run beside each other on two xdist workers (ONE_WORKER_MODULES,
# tests/conftest.py).

LINK_TEST = [sys.executable, "-m", "dynprof", "link-test"]
FAR_DEADLINE_S = 600.0  # a hang detector, not a measurement

NETNS_SKIP = netns_usable()


def run_rounds_bounded(nodes: SimNodes, **kwargs: Any) -> LinkReport:
    """run_link_rounds on a thread, waited for up to a far deadline: it must return."""
    box: list[LinkReport] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            box.append(run_link_rounds(nodes.nodes, SidecarClient(TOKEN, timeout=10.0), **kwargs))
        except BaseException as exc:  # pragma: no cover - shown by the assertion below
            errors.append(exc)

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    worker.join(FAR_DEADLINE_S)
    assert not worker.is_alive(), "run_link_rounds did not return"
    assert not errors, errors
    return box[0]


@pytest.fixture
def netns_nodes(tmp_path) -> Iterator[NetnsNodes]:
    if NETNS_SKIP:
        pytest.skip(NETNS_SKIP)
    sims = NetnsNodes(4, workdir=tmp_path / "nodes")
    try:
        yield sims.start()
    finally:
        sims.close()


@pytest.fixture
def loopback_nodes(tmp_path) -> Iterator[SimNodes]:
    sims = SimNodes(4, workdir=tmp_path / "nodes")
    try:
        yield sims.start()
    finally:
        sims.close()


def test_a_node_with_a_shaped_link_is_named_within_two_rounds(netns_nodes):
    # GIVEN four nodes in namespaces of their own, node 2's link shaped to 40 Mbit/s both ways
    # (healthy pairs here measure ~0.1 GB/s, 20x more)
    netns_nodes.shape(2, "40mbit")
    # WHEN the link rounds run through their sidecars (gloo: no GPU here), with a threshold of
    # 50 %: gloo between namespaces on a small shared machine spreads by tens of % (CPU
    # scheduling, see docs/links.md); the shaped link is far below that
    report = run_rounds_bounded(netns_nodes, backend="gloo", size_bytes=2 << 20, round_limit_s=90, threshold=0.5)
    # THEN node 2 alone is named, isolated, link-slow, in round 2 at the latest
    doc = report.to_json()
    print(json.dumps(doc["rounds"], indent=1))
    assert [(f["host"], f["code"], f["isolated"]) for f in doc["findings"]] == [("node-2", CODE_SLOW, True)]
    assert len(doc["rounds"]) <= 2
    finding = doc["findings"][0]
    assert finding["busbw_gbps"] < 0.5 * finding["median_gbps"]
    assert {tuple(p["hosts"]) for p in finding["pairs"]} == {("node-2", "node-3"), ("node-2", "node-0")}
    # AND the figures are bus bandwidths of the tests that ran between the namespaces
    assert all(g["busbw_gbps"] > 0 for r in doc["rounds"] for g in r["groups"])
    assert doc["schema"] == "dynprof.healthcheck.links" and doc["schema_version"] == 1


def test_a_stopped_node_is_a_hung_link_reported_within_the_rounds_limit(loopback_nodes):
    # GIVEN four nodes on loopback, node 3's sidecar stopped (SIGSTOP): it never joins a test
    loopback_nodes.stop_node(3)
    # WHEN the link rounds run with a 60 s limit per round
    report = run_rounds_bounded(loopback_nodes, backend="gloo", size_bytes=1 << 20, round_limit_s=60, store_port=29830)
    # THEN the call returned; the stopped node is named link-hung, isolated, in round 2
    doc = report.to_json()
    assert [(f["node"], f["code"], f["isolated"]) for f in doc["findings"]] == [
        (loopback_nodes.nodes[3].address, CODE_HUNG, True)
    ], json.dumps(doc["rounds"], indent=1)
    assert len(doc["rounds"]) == 2
    # AND its partner of round 1 said it waited out the limit (its own side answered hung)
    first = doc["rounds"][0]["groups"][1]
    assert first["status"] == "hung"
    partner = first["sides"][0]
    assert partner["host"] == "node-2" and partner["status"] == "hung", partner
    assert "60 s" in partner["error"]


def test_one_side_whose_peer_never_joins_answers_hung_within_its_limit():
    # GIVEN rank 0 of a pair whose rank 1 never starts
    proc = subprocess.run(
        [*LINK_TEST, "--json", "--store-host=127.0.0.1", "--store-port=29841", "--rank=0", "--limit=8"],
        capture_output=True,
        text=True,
        timeout=FAR_DEADLINE_S,
        cwd=str(ROOT),
    )
    # THEN it answers hung (exit 9, timed out) with its limit, and no process is left behind
    doc = json.loads(proc.stdout)
    assert proc.returncode == 9, proc.stderr
    assert doc["status"] == "hung" and doc["limit_s"] == 8.0
    assert "8 s" in doc["error"]


def test_link_test_refuses_what_it_cannot_run():
    # GIVEN a rank outside the world, and no store host
    for args in (["--store-host=h", "--rank=2"], ["--rank=0"], ["--store-host=h", "--size=1"]):
        proc = subprocess.run(
            [sys.executable, "-m", "dynprof", "link-test", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(ROOT),
        )
        # THEN a usage error with its help, no traceback
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "link-test" in proc.stderr


def test_the_preflight_with_links_drains_the_node_with_the_slow_link(netns_nodes):
    # GIVEN four nodes in namespaces of their own, node 1's link shaped to 40 Mbit/s
    netns_nodes.shape(1, "40mbit")
    hosts = ",".join(n.address for n in netns_nodes.nodes)
    # WHEN the job-wide healthcheck runs their quick checks and then the link tests
    proc = subprocess.run(
        [
            *[sys.executable, "-m", "dynprof", "healthcheck", "--hosts", hosts],
            *["--token-file", str(netns_nodes.token_file), "--level", "quick", "--expect-devices", "0"],
            *["--no-save", "--links", "--link-backend", "gloo", "--link-size", "2M", "--link-threshold", "0.5"],
            *["--link-limit", "90", "--link-port", "29870", "--json"],
        ],
        capture_output=True,
        text=True,
        timeout=FAR_DEADLINE_S,
        cwd=str(ROOT),
    )
    # THEN node 1 is drained for link-slow with its figure and the median of the other pairs,
    # the others are not, and the links document travels in the fleet document
    doc = json.loads(proc.stdout)
    drained = {d["name"]: [r["code"] for r in d["reasons"]] for d in doc["drain"]}
    assert drained == {netns_nodes.nodes[1].host: ["link-slow"]}, (proc.stderr, json.dumps(doc["links"])[:3000])
    (reason,) = doc["drain"][0]["reasons"]
    assert reason["value"] < 0.5 * reason["median"] and reason["unit"] == "GB/s"
    assert doc["links"]["schema"] == "dynprof.healthcheck.links" and len(doc["links"]["rounds"]) <= 2
    assert proc.returncode == 2
    assert "links:" in proc.stderr


def _listeners(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                found.add(address)
    return found


def test_rank_zero_listens_only_on_the_address_it_is_bound_to():
    # GIVEN rank 0 of a pair told to listen on loopback only (what a sidecar bound there gives it)
    port = 29851
    proc = subprocess.Popen(
        [*LINK_TEST, "--json", "--store-host=127.0.0.1", f"--store-port={port}", "--rank=0", "--limit=60",
         "--bind=127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT),
    )  # fmt: skip
    try:
        # WHEN its rendezvous is up (polled; the bound only stops a hang)
        deadline = time.monotonic() + 120
        seen: set[str] = set()
        while time.monotonic() < deadline and proc.poll() is None and not seen:
            seen = _listeners(port)
            time.sleep(0.2)
        # THEN it listens on 127.0.0.1 alone, not on every address
        assert seen == {"0100007F"}, (seen, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


def _worker_peak_rss(size: int, port: int) -> int:
    """The peak RSS (bytes) of rank 0 of a gloo pair on loopback exchanging ``size`` bytes."""
    argv = [sys.executable, "-m", "healthcheck.links.worker", "--world=2", "--store-host=127.0.0.1",
            f"--store-port={port}", "--backend=gloo", f"--size={size}", "--iters=1", "--warmup=1", "--timeout=120"]  # fmt: skip
    procs = [
        subprocess.Popen([*argv, f"--rank={rank}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=str(ROOT))
        for rank in (0, 1)
    ]
    peaks = []
    for proc in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
        peaks.append(usage.ru_maxrss * 1024)
    return max(peaks)


def test_a_sides_memory_does_not_grow_with_twice_the_size():
    # GIVEN a pair exchanging 4 MiB, then one exchanging 256 MiB
    small = _worker_peak_rss(4 << 20, 29861)
    size = 256 << 20
    large = _worker_peak_rss(size, 29862)
    grown = large - small
    print(f"peak RSS of a side: {small / 2**20:.0f} MiB at 4 MiB, {large / 2**20:.0f} MiB at 256 MiB")
    # THEN the larger exchange costs less than its size more (it is streamed in pieces), not
    # two buffers of the whole size
    assert grown < size


def test_link_test_refuses_a_privileged_port_and_a_size_past_its_bound():
    for args in (["--store-host=h", "--store-port=81"], ["--store-host=h", f"--size={2 << 30}"]):
        proc = subprocess.run([*LINK_TEST, *args], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "link-test" in proc.stderr
