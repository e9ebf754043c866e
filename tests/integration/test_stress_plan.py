"""The short version of scripts/stress_plan.py: one training job asked for memory plans, traces and
memory snapshots by three clients at once, with a sidecar polling the node, survives every one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT


def test_plans_traces_and_snapshots_at_once_never_kill_the_job():
    # GIVEN the stress program's job, clients and sidecar (on this loaded test machine)
    # WHEN 24 plans, 6 traces and 4 snapshots are asked by three clients at once
    counts = ["--plans", "24", "--traces", "6", "--snapshots", "4", "--clients", "3", "--load", "0"]
    res = subprocess.run(
        [sys.executable, "scripts/stress_plan.py", *counts, "--width", "32", "--depth", "4"],
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = res.stdout + res.stderr
    # THEN the job never died, no request failed (each answered, or refused in words), and plans
    # were measured
    assert "deaths of the job: 0" in out, out[-3000:]
    assert res.returncode == 0, out[-3000:]
    plans = re.search(r"^plan\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.M)
    assert plans is not None, out[-3000:]
    sent, ok, _refused, failed = map(int, plans.groups())
    assert sent == 24 and ok >= 1 and failed == 0, out[-3000:]
    assert "sidecar polls: " in out and "/api/v1/progress 200" in out, out[-3000:]
