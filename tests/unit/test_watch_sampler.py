"""The watch's list of samplers (dynprof.watch.sampler): a second signal, registered here by its
row and its sampler only, runs on its own schedule beside the straggler's, and its gauges, its
verdict and its reports reach the model, /metrics, the renderers and the printed events with no
change to the engine."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynprof.cli._watching import VerdictPrinter, add_watch_options, every_of, samplers_of
from dynprof.nodes import parse_node
from dynprof.renderers import render, render_html
from dynprof.sidecar.app import create_app
from dynprof.sidecar.progress import ProgressBook
from dynprof.store import ArtifactStore
from dynprof.watch import signals
from dynprof.watch.engine import WatchConfig, WatchEngine
from dynprof.watch.model import Culprit, NodeProgress, Verdict
from dynprof.watch.sampler import Sampler, SignalReport, factory_of, samplers_for
from dynprof.watch.signals import STRAGGLER, RankGauge, Signal
from dynprof.watch.sources import SidecarSource
from dynprof.watch.straggler.rule import StragglerReport
from dynprof.watch.straggler.sampler import StragglerSampler
from tests.support.sources import SteppingSource

TOKEN = "sampler-test-token-0123456789"
SHARES = {("node-1", 0): 0.05, ("node-1", 1): 0.62}


def _source() -> SteppingSource:
    """One node, two ranks that step every poll; each poll moves the clock one second."""
    return SteppingSource("node-1", tick=1.0)


class LoaderReport:
    """A data-loader signal's report: each rank's share of its step spent waiting for a batch."""

    signal = "loader"

    def __init__(self, sampled_at: float, shares: dict[tuple[str, int], float], verdict: Verdict | None) -> None:
        self.sampled_at = sampled_at
        self.shares = shares
        self.verdict = verdict

    def gauges(self) -> dict[str, dict[tuple[str, int], float]]:
        return {"wait_share": self.shares}

    def to_json(self) -> dict[str, Any]:
        return {
            "sampled_at": self.sampled_at,
            "wait_share": [{"host": h, "rank": r, "share": v} for (h, r), v in sorted(self.shares.items())],
            "verdict": self.verdict.to_json() if self.verdict else None,
        }

    def line(self) -> str:
        worst = max(self.shares, key=lambda k: self.shares[k])
        return f"loader sample: rank {worst[1]} on {worst[0]} waits {self.shares[worst]:.0%} of its step for data"


class LoaderSampler:
    """Says a loader stall at its second sample."""

    name = "loader"

    def __init__(self, source: SteppingSource, every_s: float | None) -> None:
        self.source = source
        self.every_s = every_s
        self.calls: list[float] = []

    def sample(self, job: str) -> LoaderReport:
        now = self.source.t
        self.calls.append(now)
        verdict = None
        if len(self.calls) == 2:
            verdict = Verdict(
                kind="loader-stall",
                job=job,
                conclusion="rank 1 on node-1 waits 62 % of its step for its next batch",
                detected_at=now,
                decided_at=now,
                culprits=[Culprit(rank=1, host="node-1", where="DataLoader.__next__", why="62 % of the step")],
                ranks=[
                    {"rank": r, "host": h, "step": int(now), "state": "waits for data", "wait_share": v}
                    for (h, r), v in sorted(SHARES.items())
                ],
            )
        return LoaderReport(now, dict(SHARES), verdict)


BUILT: list[LoaderSampler] = []


def loader_for(source: SteppingSource, every_s: float | None) -> LoaderSampler:
    BUILT.append(LoaderSampler(source, every_s))
    return BUILT[-1]


LOADER = Signal(
    name="loader",
    flag="--loader-every",
    every_s=30.0,
    help="every SEC read each rank's wait for its next batch (0: never)",
    sampler=loader_for,
    verdict_kind="loader-stall",
    label="Data loader stall",
    gauges=(RankGauge("wait_share", "dynprof_watch_loader_wait_share", "Share of the step spent waiting for data."),),
    rank_columns=("wait_share",),
)


@pytest.fixture
def loader(monkeypatch: pytest.MonkeyPatch) -> Signal:
    """The loader signal, registered: one more row in the table."""
    monkeypatch.setattr(signals, "SIGNALS", (*signals.SIGNALS, LOADER))
    BUILT.clear()
    return LOADER


def _scrape(engine: WatchEngine) -> list[tuple[str, dict[str, str], float]]:
    book = ProgressBook("node-1", 2.0, records=lambda: [], read=lambda *a: NodeProgress("node-1", time.time(), 2.0))
    app = create_app(ArtifactStore(), token=TOKEN, progress=book, watch_gauges=engine.gauges)
    answer = app.test_client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    families = text_string_to_metric_families(answer.get_data(as_text=True))
    return [(s.name, s.labels, s.value) for f in families for s in f.samples]


def test_a_second_sampler_runs_on_its_schedule_and_reaches_the_model_metrics_renderers_and_events(
    loader, capsys, monkeypatch
):
    # GIVEN a watch with the straggler's sampler every 3 s and the loader's (built by its row's
    # factory) every 2 s, printing as `dynprof watch --json` prints
    source = _source()
    straggler_calls: list[float] = []

    def straggler(job: str) -> StragglerReport:
        straggler_calls.append(source.t)
        return StragglerReport(sampled_at=source.t, steps=2, scores={("node-1", 1): 0.3}, check="no straggler")

    out = io.StringIO()
    printer = VerdictPrinter(True, None, 5.0, out=out)
    # (the straggler's samples say what a trace would, without one)
    monkeypatch.setattr("dynprof.watch.straggler.sampler.sample_stragglers", lambda source, job, **kw: straggler(job))
    samplers = [StragglerSampler(source, 3.0), *samplers_for(source, {"loader": 2.0}, signals=[loader])]
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=60.0)
    engine = WatchEngine(
        config, source, on_verdict=printer.verdict, clock=lambda: source.t, samplers=samplers, on_sample=printer.sample
    )
    # WHEN ten rounds of one second run (each round's samples done before the next)
    for _ in range(10):
        assert engine.tick().verdict is None
        assert engine.wait_for_sample(timeout=30)

    # THEN each ran on its own schedule
    assert [s.name for s in engine.samplers] == ["straggler", "loader"]
    assert BUILT[0].calls == [1002.0, 1004.0, 1006.0, 1008.0, 1010.0]
    assert straggler_calls == [1003.0, 1006.0, 1009.0]
    # and both signals' gauges are in the model, by name
    gauges = engine.gauges()[0]
    assert gauges.signals["loader"] == {"wait_share": SHARES}
    assert gauges.straggler_scores == {("node-1", 1): 0.3}
    assert gauges.verdicts == {"loader-stall": 1}
    # and on /metrics, the loader's gauge beside the straggler's, and its verdict counted
    scraped = _scrape(engine)
    assert ("dynprof_watch_loader_wait_share", {"job_id": "j", "host": "node-1", "rank": "1"}, 0.62) in scraped
    assert ("dynprof_watch_straggler_score", {"job_id": "j", "host": "node-1", "rank": "1"}, 0.3) in scraped
    assert ("dynprof_watch_verdicts_total", {"job_id": "j", "kind": "loader-stall"}, 1.0) in scraped

    # and every sample was printed as its signal's event, and its verdict as every verdict is
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("loader_sample") == 5 and kinds.count("straggler_sample") == 3 and kinds.count("verdict") == 1
    first = next(e for e in events if e["event"] == "loader_sample")
    assert first["schema"] == "dynprof.watch.event" and first["sample"]["wait_share"][1] == {
        "host": "node-1",
        "rank": 1,
        "share": 0.62,
    }
    said = next(e for e in events if e["event"] == "verdict")
    assert said["verdict"]["kind"] == "loader-stall" and said["artifact"]
    err = capsys.readouterr().err
    assert err.count("dynprof: watch: loader sample: rank 1 on node-1 waits 62% of its step for data") == 5

    # and its verdict artifact is read back, shown as text and on the page with its label and column
    art = ArtifactStore().get(os.path.relpath(said["artifact"], ArtifactStore().root))
    assert Verdict.from_json(json.loads((art.path / "verdict.json").read_text())).kind == "loader-stall"
    summary, text = render(art)
    assert summary is not None and summary["kind"] == "loader-stall"
    assert text.startswith("LOADER-STALL job j: rank 1 on node-1 waits 62 % of its step for its next batch")
    assert "culprit rank 1 on node-1: DataLoader.__next__: 62 % of the step" in text
    page = render_html(art)
    assert "<h2>Data loader stall: job j</h2>" in page
    assert "<th>WAIT_SHARE</th>" in page and "<td>0.62</td>" in page and "<th>SCORE</th>" not in page


def test_the_faces_take_each_signals_option_and_build_its_sampler(loader):
    # GIVEN the watch's options with the loader registered
    parser = argparse.ArgumentParser()
    add_watch_options(parser)
    source = _source()
    # WHEN parsed with its option, and without (and options set to 0)
    chosen = parser.parse_args(["--loader-every", "45"])
    default = parser.parse_args([])
    never = argparse.Namespace(loader_every=0.0, sample_every=0.0)
    # THEN its interval is the option's, its default, or never
    assert every_of(chosen) == {"straggler": 600.0, "loader": 45.0}
    assert every_of(default) == {"straggler": 600.0, "loader": 30.0}
    assert every_of(never) == {"straggler": None, "loader": None}
    # and the faces' sampler list holds every signal's sampler, at those intervals
    samplers = samplers_of(chosen, source)
    assert [(s.name, s.every_s) for s in samplers] == [("straggler", 600.0), ("loader", 45.0)]
    assert samplers[1] is BUILT[-1] and BUILT[-1].source is source


def test_a_sampler_that_raises_is_logged_and_sampled_again_at_its_next_time(caplog):
    # GIVEN a sampler whose first sample raises
    source = _source()

    class Flaky:
        name = "flaky"
        every_s = 2.0

        def __init__(self) -> None:
            self.calls = 0

        def sample(self, job: str) -> LoaderReport:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("boom")
            return LoaderReport(source.t, {("node-1", 0): 0.5}, None)

    flaky = Flaky()
    said: list[Any] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=60.0)
    engine = WatchEngine(config, source, clock=lambda: source.t, samplers=[flaky], on_sample=said.append)
    # WHEN four rounds run
    with caplog.at_level(logging.WARNING, logger="dynprof.watch"):
        for _ in range(4):
            engine.tick()
            assert engine.wait_for_sample(timeout=30)
    # THEN the failure is logged, the watch went on, and the next sample's gauges and report came
    assert "dynprof watch: the flaky sample failed: boom" in caplog.text
    assert flaky.calls == 2 and len(said) == 1
    assert engine.gauges()[0].signals == {"flaky": {"wait_share": {("node-1", 0): 0.5}}}


def test_the_straggler_row_builds_its_sampler_for_the_source():
    # GIVEN the nodes' sidecars, and this node's agents
    sidecars = SidecarSource(object(), [parse_node("127.0.0.1:9")])
    here = _source()
    # WHEN the table's samplers are built for each
    over_sidecars = samplers_for(sidecars, {"straggler": 5.0})
    over_agents = samplers_for(here, {})
    # THEN one straggler sampler each: through the sidecars, or this node's agents, at the interval asked
    assert [(s.name, s.every_s) for s in over_sidecars] == [("straggler", 5.0)]
    assert [(s.name, s.every_s) for s in over_agents] == [("straggler", STRAGGLER.every_s)]
    assert isinstance(over_sidecars[0], StragglerSampler) and isinstance(over_agents[0], StragglerSampler)
    assert over_sidecars[0].source is sidecars and over_agents[0].source is here
    assert factory_of(STRAGGLER).__name__ == "sampler_for"
    # and the straggler's sampler and report are a Sampler and a SignalReport
    report = StragglerReport(sampled_at=1.0, steps=2, scores={("n", 0): 0.0})
    assert isinstance(over_sidecars[0], Sampler) and isinstance(report, SignalReport)
    assert report.signal == "straggler" and report.gauges() == {"score": {("n", 0): 0.0}}
