"""The straggler's one sampler (dynprof.watch.straggler.sampler): whatever the source, a sample is
the source's traces, the job's analysis and the rule's verdict; what went wrong is a note, and the
traces are handed back to the source once judged."""

from __future__ import annotations

from typing import Any

from dynprof.watch.straggler import sampler
from dynprof.watch.straggler.sampler import StragglerSampler, sample_stragglers, sampler_for
from dynprof.watch.traces import SampledTraces
from tests.unit.test_watch_straggler_rule import _row


class TraceSource:
    """A source whose trace is given, and that records what it was told once a sample was judged."""

    def __init__(self, got: SampledTraces | Exception) -> None:
        self.got = got
        self.asked: list[tuple[str, int, float]] = []
        self.named: list[bool] = []

    def trace(self, job: str, steps: int, limit_s: float) -> SampledTraces:
        self.asked.append((job, steps, limit_s))
        if isinstance(self.got, Exception):
            raise self.got
        self.got.done = self.named.append
        return self.got


def _analysis(straggler: bool) -> dict[str, Any]:
    rows = [_row(0, "n1", 5.0, 10.0, 35.0), _row(1, "n2", 5.0, 40.0, 5.0)]
    found = {"rank": 1, "host": "n2", "reason": "rank 1: ...", "excess_ms": 30.0, "cause": "input pipeline"}
    return {
        "ranks": rows,
        "common_steps": [9, 10],
        "straggler": found if straggler else None,
        "straggler_check": "straggler: rank 1" if straggler else "no straggler: within the noise",
        "errors": [{"rank": 2, "error": "truncated"}],
    }


def test_a_sample_is_the_sources_traces_judged_by_the_rule(monkeypatch):
    # GIVEN a source whose trace fetched two ranks' traces, one rank missed, and an analysis naming rank 1
    got = SampledTraces(
        at_step=9,
        fetched=[{"path": "/t/0", "node": "a", "id": "0"}, {"path": "/t/1", "node": "b", "id": "1"}],
        label_of={"a": "n1", "b": "n2"},
        notes=["rank 2 on n2: no trace"],
        groups=["g1"],
        evidence={"missed": [{"rank": 2}]},
    )
    analysed = []
    monkeypatch.setattr(
        sampler, "analyse_fetched", lambda fetched, labels: analysed.append(labels) or (_analysis(True), [])
    )
    source = TraceSource(got)
    # WHEN one sample is taken
    report = sample_stragglers(source, "j", steps=2, limit_s=30.0)
    # THEN the source was asked once, the traces analysed with its labels, and the rule named rank 1
    assert source.asked == [("j", 2, 30.0)] and analysed == [{"a": "n1", "b": "n2"}]
    assert report.verdict is not None and report.verdict.culprits[0].rank == 1
    assert report.at_step == 9 and report.groups == ["g1"] and report.steps == 2
    # and the verdict keeps how the traces were taken; the notes follow the rule's line
    assert report.verdict.evidence["samples"]["at_step"] == 9
    assert report.verdict.evidence["samples"]["missed"] == [{"rank": 2}]
    assert report.note == "straggler: rank 1; rank 2 on n2: no trace; rank 2 not analysed: truncated"
    # and the source was told the sample named a straggler
    assert source.named == [True]


def test_a_sample_with_nothing_to_analyse_says_the_sources_note():
    source = TraceSource(SampledTraces(at_step=None, groups=["g"], note="no rank of the job has stepped"))
    report = sample_stragglers(source, "j")
    assert report.verdict is None and report.note == "no rank of the job has stepped"
    assert report.groups == ["g"] and report.at_step is None and report.cost_s >= 0
    assert source.named == [False]


def test_a_trace_that_raises_is_a_note_never_the_watchs_end():
    report = sample_stragglers(TraceSource(RuntimeError("boom")), "j")
    assert report.verdict is None and report.note == "the sampled trace failed: RuntimeError: boom"


def test_the_sampler_samples_through_its_source_and_says_a_failure(monkeypatch):
    # GIVEN the straggler's sampler for a source (its row's factory)
    source = TraceSource(SampledTraces(note="nothing"))
    made = sampler_for(source, 30.0)
    assert isinstance(made, StragglerSampler) and made.source is source and made.every_s == 30.0
    assert made.sample("j").note == "nothing"
    # WHEN the sample itself raises
    monkeypatch.setattr(sampler, "sample_stragglers", lambda *a, **kw: (_ for _ in ()).throw(ValueError("bug")))
    failed = StragglerSampler(source, 30.0, clock=lambda: 7.0).sample("j")
    # THEN it is said as a sample that failed
    assert failed is not None and failed.sampled_at == 7.0 and failed.note == "the sample failed: bug"
