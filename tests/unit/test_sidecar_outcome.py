"""dynprof/sidecar/outcome.py: an action's answer from a kind's answer (strict JSON, bounded,
its messages as the CLI prints them) or from the error it stopped on."""

from __future__ import annotations

import math

from dynprof import errors
from dynprof.result import Result
from dynprof.sidecar import outcome


class KindAnswer:
    """A kind's own answer, not a Result: its codec, its exit code, its lines."""

    exit_code = 1
    messages = ["one\n  two"]

    def to_json(self):
        return {"ratio": math.inf}


def test_a_kinds_answer_is_sent_as_strict_json_with_its_lines():
    got = outcome.outcome_of("stacks", KindAnswer())
    assert got.exit_code == 1 and got.result == {"ratio": None} and got.error is None
    assert got.messages == ["dynprof: one", "  two"]


def test_what_is_no_answer_or_no_json_or_too_large_is_an_internal_error(monkeypatch):
    assert "not an answer" in outcome.outcome_of("ps", {"agents": []}).error["message"]
    looped: dict[str, object] = {}
    looped["self"] = looped
    assert "is not JSON" in outcome.outcome_of("ps", Result(looped, 0)).error["message"]
    monkeypatch.setattr(outcome, "MAX_OUTPUT_BYTES", 10)
    big = outcome.outcome_of("ls", Result({"x": "y" * 20}))
    assert big.exit_code == 1 and big.result is None and "over" in big.error["message"]


def test_an_error_is_answered_structured_with_the_clis_lines():
    exc = errors.NoAgent("no agent of job 'j'", help="attach one")
    answered = outcome.answered_error(exc)
    assert answered.exit_code == 5 and answered.result == {"error": answered.error}
    assert answered.messages == ["dynprof: error: no agent of job 'j'", "  what to do: attach one"]
    gave_none = outcome.failed(exc)
    assert gave_none.result is None and gave_none.error == answered.error
