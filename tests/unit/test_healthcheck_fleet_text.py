"""healthcheck.fleet_text: the job-wide report as text, nodes by the checks that are not a pass
everywhere, the peers compared, what to drain and why, the verdict."""

from __future__ import annotations

from typing import Any

from healthcheck import fleet
from healthcheck.fleet import NodeOutcome
from healthcheck.fleet_text import render_fleet


def report(gemm: float, status: str = "pass", exit_code: int = 0) -> dict[str, Any]:
    checks = [
        {"name": "devices", "status": "pass", "value": 1, "critical": True},
        {"name": "disk_free", "status": "pass", "value": 100.0},
        {"name": "ecc_errors", "status": status, "device": 0, "value": 0, "reason": "ecc"},
        {"name": "gemm_bf16", "status": "pass", "device": 0, "value": gemm, "unit": "TFLOP/s",
         "metric": "gemm_bf16_tflops", "details": {"correct": True}},
    ]  # fmt: skip
    return {
        "schema": "dynprof.healthcheck",
        "schema_version": 1,
        "level": "standard",
        "exit_code": exit_code,
        "duration_s": 1.0,
        "devices": [{"index": 0, "sku": "NVIDIA H200 140GiB"}],
        "checks": checks,
    }


def fleet_of(*outcomes: NodeOutcome) -> fleet.FleetReport:
    return fleet.judge(list(outcomes), level="standard", duration_s=3.25)


def test_the_table_shows_only_the_checks_that_are_not_a_pass_everywhere():
    # GIVEN three nodes, one slow, one with a failed check, and one that did not answer
    result = fleet_of(
        NodeOutcome("a", "a", True, report(660.0)),
        NodeOutcome("b", "b", True, report(661.0)),
        NodeOutcome("slow", "slow", True, report(500.0)),
        NodeOutcome("bad", "bad", True, report(659.0, status="fail", exit_code=2)),
        NodeOutcome("down", "down", False, error="connection refused"),
    )
    # WHEN rendered
    text = render_fleet(result)
    lines = text.splitlines()
    # THEN the head counts the nodes, the columns are the checks that are not a pass everywhere,
    # the drained nodes are named with their reasons, and the verdict ends it
    assert lines[0].startswith("dynprof healthcheck: 5 nodes (sidecars), level standard, 3.2 s; 2 healthy")
    assert lines[1].startswith("peers: 1 of 1 figures compared across nodes (slow: more than 10% below")
    header = lines[3].split()
    assert header[:2] == ["NODE", "VERDICT"] and "ecc_errors" in header and "gemm_bf16" in header
    assert "disk_free" not in header
    assert "(2 other check(s) passed or were skipped on every node that answered)" in text
    assert "  down: unreachable: connection refused" in lines
    assert any(line.startswith("  slow: peer-slow: gemm_bf16_tflops on device 0 500") for line in lines)
    assert lines[-1] == "verdict: UNHEALTHY (exit 2)"


def test_failures_only_leaves_the_healthy_nodes_out():
    result = fleet_of(
        NodeOutcome("a", "a", True, report(660.0)),
        NodeOutcome("down", "down", False, error="timed out"),
    )
    rows = render_fleet(result, failures_only=True).splitlines()
    assert not [r for r in rows if r.startswith("a ")]
    assert any(r.startswith("down") for r in rows)


def test_no_node_at_all_says_so():
    assert "(no node to show)" in render_fleet(fleet_of())
