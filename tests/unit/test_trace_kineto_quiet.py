"""dynprof's own traces print none of Kineto's lines, and leave the job's Kineto settings alone:
a profiler the job starts after a dynprof trace still prints what Kineto prints for it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, sys
import torch
from collectors.torch_trace import TraceOptions, TraceSession

def mark(text):
    sys.stderr.flush()
    os.write(2, (text + "\n").encode())

def job_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch.ones(4) + 1

if sys.argv[1] == "job-first":
    mark("JOB-BEFORE"); job_profile()
mark("DYNPROF")
session = TraceSession(TraceOptions(activities=["cpu"]), {"rank": 0})
session.start(first_step=1)
torch.ones(4) * 2
session.stop()
mark("JOB")
job_profile()
mark("END " + repr(os.environ.get("KINETO_LOG_LEVEL")))
"""


def _run(order: str, env_extra: dict[str, str] | None = None) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env.update(env_extra or {})
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, order], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    sections: dict[str, list[str]] = {"": []}
    current = ""
    for line in out.stderr.splitlines():
        if line in ("JOB-BEFORE", "DYNPROF", "JOB") or line.startswith("END "):
            current = line
            sections[current] = []
        else:
            sections[current].append(line)
    return sections


def _kineto_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "profiler_start" in line or "profiler_stop" in line]


@pytest.mark.parametrize("order", ["dynprof-first", "job-first"])
def test_job_profiler_after_a_dynprof_trace_still_prints_kinetos_lines(order):
    # GIVEN a process whose own profiler prints Kineto's lines (this build prints them)
    # WHEN dynprof traces (Kineto's first use, or after the job's), then the job profiles
    sections = _run(order)

    # THEN dynprof's trace printed none of Kineto's lines
    assert _kineto_lines(sections["DYNPROF"]) == [], sections["DYNPROF"]
    # AND the job's profiler afterwards prints them as before, the environment unchanged
    if order == "job-first" and not _kineto_lines(sections["JOB-BEFORE"]):
        pytest.skip("this torch build's Kineto prints no profiler_start/stop lines")
    assert len(_kineto_lines(sections["JOB"])) == 2, sections["JOB"]
    assert "END None" in sections


def test_the_jobs_own_kineto_level_stays_the_jobs():
    # GIVEN a job that quiets Kineto itself
    sections = _run("dynprof-first", {"KINETO_LOG_LEVEL": "6"})
    # THEN its profiler stays quiet after dynprof's trace initialised Kineto
    assert _kineto_lines(sections["JOB"]) == []
    assert "END '6'" in sections
