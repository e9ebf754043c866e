"""What a verdict says and where it is kept (dynprof.watch.conclusion)."""

from __future__ import annotations

import json
from pathlib import Path

from collectors.stacks import Frame, ProcessStacks, Stacks, ThreadStack
from dynprof.watch.conclusion import health_clause, write_verdict
from dynprof.watch.model import Culprit, Verdict


def test_the_healthcheck_clause_names_each_node_s_failing_checks_three_at_most():
    health = {
        "node-1": {
            "problems": [
                {"name": "xid_errors", "status": "fail", "device": 3, "reason": "Xid 79"},
                {"name": "clock_events", "status": "warn", "device": 1, "reason": "thermal"},
                *[{"name": f"c{i}", "status": "fail", "device": None, "reason": "r"} for i in range(5)],
            ]
        },
        "node-2": {"verdict": "healthy", "problems": []},
        "node-3": "not a summary",
    }
    clause = health_clause(health)
    assert clause == "; healthcheck: node-1 GPU 3: xid_errors: Xid 79; node-1: c0: r; node-1: c1: r"
    assert health_clause({"node-2": {"problems": []}}) == "" and health_clause(None) == ""


def test_a_verdict_is_written_as_an_artifact_with_its_stacks():
    # GIVEN a hang verdict and the stacks its look read
    verdict = Verdict(
        kind="hang",
        job="j",
        conclusion="rank 3 on node-2 is in load_next_batch",
        detected_at=1.0,
        decided_at=2.0,
        culprits=[Culprit(rank=3, host="node-2", where="load_next_batch", why="not in the collective", pid=103)],
    )
    frames = [Frame("load_next_batch", "/job/data.py", 88)]
    stacks = Stacks(
        [ProcessStacks(pid=103, method="py-spy", rank=3, threads=[ThreadStack(103, main=True, frames=frames)])]
    )
    # WHEN written
    path = Path(write_verdict(verdict, stacks))
    # THEN the artifact holds both documents, and its summary the conclusion
    assert Verdict.from_json(json.loads((path / "verdict.json").read_text())).culprits[0].rank == 3
    assert json.loads((path / "stacks.json").read_text())["processes"][0]["pid"] == 103
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "verdict" and manifest["status"] == "complete"
    assert manifest["summary"]["conclusion"] == verdict.conclusion
    assert manifest["summary"]["culprits"][0]["rank"] == 3
    # AND a verdict that did not look is written without stacks
    assert not (Path(write_verdict(verdict, None)) / "stacks.json").exists()
