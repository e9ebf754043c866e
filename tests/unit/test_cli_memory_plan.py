"""`dynprof memory plan`'s text: a job's agreeing ranks under one plan with each rank's
figures, a rank that differs under its own plan saying how, single processes as before."""

from __future__ import annotations

import copy
from typing import Any

from collectors.memory.collect import MemoryPlanRequest, job_plans
from dynprof.cli._memory_plan import render

MEASUREMENT: dict[str, Any] = {
    "schema": 1,
    "device": "cpu",
    "blocks": [
        {"name": f"layers.{i}", "class": "Layer", "saved_bytes": 1 << 20, "freeable_bytes": 1 << 20, "forward_s": 0.01}
        for i in range(4)
    ],
    "peak_bytes": 8 << 20,
    "peak_source": "live tensors",
    "activation_bytes": 5 << 20,
    "unrecomputable_activation_bytes": 1 << 20,
    "parameter_bytes": 1 << 20,
    "gradient_bytes": 1 << 20,
    "optimizer_state_bytes": 1 << 20,
    "step_s": 0.1,
}


def _doc(measured: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    request = MemoryPlanRequest(job="j", budget="75%")
    results = [{**row, "status": "ok", "plan": request.plan(m), "artifact": f"/a/{row['pid']}"} for row, m in measured]
    return {"schema": 1, "results": results, "jobs": job_plans(request, measured, []), "notes": []}


def test_agreeing_ranks_get_one_plan_and_a_rank_that_differs_says_how():
    # GIVEN ranks 0 and 1 of job j measured alike (rank 1 slower), rank 2 with 50 % more gradients
    slow, grads = copy.deepcopy(MEASUREMENT), copy.deepcopy(MEASUREMENT)
    slow["step_s"] = 0.3
    grads["gradient_bytes"] = 3 << 19
    doc = _doc(
        [
            ({"pid": 11, "rank": 0, "job": "j"}, MEASUREMENT),
            ({"pid": 12, "rank": 1, "job": "j"}, slow),
            ({"pid": 13, "rank": 2, "job": "j"}, grads),
        ]
    )

    # WHEN rendered
    text = render(doc)

    # THEN ranks 0-1 have one plan, timed by rank 1, with each rank's measured and planned figures
    first, second = text.split("\n\njob j, ")
    assert first.startswith(
        "job j, ranks 0-1 (pids 11, 12): one plan, their measured steps agree (the same blocks, bytes within "
        "5 %); planned from the bytes of rank 0 (the highest peak) and the times of rank 1 (the slowest step) "
        "(rank 2 of the job differs: below)\n"
    ), first
    assert "plan: checkpoint " in first and "\neach rank, measured and with the plan:\n" in first
    table = first.split("each rank, measured and with the plan:\n")[1].splitlines()
    assert table[0].split() == ["rank", "pid", "measured", "peak", "step", "peak", "with", "the", "plan", "recompute"]
    assert table[1].split()[:5] == ["0", "11", "8.0", "MiB", "100.0"]
    assert table[2].split()[:5] == ["1", "12", "8.0", "MiB", "300.0"]
    assert "(each rank's measurement kept in /a/11, /a/12: `dynprof show` it)" in first
    # AND rank 2 has its own plan, saying how it differs from ranks 0-1
    assert second.startswith(
        "rank 2 (pid 13): its own plan; it differs from ranks 0-1: gradients 1.5 MiB against 1.0 MiB (+50 %)\n"
    ), second
    # AND no rank's plan is printed a second time on its own
    assert "rank 0, pid 11:" not in text and "rank 2, pid 13:" not in text


def test_a_single_process_and_a_failed_one_render_as_before():
    # GIVEN one measured process of no job and one that failed
    doc = _doc([({"pid": 5, "rank": None, "job": None}, MEASUREMENT)])
    doc["results"].append({"pid": 6, "rank": 1, "status": "failed", "error": "no agent", "help": "start it"})

    # WHEN rendered
    text = render(doc)

    # THEN the process's plan is under its pid, and the failure in the table with what to do
    assert doc["jobs"] == []
    assert text.startswith("-, pid 5:\nmeasured step on cpu: peak 8.0 MiB")
    assert "(kept in /a/5: `dynprof show` it)" in text
    assert "rank 1  6    failed  no agent" in text and "  what to do: start it" in text
