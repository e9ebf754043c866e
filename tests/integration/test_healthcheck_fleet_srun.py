"""`dynprof healthcheck --srun`: one healthcheck per node of the allocation through srun, no
sidecars; a fake ``srun`` on PATH starts the tasks on this machine (labelled output, as srun's
``--label`` writes it), some of which misbehave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_SRUN = ROOT / "tests" / "integration" / "programs" / "fake_srun_program.py"


def srun_on_path(directory: Path) -> str:
    srun = directory / "srun"
    srun.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_SRUN} "$@"\n')
    srun.chmod(0o755)
    return f"{directory}{os.pathsep}{os.environ['PATH']}"


def preflight(tmp_path: Path, nodelist: str, tasks: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": srun_on_path(tmp_path),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": "4242",
        "FAKE_SRUN_TASKS": tasks,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cmd = [sys.executable, "-m", "dynprof", "healthcheck", "--srun", "--level", "quick", "--expect-devices", "0"]
    return subprocess.run(
        [*cmd, "--no-save", *extra], capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT)
    )


def test_every_task_is_a_node_and_tasks_that_print_nothing_garbage_or_too_much_are_named(tmp_path):
    # GIVEN an allocation of five nodes where task 2 prints nothing, 3 garbage and 4 five MiB
    # WHEN the preflight runs through srun
    out = preflight(tmp_path, "gpu[01-05]", "2=silent,3=garbage,4=flood", "--json")

    # THEN the two healthy tasks are their nodes' reports, and the three others did not answer
    doc = json.loads(out.stdout)
    assert doc["how"] == "srun"
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert list(by_node) == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu05"]
    assert all(by_node[n]["status"] in ("healthy", "warning") for n in ("gpu01", "gpu02"))
    assert all(by_node[n]["answered"] and by_node[n]["checks"] for n in ("gpu01", "gpu02"))
    assert {d["node"]: d["reasons"][0]["code"] for d in doc["drain"]} == {
        "gpu03": "unreachable",
        "gpu04": "unreachable",
        "gpu05": "unreachable",
    }
    assert "printed nothing" in by_node["gpu03"]["error"]
    assert "no JSON report" in by_node["gpu04"]["error"]
    assert "over 4 MiB" in by_node["gpu05"]["error"]
    # none unhealthy, some could not be checked: exit 3
    assert doc["exit_code"] == 3 and out.returncode == 3


def test_drain_lines_without_sidecars(tmp_path):
    # GIVEN three nodes, the last one silent
    # WHEN the slurm drain lines are asked for
    out = preflight(tmp_path, "n[1-3]", "2=silent", "--drain-command", "slurm")

    # THEN stdout holds only the drain line of the silent node; the verdict is on stderr
    assert out.stdout.splitlines() == [
        "scontrol update NodeName=n3 State=DRAIN 'Reason=dynprof preflight: unreachable'"
    ]
    assert "verdict could not run (exit 3): 1 of 3 node(s) to drain" in out.stderr
    assert out.returncode == 3


def test_a_task_that_prints_on_and_on_does_not_hold_the_others_until_the_deadline(tmp_path):
    # GIVEN three nodes, the last one's task printing short lines until it is stopped
    # WHEN the preflight runs through srun (its deadline: the 60 s wait plus srun's start)
    out = preflight(tmp_path, "c[1-3]", "2=chatty", "--json", "--timeout", "60")

    # THEN the honest nodes are their reports, the chatty one is refused by its bound, and srun
    # was stopped once that was so, not at its deadline
    doc = json.loads(out.stdout)
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert all(by_node[n]["answered"] and by_node[n]["checks"] for n in ("c1", "c2")), by_node
    assert by_node["c3"]["error"] == "its task printed over 50000 lines: refused"
    assert "srun ran past" not in out.stderr, out.stderr
    assert "every task answered or printed past its bound (c3): srun was stopped" in out.stderr


def test_tasks_of_one_character_lines_are_cut_by_their_line_bound(tmp_path):
    # GIVEN four nodes, three of whose tasks print one-character lines until they are stopped
    # (4 MiB of them would be two million lines a task)
    # WHEN the preflight runs through srun
    out = preflight(tmp_path, "t[1-4]", "1=terse,2=terse,3=terse", "--json", "--timeout", "60")

    # THEN each is refused by its line bound, the honest node is its report, and srun was
    # stopped once every task was decided, not at its deadline
    doc = json.loads(out.stdout)
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert by_node["t1"]["answered"] and by_node["t1"]["checks"], by_node
    for node in ("t2", "t3", "t4"):
        assert by_node[node]["error"] == "its task printed over 50000 lines: refused"
    assert "srun ran past" not in out.stderr, out.stderr
    assert "every task answered or printed past its bound (t2, t3, t4): srun was stopped" in out.stderr


def test_lines_that_name_no_task_stop_srun_with_the_reason(tmp_path):
    # GIVEN two nodes, one task printing lines without srun's label until it is stopped
    # WHEN the preflight runs through srun
    out = preflight(tmp_path, "u[1-2]", "1=unlabelled", "--json", "--timeout", "60")

    # THEN srun is stopped for it, saying why, and the node whose task had not answered is named
    doc = json.loads(out.stdout)
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert "srun printed over 10000 lines that name no task of this allocation" in out.stderr, out.stderr
    assert "srun ran past" not in out.stderr
    assert by_node["u2"]["error"] == "srun was stopped before its task answered"
    assert doc["exit_code"] == 3 and out.returncode == 3
