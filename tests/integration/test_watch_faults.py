"""The watch's injected-fault suite: a 4-rank gloo job over two simulated nodes, one fault each.

Each "node" is a `dynprof serve` on a loopback port with its own run directory, store and
DYNPROF_HOST (tests/support/nodes.py, the ``sim_nodes`` fixture); ranks 0-1 run on node A
(127.0.0.1), ranks 2-3 on node B (localhost). `dynprof watch --hosts A,B --json` runs from a
third place with no agents.

Fault cases: the verdict is a hang that names the faulty rank and its node. False-alarm cases
(a checkpoint that really writes, an evaluation without optimizer steps, a slow first step, a
slow DataLoader warm-up, each longer than the stall time): no hang verdict, a busy one.

Lengths scale with DYNPROF_WATCH_SCALE (default 1: a 6 s stall time, phases of 3x that).
The full-length variants (the 90 s checkpoint, the 2-minute evaluation) are marked
``watch_full`` and run only when asked: ``pytest -m watch_full tests/integration/test_watch_faults.py``.
Each case prints its detection and verdict times (no timed assertion).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.nodes import SimNode, split_job

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = "tests/integration/programs/watch_program.py"
SCALE = float(os.environ.get("DYNPROF_WATCH_SCALE", "1"))
STALL_S = 6.0 * SCALE
PHASE_S = 3 * STALL_S
FAULT_AT = 8


def start_job(spawn: Any, nodes: dict[str, Any], job: str, args: list[str]) -> list[Any]:
    """Ranks 0-1 on node A, 2-3 on node B, each under `dynprof run`."""
    a, b = nodes["a"], nodes["b"]
    return split_job(spawn, PROGRAM, [a, a, b, b], job, args)


class Watch:
    """`dynprof watch --json` as a subprocess; its JSON lines collected as they come."""

    def __init__(self, nodes: dict[str, Any], job: str, max_seconds: float, extra: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "DYNPROF_TOKEN_FILE": str(nodes["token"])}
        cmd = [
            sys.executable, "-m", "dynprof", "watch", "--job", job, "--hosts", nodes["hosts"], "--json",
            "--interval", "1", "--stall-after", f"{STALL_S:g}", "--look-interval", "1.5",
            "--max-seconds", f"{max_seconds:g}", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._out = threading.Thread(target=self._read, daemon=True)
        self._out.start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip("\n"))

    def verdicts(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e["verdict"] for e in self.events if kind is None or e["verdict"]["kind"] == kind]

    def wait_for(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.verdicts(kind)
            if found:
                return found[0]
            if self.proc.poll() is not None and not self._out.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(
            f"no {kind} verdict within {timeout} s; verdicts: {[v['conclusion'] for v in self.verdicts()]}\n"
            + "\n".join(self.stderr[-30:])
        )

    def wait_for_stderr(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.stderr):
                return
            assert self.proc.poll() is None, "\n".join(self.stderr[-30:])
            time.sleep(0.2)
        raise AssertionError(f"the watch never said {text!r}:\n" + "\n".join(self.stderr[-30:]))

    def wait_for_stderr_after(self, seen: int, text: str, timeout: float) -> None:
        """Until a line past the first ``seen`` says ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.stderr[seen:]):
                return
            assert self.proc.poll() is None, "\n".join(self.stderr[-30:])
            time.sleep(0.2)
        raise AssertionError(f"the watch never said {text!r} again:\n" + "\n".join(self.stderr[-30:]))

    def wait_end(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._out.join(10)
        return rc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def wait_until_stepped(node: SimNode, token: Path, job: str, rank: int, timeout: float = 120.0) -> None:
    """Until ``node``'s sidecar (its book, which the watch reads) has seen ``rank`` of ``job``
    take a step."""
    import urllib.request

    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        f"http://{node.address}/api/v1/progress?job={job}",
        headers={"Authorization": f"Bearer {token.read_text().strip()}"},
    )
    while time.monotonic() < deadline:
        with urllib.request.urlopen(request, timeout=10) as answer:
            doc = json.load(answer)
        if any(r.get("rank") == rank and (r.get("step") or 0) > 0 for r in doc.get("ranks", [])):
            return
        time.sleep(0.2)
    raise AssertionError(f"the sidecar of {node.name} never saw rank {rank} of {job} step")


def report(case: str, verdict: dict[str, Any]) -> None:
    timing = verdict["evidence"].get("timing", {})
    print(
        f"\nWATCH-FAULT {case}: kind={verdict['kind']} detection_s={timing.get('detection_s')} "
        f"verdict_s={timing.get('verdict_s')} look_s={timing.get('look_s')}: {verdict['conclusion']}"
    )


FAULTS = [
    # (fault, faulty rank, its node, the state the verdict gives it)
    ("sleep-data", 3, "b", "parked"),
    ("skip", 1, "a", "waiting in all_reduce"),
    ("stop", 2, "b", "stopped"),
    ("spin", 1, "a", "moving"),
    ("gil", 3, "b", "in-c"),
]


@pytest.mark.ptrace
@pytest.mark.parametrize(("fault", "rank", "node", "state"), FAULTS, ids=[f[0] for f in FAULTS])
def test_the_hang_verdict_names_the_faulty_rank_and_its_node(sim_nodes, spawn, fault, rank, node, state, tmp_path):
    # GIVEN a 4-rank job over two nodes in which one rank meets a fault at step FAULT_AT
    job = f"wf-{fault}"
    go = tmp_path / "fault"
    args = ["--fault", fault, "--fault-rank", str(rank), "--fault-at", str(FAULT_AT), "--fault-file", str(go)]
    targets = start_job(spawn, sim_nodes, job, [*args, "--max-seconds", "240"])
    for t in targets:
        t.ready_pids(timeout=120)
    watch = Watch(sim_nodes, job, max_seconds=200)
    faulty = targets[rank]
    try:
        # (the fault comes once the watch has read every rank, the faulty one past a step: it
        # keeps the last step a stuck agent told, and its node's book may be older than the
        # rank's first step: so, once the book saw one, one more of the watch's reads)
        watch.wait_for_stderr("4 rank(s)", timeout=120)
        wait_until_stepped(sim_nodes[node], sim_nodes["token"], job, rank)
        ticks = len(watch.stderr)
        watch.wait_for_stderr_after(ticks, "4 rank(s)", timeout=120)
        go.touch()
        faulty.wait_for_line("FAULT", timeout=120)
        # WHEN the watch runs over both nodes until it gives a hang verdict
        verdict = watch.wait_for("hang", timeout=180)
        report(fault, verdict)

        # THEN the verdict names that rank on its node, and only it
        label = sim_nodes[node].label
        assert [(c["rank"], c["host"]) for c in verdict["culprits"]] == [(rank, label)], verdict["conclusion"]
        assert f"rank {rank} on {label}" in verdict["conclusion"]
        row = next(r for r in verdict["ranks"] if r["rank"] == rank)
        assert row["state"] == state, verdict["ranks"]
        others = [r for r in verdict["ranks"] if r["rank"] != rank]
        assert len(others) == 3 and all(r["state"].startswith("waiting in") for r in others), verdict["ranks"]
        # every rank's last step and age, the merged stacks, the times
        assert sorted(r["rank"] for r in verdict["ranks"]) == [0, 1, 2, 3]
        assert all(r["step"] >= FAULT_AT for r in others), verdict["ranks"]
        # (a rank whose agent went silent keeps the last step it told the watch: maybe before the fault's)
        assert row["step"] > 0 and all(r["last_step_age_s"] is not None for r in verdict["ranks"])
        assert verdict["evidence"]["stacks"]["groups"]
        assert {"detection_s", "verdict_s"} <= set(verdict["evidence"]["timing"])
        assert set(verdict["evidence"]["healthcheck"]) == {label}
        # said once for this stall, not every interval
        time.sleep(3)
        assert len(watch.verdicts("hang")) == 1
    finally:
        watch.stop()
        if fault == "stop":
            os.kill(faulty.ready_pids()[0], signal.SIGCONT)


FALSE_ALARMS = ["checkpoint", "eval", "slow-first", "slow-warmup"]


def _no_hang_through_a_phase(sim_nodes: dict[str, Any], spawn: Any, fault: str, phase_s: float, tmp_path: Path) -> None:
    job = f"wf-{fault}"
    end_file = tmp_path / "end"
    args = [
        "--fault",
        fault,
        "--phase-seconds",
        f"{phase_s:g}",
        "--max-seconds",
        f"{phase_s + 150:g}",  # a bound only: the job ends when the test says so (end_file)
        "--end-file",
        str(end_file),
        "--out",
        str(tmp_path),
    ]
    targets = start_job(spawn, sim_nodes, job, args)
    before_first = fault in ("slow-first", "slow-warmup")
    watch = Watch(sim_nodes, job, max_seconds=phase_s + 120) if before_first else None
    try:
        for t in targets:
            (t.wait_for_line("FAULT", timeout=120) if before_first else t.ready_pids(timeout=120))
        if watch is None:
            watch = Watch(sim_nodes, job, max_seconds=phase_s + 120)
        # WHEN the watch runs through the phase, sees the steps resume, and the job then ends
        watch.wait_for("ok", timeout=phase_s + 120)
        end_file.touch()
        for t in targets:
            t.wait_for_line("DONE", timeout=120)
        watch.wait_end(timeout=90)

        # THEN it said what the ranks were doing (busy), never a hang, and saw progress resume
        busy = watch.verdicts("busy")
        hangs = watch.verdicts("hang")
        for v in busy + hangs:
            report(fault, v)
        assert hangs == [], [v["conclusion"] for v in hangs]
        assert busy, [v["conclusion"] for v in watch.verdicts()] + watch.stderr[-20:]
        assert "moving" in busy[0]["conclusion"] and busy[0]["culprits"] == []
    finally:
        if watch is not None:
            watch.stop()


@pytest.mark.ptrace
@pytest.mark.parametrize("fault", FALSE_ALARMS)
def test_busy_phases_longer_than_the_stall_time_are_not_called_a_hang(sim_nodes, spawn, fault, tmp_path):
    # GIVEN a 4-rank job over two nodes whose ranks all enter a phase without steps, 3x the stall time
    _no_hang_through_a_phase(sim_nodes, spawn, fault, PHASE_S, tmp_path)


@pytest.mark.watch_full
@pytest.mark.ptrace
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("fault", "phase_s"), [("checkpoint", 90.0), ("eval", 120.0)])
def test_full_length_phases_are_not_called_a_hang(sim_nodes, spawn, fault, phase_s, tmp_path, request):
    # GIVEN the lengths: a 90 s checkpoint save, a 2-minute evaluation (on demand only)
    if "watch_full" not in (request.config.getoption("markexpr", "") or ""):
        pytest.skip("full-length watch case: run `pytest -m watch_full tests/integration/test_watch_faults.py`")
    _no_hang_through_a_phase(sim_nodes, spawn, fault, phase_s, tmp_path)
