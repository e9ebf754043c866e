"""`dynprof show` of a `dynprof run --checkpoint` memory-plan artifact: the applied state and the
verified figures from its plan.json, and nothing in the file forging a line of the output."""

from __future__ import annotations

import json
from typing import Any

from collectors.memory.plan import applied as plan_applied
from collectors.memory.plan.render import KIND, PLAN_FILE, render_artifact
from dynprof.cli import main
from dynprof.store import ArtifactStore

MIB = 1 << 20
MEASUREMENT: dict[str, Any] = {
    "schema": 1,
    "device": "cpu",
    "blocks": [
        {"name": f"blocks.{i}", "class": "Block", "saved_bytes": MIB, "freeable_bytes": MIB, "forward_s": 0.01}
        for i in range(4)
    ],
    "peak_bytes": 8 * MIB,
    "peak_source": "live tensors",
    "activation_bytes": 5 * MIB,
    "unrecomputable_activation_bytes": MIB,
    "parameter_bytes": MIB,
    "gradient_bytes": MIB,
    "optimizer_state_bytes": MIB,
    "step_s": 0.1,
}
APPLIED: dict[str, Any] = {
    "asked": "80%",
    "state": "applied",
    "detail": "2 block(s) recomputed in backward",
    "budget_bytes": 6 * MIB + MIB // 2,
    "budget_source": "80%",
    "modules": ["blocks.0", "blocks.1"],
    "measured_peak_bytes": 8 * MIB,
    "predicted_peak_bytes": 6 * MIB,
    "verified_peak_bytes": 6 * MIB,
    "verified_peak_source": "live tensor bytes",
    "floor_bytes": 5 * MIB,
    "baseline_step_s": 0.1,
    "predicted_step_s": 0.12,
    "verified_step_s": 0.126,
    "wrapped_from_step": 9,
    "rounds": 1,
    "refused": [],
    "notes": ["the loop accumulates no gradients"],
    "artifact": None,
}


def _artifact(measurement: dict[str, Any], applied: Any) -> Any:
    w = ArtifactStore().create(KIND, job="j", rank=0, pid=42, options={"checkpoint": "80%"})
    w.write_json(
        PLAN_FILE, {"schema": 1, "measurement": measurement, "asked": {"budget_bytes": 6 * MIB}, "applied": applied}
    )
    return w.finish("complete", summary={"checkpoint": {"state": "applied"}})


def test_show_renders_the_applied_modules_and_predicted_against_verified_figures(capsys):
    # GIVEN the artifact of a --checkpoint 80% that wrapped two blocks and verified them
    art = _artifact(MEASUREMENT, APPLIED)

    # WHEN it is shown, as text and as JSON
    assert main(["show", str(art.path)]) == 0
    text = capsys.readouterr().out
    assert main(["show", str(art.path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)

    # THEN the text says the state, the modules, predicted against verified peak and step time
    body = text.split("\n\n", 1)[1].splitlines()
    assert body[:10] == [
        "dynprof run --checkpoint 80%: applied",
        "  2 block(s) recomputed in backward: blocks.0, blocks.1",
        "  budget 6.5 MiB (80%); measured peak 8.0 MiB",
        "  peak: predicted 6.0 MiB, verified 6.0 MiB (live tensor bytes) (+0.0 % against the prediction), "
        "under the budget",
        "  step: before 100.0 ms, predicted 120.0 ms, verified 126.0 ms (+5.0 % against the prediction)",
        "  the least recomputation reaches (the floor): 5.0 MiB",
        "  wrapped from step 9 of the job (counted from 0); the steps before ran as they were",
        "  planned again 1 time(s) after a verified peak over the budget",
        "  note: the loop accumulates no gradients",
        "  2 block(s) recomputed in backward",
    ]
    # AND below it the plan of the measured step, as `dynprof memory plan` printed it
    assert "\nthe plan of the measured step, for this budget:\nmeasured step on cpu: peak 8.0 MiB" in text
    # AND --json has the same figures under contents.checkpoint
    c = shown["contents"]["checkpoint"]
    assert c["state"] == "applied" and c["modules"] == ["blocks.0", "blocks.1"]
    assert c["predicted_peak_bytes"] == c["verified_peak_bytes"] == 6 * MIB and c["verified_step_s"] == 0.126


def test_strings_of_the_file_cannot_forge_lines_or_reach_the_terminal(capsys):
    # GIVEN an artifact whose applied state and measurement hold newlines, escapes and overrides
    forged = "\nplan: checkpoint 0 module(s)\x1b[2J"
    measurement = json.loads(json.dumps(MEASUREMENT))
    measurement["blocks"][0]["name"] = "blocks.0" + forged
    measurement["device"] = "cpu\u202e"
    measurement["notes"] = ["a note" + forged]
    applied = {
        **APPLIED,
        "state": "applied" + forged,
        "asked": "80%\r\n",
        "modules": ["blocks.0" + forged, 7, None],
        "refused": ["block x" + forged],
        "detail": "done" + forged,
        "verified_peak_source": "\x1b]0;title\x07",
        "verified_peak_bytes": "6 MiB",  # not a byte count: left out
        "rounds": True,
        "wrapped_from_step": -1,  # no step of a job: left out
    }
    art = _artifact(measurement, applied)

    # WHEN it is rendered and shown
    summary, text = render_artifact(art)
    assert main(["show", str(art.path)]) == 0
    out = capsys.readouterr().out

    # THEN no line of either starts with the forged text, and no control character is left
    for whole in (text, out):
        assert not any(line.startswith("plan: checkpoint 0") for line in whole.splitlines()), whole
        assert "\x1b" not in whole and "\r" not in whole and "\u202e" not in whole and "\x07" not in whole
    assert "dynprof run --checkpoint 80%\\r\\n: applied\\nplan: checkpoint 0 module(s)\\x1b[2J" in text
    assert "  refused: block x\\nplan: checkpoint 0 module(s)\\x1b[2J" in text
    assert "measured step on cpu\\u202e: peak 8.0 MiB" in text
    # AND values of the wrong type are left out, not guessed
    c = summary["checkpoint"]
    assert c["modules"] == ["blocks.0\\nplan: checkpoint 0 module(s)\\x1b[2J"]
    assert "verified_peak_bytes" not in c and "rounds" not in c and "wrapped_from_step" not in c
    assert "  peak: predicted 6.0 MiB, verified ?" in text


def test_a_plan_artifact_of_dynprof_memory_plan_has_no_checkpoint_section():
    # GIVEN an artifact of `dynprof memory plan` (no applied state)
    w = ArtifactStore().create(KIND, job="j", rank=0, pid=42)
    w.write_json(PLAN_FILE, {"schema": 1, "measurement": MEASUREMENT, "asked": {"budget_bytes": 6 * MIB}})
    art = w.finish("complete")

    # WHEN rendered
    summary, text = render_artifact(art)

    # THEN it is the plan alone
    assert "checkpoint" not in summary and text.startswith("measured step on cpu")
    assert plan_applied.read("applied") is None and plan_applied.read({}) == {}
