"""The watch's table of sampled signals (dynprof.watch.signals): the straggler's row says what the
faces, the verdict's decoder, the page and /metrics read of it; a row added later is read too."""

from __future__ import annotations

import argparse

import pytest

from dynprof.errors import ArtifactError
from dynprof.watch import signals
from dynprof.watch.model import VERDICT_KINDS, Verdict, verdict_kinds
from dynprof.watch.signals import STRAGGLER, RankGauge, Signal, rank_columns, signal_named, signal_of_kind
from dynprof.watch.straggler.sampler import SAMPLE_EVERY_S, sampler_for

LOADER = Signal(
    name="loader",
    flag="--loader-every",
    every_s=30.0,
    help="every SEC read each rank's wait for its next batch",
    sampler=lambda source, every_s: None,
    verdict_kind="loader-stall",
    label="Data loader stall",
    gauges=(RankGauge("wait_share", "dynprof_watch_loader_wait_share", "Share of the step spent waiting."),),
    rank_columns=("wait_share", "score"),
)


def test_the_straggler_row_is_what_the_watch_said_of_it_before_the_table():
    # GIVEN / WHEN the table as dynprof ships it
    # THEN one signal, the straggler: its option, default, event, verdict kind, page and gauge
    assert signals.SIGNALS == (STRAGGLER,)
    assert (STRAGGLER.flag, STRAGGLER.dest, STRAGGLER.every_s) == ("--sample-every", "sample_every", 600.0)
    assert SAMPLE_EVERY_S == STRAGGLER.every_s
    assert STRAGGLER.event == "straggler_sample"
    assert (STRAGGLER.verdict_kind, STRAGGLER.label) == ("straggler", "Straggler")
    assert [(g.name, g.metric) for g in STRAGGLER.gauges] == [("score", "dynprof_watch_straggler_score")]
    assert rank_columns() == ("step_ms", "work_ms", "collective_ms", "score")
    assert STRAGGLER.sampler == "dynprof.watch.straggler.sampler:sampler_for"
    assert sampler_for.__module__ == "dynprof.watch.straggler.sampler"
    # and the verdict kinds keep their order: the looks' findings, the signals', then the rest
    assert VERDICT_KINDS == verdict_kinds() == ("hang", "busy", "straggler", "agent-down", "ok")


def test_a_row_added_after_import_is_read_by_name(monkeypatch):
    # GIVEN a second signal registered after every module was imported
    monkeypatch.setattr(signals, "SIGNALS", (*signals.SIGNALS, LOADER))
    # WHEN it is looked up
    # THEN by name and by verdict kind, its columns after the straggler's (each once)
    assert signal_named("loader") is LOADER and signal_named("nope") is None
    assert signal_of_kind("loader-stall") is LOADER and signal_of_kind("hang") is None
    assert rank_columns() == ("step_ms", "work_ms", "collective_ms", "score", "wait_share")
    assert verdict_kinds() == ("hang", "busy", "straggler", "loader-stall", "agent-down", "ok")
    # and the verdict's decoder takes its kind, which it refused before the row
    doc = Verdict(kind="loader-stall", job="j", conclusion="c", detected_at=1.0, decided_at=2.0).to_json()
    assert Verdict.from_json(doc).kind == "loader-stall"
    monkeypatch.setattr(signals, "SIGNALS", (STRAGGLER,))
    with pytest.raises(ArtifactError, match="unknown kind"):
        Verdict.from_json(doc)


def test_the_option_dest_is_what_argparse_makes_of_the_flag():
    # GIVEN a parser with each signal's flag
    parser = argparse.ArgumentParser()
    for s in (STRAGGLER, LOADER):
        parser.add_argument(s.flag, type=float)
    # WHEN parsed / THEN each value is found at the row's dest
    args = parser.parse_args(["--sample-every", "5", "--loader-every", "7"])
    assert (getattr(args, STRAGGLER.dest), getattr(args, LOADER.dest)) == (5.0, 7.0)
    assert LOADER.event == "loader_sample"
