"""The agent's CUDA calls from its own thread (the step marker's query, the progress probe)
never break a CUDA graph capture of the job's: a job that stops stepping and captures graphs in
PyTorch's default (global) capture mode, one after another, while its agent is asked for its
status as fast as it answers. Run on a GPU machine: ``pytest -m gpu tests/gpu/test_gpu_probe_capture.py -s``.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.gpu]
PROGRAM = "tests/gpu/programs/graph_capture_program.py"


def test_status_answers_during_global_mode_graph_captures_break_no_capture(spawn):
    from dynprof.client import AgentClient

    # GIVEN a job that stepped on CUDA, then captures CUDA graphs for 20 s without a step
    target = spawn([PROGRAM, "--seconds", "20"])
    (pid,) = target.ready_pids(timeout=240)
    # WHEN its agent is asked for its status without pause during the captures
    answers, probed, behind = 0, 0, 0
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline and target.proc.poll() is None:
        g = AgentClient.for_pid(pid, timeout=10.0).status().gpu_step
        answers += 1
        probed += g.probed
        behind += g.probed and not g.probe_done
    # THEN every capture succeeded and the job ended well
    done = target.wait_for_line("DONE", timeout=120)
    assert target.proc.wait(timeout=60) == 0, "\n".join(target.lines[-30:])
    captures = int(done[0].split("captures=")[1])
    print(f"\n{answers} status answers, {probed} with a probe ({behind} behind), {captures} captures")
    assert captures >= 5, done
    # and the probe ran during them (the rank had not stepped for PROBE_AFTER_S)
    assert probed >= 10, (answers, probed)
