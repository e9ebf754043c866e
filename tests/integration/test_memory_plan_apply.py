"""`dynprof run --checkpoint` on a real CPU training loop: the plan applied and checked with
the losses bit-identical to a plain run, taken back with `dynprof memory plan --undo`, and
refused in words where it cannot be applied right."""

from __future__ import annotations

import json
import sys

from tests.conftest import ROOT

PROGRAM = "tests/integration/programs/plan_program.py"
# large activations next to the parameters: a budget of 80 % of the peak is reachable
LOOP = [PROGRAM, "--width", "32", "--depth", "4", "--batch", "512", "--report-wrapped"]
ENV = {"PYTHONPATH": str(ROOT)}


def under_checkpoint(budget: str, args: list[str]) -> list[str]:
    """``dynprof run --checkpoint BUDGET -- python ARGS`` as the spawn fixture's arguments."""
    return ["-m", "dynprof", "run", "-q", "--checkpoint", budget, "--", sys.executable, *args]


def _losses(lines: list[str]) -> list[str]:
    return [line.split()[2] for line in lines if line.startswith("LOSS ")]


def _wrapped(lines: list[str]) -> list[int]:
    return [int(line.split()[2]) for line in lines if line.startswith("WRAPPED ")]


def test_checkpoint_applies_the_plan_and_the_losses_are_bit_identical(spawn):
    # GIVEN the same deterministic loop of 30 steps: plain, under dynprof without the flag, and
    # under `dynprof run --checkpoint 80%`
    args = [*LOOP, "--steps", "30", "--losses", "--step-sleep", "0.02", "--max-seconds", "600"]
    plain = spawn(args, under_run=False, env=ENV)
    unasked = spawn(args, env=ENV)
    applied = spawn(under_checkpoint("80%", args), under_run=False, env=ENV)

    # WHEN the three have trained
    for t in (plain, unasked, applied):
        t.wait_for_line("DONE", timeout=600)

    # THEN --checkpoint applied the plan and checked it: its peak under the budget, said on stderr
    (said,) = [line for line in applied.lines if line.startswith("dynprof: checkpoint 80%:")]
    assert ": applied: " in said and "block(s) recomputed in backward (blocks." in said, said
    # AND from a step boundary on, blocks ran the wrapped forward; the job that did not ask, never
    wrapped = _wrapped(applied.lines)
    assert wrapped[:3] == [0, 0, 0] and wrapped[-1] > 0, wrapped
    assert set(_wrapped(unasked.lines)) == {0} and set(_wrapped(plain.lines)) == {0}
    # AND all 30 losses are those of the plain run, bit for bit, in all three
    a, b, c = _losses(plain.lines), _losses(unasked.lines), _losses(applied.lines)
    assert len(a) == 30 and a == b == c


def test_ps_shows_it_and_undo_takes_it_back(spawn, cli):
    # GIVEN a loop under --checkpoint 80% that has applied its plan
    target = spawn(under_checkpoint("80%", [*LOOP, "--max-seconds", "600"]), under_run=False, env=ENV)
    (pid,) = target.ready_pids()
    target.wait_for_line("dynprof: checkpoint 80%: applied", timeout=300)

    # WHEN ps is asked, then the undo
    ps = cli("ps", "--json")
    undo = cli("memory", "plan", "--pid", str(pid), "--undo", "--json", "--timeout", "60")
    after = cli("ps", "--json")

    # THEN ps showed the applied modules, the predicted and the verified peak and step time
    assert ps.returncode == 0, ps.stderr
    (row,) = [r for r in json.loads(ps.stdout)["agents"] if r["pid"] == pid]
    c = row["checkpoint"]
    assert c["state"] == "applied" and c["modules"] and c["asked"] == "80%", c
    assert c["verified_peak_bytes"] <= c["budget_bytes"] and c["predicted_peak_bytes"] <= c["budget_bytes"]
    assert c["verified_step_s"] > 0 and c["predicted_step_s"] > 0
    # AND the undo answered once the job's next boundary took every wrapper back
    assert undo.returncode == 0, undo.stderr + target.state(pid)
    (res,) = json.loads(undo.stdout)["results"]
    assert res["undo"] == "undone" and res["checkpoint"]["state"] == "undone", res
    n = len([line for line in target.lines if line.startswith("WRAPPED ")])
    (line,) = target.wait_for_line("WRAPPED ", count=n + 2)[-1:]
    assert line.endswith(" 0"), line
    (row,) = [r for r in json.loads(after.stdout)["agents"] if r["pid"] == pid]
    assert row["checkpoint"]["state"] == "undone" and row["checkpoint"]["modules"] == []
    # AND the plan is kept as a memory-plan artifact that `dynprof show` renders
    shown = cli("show", c["artifact"]) if c.get("artifact") else None
    assert shown is not None and shown.returncode == 0 and "plan: checkpoint" in shown.stdout, c


def test_undo_of_a_job_that_did_not_ask_and_refusals_in_words(spawn, cli):
    # GIVEN a loop without --checkpoint, and one whose blocks are compiled, under --checkpoint
    plain = spawn([*LOOP, "--max-seconds", "600"], env=ENV)
    compiled = spawn(
        under_checkpoint("80%", [*LOOP, "--compile", "blocks", "--max-seconds", "600"]), under_run=False, env=ENV
    )
    (pid,) = plain.ready_pids()

    # WHEN the first is asked to undo, and the second trains
    undo = cli("memory", "plan", "--pid", str(pid), "--undo", "--timeout", "30")
    (said,) = compiled.wait_for_line("dynprof: checkpoint 80%:", timeout=300)

    # THEN the undo says dynprof changed nothing there
    assert undo.returncode != 0 and "not started with `dynprof run --checkpoint`" in undo.stdout + undo.stderr
    # AND the compiled job is refused, naming torch.compile, with nothing wrapped
    assert ": refused: " in said and "torch.compile" in said, said
    assert set(_wrapped(compiled.lines)) == {0}


def test_checkpoint_bad_budget_is_a_usage_error(cli):
    res = cli("run", "--checkpoint", "lots", "--", sys.executable, "-c", "pass")
    assert res.returncode == 2 and "--checkpoint 'lots'" in res.stderr
