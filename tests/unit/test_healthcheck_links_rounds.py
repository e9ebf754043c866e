"""healthcheck.links.rounds over a fake sidecar client: findings, hung and silent nodes, JSON."""

from __future__ import annotations

import json
import threading
from typing import Any

from dynprof.nodes import Node, NodeAnswer
from healthcheck.links.rounds import (
    CODE_FAILED,
    CODE_HUNG,
    CODE_SLOW,
    LINKS_SCHEMA,
    GroupResult,
    LinkFinding,
    LinkReport,
    median_figure,
    run_link_rounds,
)

NODES = [Node(f"10.0.0.{i + 1}", 8787) for i in range(8)]


class FakeClient:
    """Answers each side with its node's speed (the rounds take the slowest side's figure);
    ``hung`` nodes answer hung, ``failed`` ones fail, ``silent`` ones do not answer."""

    def __init__(self, speeds: dict[int, float] | None = None, hung=(), failed=(), silent=(), refused=()) -> None:
        self.speeds = speeds or {}
        self.hung, self.failed, self.silent, self.refused = set(hung), set(failed), set(silent), set(refused)
        self.calls: list[tuple[int, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def action(self, node: Node, name: str, options: dict[str, Any], timeout: float | None = None) -> NodeAnswer:
        i = NODES.index(node)
        with self.lock:
            self.calls.append((i, dict(options)))
        assert name == "link-test" and timeout is not None and timeout > options["limit"]
        host = f"node-{i}"
        if i in self.silent:
            return NodeAnswer(node, False, error="timed out", elapsed_s=timeout)
        if i in self.refused:
            return NodeAnswer(node, False, error="403: this sidecar is read-only", elapsed_s=0.01)
        if i in self.hung:
            result = {"status": "hung", "error": f"limit of {options['limit']:g} s", "wall_s": options["limit"]}
            return NodeAnswer(node, True, host=host, exit_code=9, result=result)
        if i in self.failed:
            return NodeAnswer(node, True, host=host, exit_code=1, result={"status": "failed", "error": "bind: in use"})
        result = {"status": "ok", "busbw_gbps": 20.0 * self.speeds.get(i, 1.0), "wall_s": 3.0}
        return NodeAnswer(node, True, host=host, exit_code=0, result=result)


def test_a_slow_node_is_named_with_its_figure_the_median_and_its_pairs():
    # GIVEN eight nodes, node 5 at half speed
    client = FakeClient({5: 0.5})
    lines: list[str] = []
    # WHEN the rounds run
    report = run_link_rounds(NODES, client, backend="gloo", size_bytes=1 << 20, round_limit_s=30, progress=lines.append)
    # THEN node 5 alone is named, link-slow, isolated, with the figure and the median behind it
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["schema"] == LINKS_SCHEMA and doc["schema_version"] == 1 and doc["ok"] is False
    assert len(doc["rounds"]) == 2
    [finding] = doc["findings"]
    assert (finding["host"], finding["code"], finding["isolated"]) == ("node-5", CODE_SLOW, True)
    assert finding["busbw_gbps"] == 10.0 and finding["median_gbps"] == 20.0
    assert [p["hosts"] for p in finding["pairs"]] == [["node-4", "node-5"], ["node-5", "node-1"]]
    # AND each side was told its rank, its test's size and the store of its test's rank 0
    first = {i: o for i, o in client.calls[:8]}
    assert first[5]["rank"] == 1 and first[5]["store_host"] == "10.0.0.5" and first[4]["rank"] == 0
    assert first[4]["store_port"] == first[5]["store_port"] != first[0]["store_port"]
    assert {o["size"] for _, o in client.calls} == {1 << 20} and {o["backend"] for _, o in client.calls} == {"gloo"}
    # AND round 2 used other ports than round 1
    assert {o["store_port"] for _, o in client.calls[:8]}.isdisjoint({o["store_port"] for _, o in client.calls[8:]})
    assert lines and all(line.startswith("links: round ") for line in lines)


def test_healthy_nodes_give_no_finding_in_one_round():
    report = run_link_rounds(NODES, FakeClient(), round_limit_s=30)
    assert report.ok and report.findings == [] and len(report.rounds) == 1


def test_a_hung_node_is_link_hung_and_a_silent_one_too():
    for kwargs in ({"hung": [2]}, {"silent": [2]}):
        # GIVEN a node whose side hangs (or whose sidecar does not answer)
        report = run_link_rounds(NODES, FakeClient(**kwargs), round_limit_s=30)
        # THEN it alone is named link-hung, isolated
        assert [(f.node, f.code, f.isolated) for f in report.findings] == [(NODES[2].address, CODE_HUNG, True)], kwargs


def test_a_failing_node_is_link_failed_and_so_is_a_sidecar_that_refuses_at_once():
    # GIVEN a node whose side fails (a port in use), or whose sidecar refuses the action
    report = run_link_rounds(NODES, FakeClient(failed=[7]), round_limit_s=30)
    refused = run_link_rounds(NODES, FakeClient(refused=[4]), round_limit_s=30)
    # THEN it is named link-failed, not hung
    assert [(f.host, f.code) for f in report.findings] == [("node-7", CODE_FAILED)]
    assert [(f.node, f.code) for f in refused.findings] == [(NODES[4].address, CODE_FAILED)]


def test_two_nodes_slow_below_the_baseline_are_both_reported_not_isolated():
    # GIVEN two nodes whose pair is below the baseline (nothing else to compare with)
    report = run_link_rounds(NODES[:2], FakeClient({1: 0.5}), round_limit_s=30, baseline_gbps=20.0)
    # THEN both have a finding that says links alone cannot tell them apart
    assert [(f.host, f.code, f.isolated) for f in report.findings] == [
        ("node-0", CODE_SLOW, False),
        ("node-1", CODE_SLOW, False),
    ]
    assert "cannot pin" in report.findings[0].message


def test_one_node_tests_nothing_and_says_so():
    report = run_link_rounds(NODES[:1], FakeClient(), round_limit_s=30)
    assert report.ok and report.rounds == [] and "2 nodes" in report.notes[0]


def test_a_round_whose_sides_never_answer_ends_at_its_limit(monkeypatch):
    from healthcheck.links import rounds

    # GIVEN a client that never returns for node 3, and a short round margin
    monkeypatch.setattr(rounds, "ROUND_MARGIN_S", 0.2)
    release = threading.Event()

    class Stuck(FakeClient):
        def action(self, node, name, options, timeout=None):
            if NODES.index(node) == 3:
                release.wait(60)
            return super().action(node, name, options, timeout)

    try:
        report = run_link_rounds(NODES[:4], Stuck(), round_limit_s=0.1)
    finally:
        release.set()
    # THEN the rounds returned and node 3 is named hung
    assert [(f.node, f.code) for f in report.findings] == [(NODES[3].address, CODE_HUNG)]


def group(status: str, busbw: float | None) -> GroupResult:
    return GroupResult(round=1, members=(0, 1), nodes=["a", "b"], hosts=["a", "b"], status=status, busbw_gbps=busbw)


def test_median_figure_is_the_median_of_the_healthy_tests_only():
    # GIVEN two rounds with healthy, slow and hung tests
    report = LinkReport(["a", "b"], "gloo", "sendrecv", 1024, 0.2, None, 30.0)
    report.rounds = [
        [group("ok", 40.0), group("slow", 5.0), group("hung", None)],
        [group("ok", 60.0), group("ok", 50.0)],
    ]
    # THEN only the healthy tests count
    assert median_figure(report) == 50.0


def test_median_figure_of_a_report_without_healthy_tests_is_none():
    report = LinkReport(["a"], "gloo", "sendrecv", 1024, 0.2, None, 30.0)
    report.rounds = [[group("hung", None)]]
    assert median_figure(report) is None


def test_a_report_is_ok_until_it_has_a_finding_and_its_json_rounds_figures():
    report = LinkReport(["a", "b"], "gloo", "sendrecv", 1024, 0.2, None, 30.0)
    report.rounds, report.round_wall_s = [[group("ok", 12.345678)]], [1.23456]
    assert report.ok
    doc = report.to_json()
    assert (doc["schema"], doc["ok"]) == (LINKS_SCHEMA, True)
    assert doc["rounds"][0]["groups"][0]["busbw_gbps"] == 12.3457
    assert doc["rounds"][0]["wall_s"] == 1.235
    report.findings.append(LinkFinding("a", "a:8787", CODE_SLOW, True, 1.0, 12.0, None, [], "slow"))
    assert not report.ok and report.to_json()["findings"][0]["code"] == CODE_SLOW
