"""The watch's live straggler check on real gloo jobs whose ranks are spread over simulated
nodes, each with its own `dynprof serve` (tests/support/nodes.py): one sampled trace
through the job-wide start, fetch and the straggler rule of `analyze`."""

from __future__ import annotations

import json

from dynprof.job.answers import node_labels
from dynprof.job.client import SidecarClient
from dynprof.nodes import parse_node
from dynprof.watch import sources
from dynprof.watch.model import Verdict
from dynprof.watch.sources import SidecarSource
from dynprof.watch.straggler.rule import report_json
from dynprof.watch.straggler.sampler import StragglerSampler, sample_stragglers
from tests.support.nodes import split_job

STRAGGLER = "tests/integration/programs/straggler_program.py"


def _client(nodes_fixture: dict) -> SidecarClient:
    return SidecarClient(nodes_fixture["token"].read_text().strip(), timeout=20.0)


def _source(nodes_fixture: dict, *addresses: str) -> SidecarSource:
    """The nodes' sidecars as the watch reads them: the node objects of the addresses the user named."""
    return SidecarSource(_client(nodes_fixture), [parse_node(a) for a in addresses])


def _names(*addresses: str) -> list[str]:
    """How the watch names these nodes (its labels: the host where it appears once)."""
    parsed = [parse_node(a) for a in addresses]
    labels = node_labels(parsed)
    return [labels[n] for n in parsed]


def test_rank_30_percent_slower_is_named_with_its_node_and_cause(sim_nodes, spawn):
    # GIVEN a 3-rank gloo job, rank 0 on node A and ranks 1 and 2 on node B; rank 2 loads each
    # batch in 130 ms where the others take 100 ms (its work 30 % longer; the times are long
    # enough that two cores shared by three ranks and two sidecars do not drown the difference)
    a, b = sim_nodes["a"], sim_nodes["b"]
    args = ["--slow-ranks", "2", "--load-ms", "130", "--base-load-ms", "100", "--max-seconds", "120"]
    targets = split_job(spawn, STRAGGLER, [a, b, b], "watch-slow", args)
    for t in targets:
        t.ready_pids(timeout=120)

    # WHEN the watch's straggler sampler samples the job through both sidecars
    report = StragglerSampler(_source(sim_nodes, a.address, b.address), None).sample("watch-slow")
    name_a, name_b = _names(a.address, b.address)

    # THEN the verdict names rank 2 on node B, its cause the input pipeline (load_batch)
    assert report is not None
    assert report.verdict is not None, report.note
    v = report.verdict
    assert v.kind == "straggler" and v.job == "watch-slow"
    (culprit,) = v.culprits
    assert (culprit.rank, culprit.host) == (2, name_b), v.conclusion
    assert "load_batch" in culprit.where, culprit
    assert v.evidence["straggler"]["cause"] == "input pipeline"
    assert f"rank 2 on {name_b}" in v.conclusion and "(input pipeline)" in v.conclusion
    # every rank is scored; the straggler above 0, the others 0
    assert set(report.scores) == {(name_a, 0), (name_b, 1), (name_b, 2)}
    assert report.scores[(name_b, 2)] > 0.1, report.scores
    assert report.scores[(name_a, 0)] == 0 and report.scores[(name_b, 1)] == 0
    assert report.steps >= 2 and report.cost_s > 0
    # the verdict is a verdict document (what the watch writes as its artifact)
    again = Verdict.from_json(json.loads(json.dumps(v.to_json())))
    assert again.culprits[0].rank == 2 and again.kind == "straggler"
    assert report_json(report)["verdict"]["culprits"][0]["host"] == name_b


def test_even_job_gets_no_verdict_and_zero_scores(sim_nodes, spawn):
    # GIVEN a 2-rank gloo job over both nodes whose ranks take the same 300 ms per batch (the
    # rule's noise threshold is 10 % of the step: at 100 ms, a rank that a busy 2-core machine
    # kept off the CPU for 26 ms a step was once called a straggler; real steps are longer)
    a, b = sim_nodes["a"], sim_nodes["b"]
    args = ["--load-ms", "300", "--base-load-ms", "300", "--max-seconds", "120"]
    targets = split_job(spawn, STRAGGLER, [a, b], "watch-even", args)
    for t in targets:
        t.ready_pids(timeout=120)

    # WHEN it is sampled for 3 steps
    report = sample_stragglers(_source(sim_nodes, a.address, b.address), "watch-even", steps=3)
    name_a, name_b = _names(a.address, b.address)

    # THEN no verdict, every rank scores 0, and the rule's noise threshold is the note
    assert report.verdict is None, report.verdict and report.verdict.conclusion
    # (the note says why when a sample came back without scores)
    assert report.scores == {(name_a, 0): 0.0, (name_b, 1): 0.0}, report.note
    assert "no straggler" in report.note and "noise threshold" in report.note, report.note

    # AND each node holds that sample's traces, in groups marked as samples
    def sample_traces(sim) -> set[str]:
        return {str(m.parent) for m in sim.artifacts.rglob("manifest.json") if '"sample-' in m.read_text()}

    first = {n: sample_traces(sim_nodes[n]) for n in ("a", "b")}
    assert all(first.values()) and len(report.groups) == 2, (first, report.groups)
    assert all(g.startswith("sample-") for g in report.groups)
    # WHEN a watch that keeps one sample samples again
    keep = sources.KEEP_SAMPLES
    sources.KEEP_SAMPLES = 1
    try:
        again = sample_stragglers(_source(sim_nodes, a.address, b.address), "watch-even", steps=3)
    finally:
        sources.KEEP_SAMPLES = keep
    # THEN each node deleted the first sample's traces before tracing the second's
    assert again.scores, again.note
    for n in ("a", "b"):
        now = sample_traces(sim_nodes[n])
        assert now and not (now & first[n]), (n, first[n], now)


def test_a_job_that_is_not_there_is_a_note_not_an_exception(sim_nodes):
    # GIVEN two sidecars and no job named "watch-none" on them
    a, b = sim_nodes["a"], sim_nodes["b"]

    # WHEN it is sampled
    report = sample_stragglers(_source(sim_nodes, a.address, b.address), "watch-none", limit_s=30)

    # THEN nothing is decided, and the note says why
    assert report.verdict is None and report.scores == {}
    assert "stepped" in report.note, report.note
