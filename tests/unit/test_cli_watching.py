"""dynprof.cli._watching: the watch as `dynprof watch` and `dynprof serve --watch` run it. Its
options and the engine's configuration and samplers they make (the straggler's, over this node's
agents or the nodes' sidecars; 0: never), what the printer says of verdicts, samples and rounds
(text, JSON lines, the --on-verdict hook), the sidecars' source as the face builds it, and the
hosted watch's checks and start (with the engine replaced: no thread is left polling)."""

from __future__ import annotations

import argparse
import io
import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dynprof import errors
from dynprof.cli import _watching
from dynprof.nodes import Node, NodeAnswer
from dynprof.watch.engine import Tick, WatchEngine
from dynprof.watch.hook import HookResult
from dynprof.watch.model import Culprit, Verdict
from dynprof.watch.sources import FLIGHT_RECORDER_OFF, FLIGHT_RECORDER_TIMEOUT_S, LocalSource, SidecarSource
from dynprof.watch.stall import Stall
from dynprof.watch.straggler import sampler as straggler_sampler
from dynprof.watch.straggler.rule import StragglerReport
from dynprof.watch.straggler.sampler import StragglerSampler
from tests.support.sources import SteppingSource

ESC = "\x1b[2J"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="w")
    parser.add_argument("--job")
    _watching.add_watch_options(parser)
    return parser.parse_args(list(argv))


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="s")
    _watching.add_serve_watch_args(parser)
    parser.add_argument("--cacert")
    return parser.parse_args(list(argv))


def _verdict(kind: str = "hang", job: str = "j") -> Verdict:
    return Verdict(
        kind=kind,
        job=job,
        conclusion="rank 1 stopped",
        detected_at=1.0,
        decided_at=2.0,
        culprits=[Culprit(rank=1, host="node-b", where="step (t.py:3)", why="stopped (SIGSTOP)")],
    )


# -- options ---------------------------------------------------------------------------------------
def test_the_defaults_make_the_engines_configuration():
    config = _watching.config_of(_parse("--job", "j"))
    assert config.job == "j" and config.interval_s == 5.0 and config.look_interval_s == 3.0
    assert config.stall_after_s is None and config.confirm_s is None
    assert config.healthcheck is True and config.save is True and config.gpu_coredump is False
    # the straggler samples at its default interval (the engine's samplers, not its configuration)
    assert _watching.every_of(_parse("--job", "j")) == {"straggler": straggler_sampler.SAMPLE_EVERY_S}


def test_every_option_reaches_the_configuration():
    args = _parse(
        "--job",
        "j",
        "--interval",
        "2",
        "--stall-after",
        "90",
        "--look-interval",
        "1.5",
        "--confirm-after",
        "40",
        "--sample-every",
        "120",
        "--no-healthcheck",
        "--no-save",
        "--gpu-coredump",
    )
    config = _watching.config_of(args)
    assert (config.interval_s, config.stall_after_s, config.look_interval_s, config.confirm_s) == (2.0, 90.0, 1.5, 40.0)
    assert _watching.every_of(args) == {"straggler": 120.0}
    assert config.healthcheck is False and config.save is False and config.gpu_coredump is True
    assert args.on_verdict_timeout == 30.0 and args.on_verdict is None


def test_a_namespace_without_gpu_coredump_does_not_dump():
    args = _parse("--job", "j", "--gpu-coredump")
    del args.gpu_coredump
    assert _watching.config_of(args).gpu_coredump is False


def test_sample_every_zero_is_never():
    assert _watching.every_of(argparse.Namespace(sample_every=0.0)) == {"straggler": None}
    assert _watching.every_of(argparse.Namespace(sample_every=None)) == {"straggler": straggler_sampler.SAMPLE_EVERY_S}
    assert _watching.every_of(argparse.Namespace()) == {"straggler": straggler_sampler.SAMPLE_EVERY_S}
    assert _watching.every_of(argparse.Namespace(sample_every=30.0)) == {"straggler": 30.0}


def test_sample_every_zero_is_accepted_by_the_parser():
    assert _parse("--job", "j", "--sample-every", "0").sample_every == 0.0
    assert _serve_args("--watch", "--job", "j", "--sample-every", "0").sample_every == 0.0
    assert _watching.every_of(_parse("--job", "j", "--sample-every", "0")) == {"straggler": None}


@pytest.mark.parametrize(("every", "samples"), [("0", 0), ("600", 3)])
def test_a_watch_told_sample_every_0_never_samples(monkeypatch, every, samples):
    # GIVEN the watch's samplers as `dynprof watch --job j --sample-every N` builds them on this node
    sampled: list[str] = []
    monkeypatch.setattr(straggler_sampler, "sample_stragglers", lambda source, job, **kw: sampled.append(job))
    source = SteppingSource("node-x")  # this node with two ranks that step every poll
    samplers = _watching.samplers_of(_parse("--job", "j", "--sample-every", every), source)
    engine = WatchEngine(_watching.config_of(_parse("--job", "j")), source, clock=lambda: source.t, samplers=samplers)
    # WHEN three rounds run, each 700 s after the last (past the interval every time)
    for _ in range(3):
        source.t += 700.0
        assert engine.tick().verdict is None
        assert engine.wait_for_sample(timeout=30)
    # THEN with 0 no sample was taken; with 600 one each round
    assert sampled == ["j"] * samples


@pytest.mark.parametrize("text", ["-1", "604801", "nan", "inf", "soon"])
def test_nonnegative_seconds_refuses_what_is_not_a_time(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _watching.nonnegative_seconds(text)


def test_nonnegative_seconds_takes_a_week_at_most():
    assert _watching.nonnegative_seconds("604800") == 604800.0
    assert _watching.nonnegative_seconds("0.25") == 0.25


@pytest.mark.parametrize(
    "argv",
    [
        ["--interval", "0"],
        ["--interval", "nan"],
        ["--stall-after", "-5"],
        ["--look-interval", "x"],
        ["--on-verdict-timeout", "inf"],
        ["--sample-every", "-1"],
    ],
)
def test_bad_times_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _parse("--job", "j", *argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


# -- the printer -------------------------------------------------------------------------------------
def test_a_verdict_as_text_is_the_rendering_with_its_artifact():
    out = io.StringIO()
    printer = _watching.VerdictPrinter(False, None, 30.0, out=out)
    printer.verdict(_verdict(), "/store/w/1")
    text = out.getvalue()
    assert text.startswith("HANG job j: rank 1 stopped\n")
    assert "culprit rank 1 on node-b: step (t.py:3): stopped (SIGSTOP)" in text
    assert text.endswith("\nartifact /store/w/1\n")
    assert printer.hangs == 1


def test_a_verdict_as_json_is_one_event_line():
    out = io.StringIO()
    printer = _watching.VerdictPrinter(True, None, 30.0, out=out)
    printer.verdict(_verdict(kind="straggler"), None)
    [line] = out.getvalue().splitlines()
    doc = json.loads(line)
    assert doc["schema"] == "dynprof.watch.event" and doc["schema_version"] == 1 and doc["event"] == "verdict"
    assert doc["verdict"]["kind"] == "straggler" and doc["artifact"] is None and doc["hook"] is None
    assert printer.hangs == 0  # only hangs count


def test_the_printer_writes_to_stdout_by_default(capsys):
    _watching.VerdictPrinter(False, None, 30.0).verdict(_verdict(), None)
    assert capsys.readouterr().out.startswith("HANG job j")


def test_the_verdict_text_escapes_what_the_nodes_said():
    text = _watching.render_verdict(_verdict(job=f"j{ESC}\nx"), f"/store/{ESC}")
    assert "\x1b" not in text and "\\x1b[2J" in text
    assert text.splitlines()[0] == "HANG job j\\x1b[2J\\nx: rank 1 stopped"
    assert text.splitlines()[-1] == "artifact /store/\\x1b[2J"


@pytest.fixture
def hooks(monkeypatch):
    calls = []
    answer = {"result": HookResult(True, 0, "ran")}

    def run_hook(command, verdict, path, timeout):
        calls.append((command, verdict.kind, path, timeout))
        return answer["result"]

    monkeypatch.setattr("dynprof.watch.hook.run_hook", run_hook)
    return SimpleNamespace(calls=calls, answer=answer)


def test_the_hook_runs_on_each_verdict_and_its_answer_is_in_the_event(hooks):
    out = io.StringIO()
    printer = _watching.VerdictPrinter(True, "notify.sh", 12.0, out=out)
    printer.verdict(_verdict(), "/store/w/1")
    assert hooks.calls == [("notify.sh", "hang", "/store/w/1", 12.0)]
    assert json.loads(out.getvalue())["hook"] == {"ok": True, "exit_code": 0, "message": "ran"}


def test_an_ok_verdict_without_an_artifact_runs_no_hook(hooks):
    out = io.StringIO()
    printer = _watching.VerdictPrinter(True, "notify.sh", 12.0, out=out)
    printer.verdict(_verdict(kind="ok"), None)
    assert hooks.calls == []
    printer.verdict(_verdict(kind="ok"), "/store/w/2")  # one saved: the hook hears of it
    assert [c[2] for c in hooks.calls] == ["/store/w/2"]


def test_a_failed_hook_is_a_warning_never_fatal(hooks, capsys):
    hooks.answer["result"] = HookResult(False, 3, f"--on-verdict exited 3: {ESC}")
    out = io.StringIO()
    _watching.VerdictPrinter(False, "notify.sh", 12.0, out=out).verdict(_verdict(), None)
    err = capsys.readouterr().err
    assert err == "dynprof: warning: --on-verdict exited 3: \\x1b[2J\n"
    assert out.getvalue().startswith("HANG job j")


def _report(**kw) -> StragglerReport:
    return StragglerReport(sampled_at=5.0, steps=2, **kw)


def test_a_sample_is_a_line_on_stderr_and_with_json_an_event(capsys):
    out = io.StringIO()
    _watching.VerdictPrinter(True, None, 30.0, out=out).sample(_report(at_step=40, check="no straggler: spread 2 %"))
    doc = json.loads(out.getvalue())
    assert doc["event"] == "straggler_sample" and doc["sample"]["at_step"] == 40 and doc["sample"]["steps"] == 2
    assert capsys.readouterr().err == "dynprof: watch: straggler sample at step 40: none (spread 2 %)\n"


def test_a_sample_as_text_is_only_the_line(capsys):
    out = io.StringIO()
    _watching.VerdictPrinter(False, None, 30.0, out=out).sample(_report(note=f"one rank {ESC}"))
    assert out.getvalue() == ""
    assert capsys.readouterr().err == "dynprof: watch: straggler sample: nothing decided (one rank \\x1b[2J)\n"


def _stall(stalled=False, age=12.34, last_step=41, after=60.0) -> Stall:
    return Stall(stalled=stalled, age_s=age, stall_after_s=after, first_step=False, last_step=last_step, ranks=2)


def test_a_round_says_its_state_on_stderr(capsys):
    printer = _watching.VerdictPrinter(False, None, 30.0, out=io.StringIO())
    printer.tick(Tick(ranks=2, nodes_unanswered={}, stall=_stall()))
    printer.tick(Tick(ranks=2, nodes_unanswered={}, stall=_stall(stalled=True, age=None), confirm_in_s=14.6))
    assert capsys.readouterr().err.splitlines() == [
        "dynprof: watch: ok: 2 rank(s), last step 41 12.3 s ago (stall after 60 s)",
        "dynprof: watch: STALLED: 2 rank(s), last step 41 never (stall after 60 s); a hang to be confirmed, "
        "looking again in 15 s",
    ]


def test_nodes_that_did_not_answer_are_named_sorted_and_escaped(capsys):
    printer = _watching.VerdictPrinter(False, None, 30.0, out=io.StringIO())
    printer.tick(Tick(ranks=1, nodes_unanswered={"z:1": "refused", f"a{ESC}": "timed out"}, stall=None))
    assert capsys.readouterr().err.splitlines() == ["dynprof: node a\\x1b[2J: timed out", "dynprof: node z:1: refused"]


def test_waiting_for_ranks_is_said_once(capsys):
    printer = _watching.VerdictPrinter(False, None, 30.0, out=io.StringIO())
    for _ in range(3):
        printer.tick(Tick(ranks=0, nodes_unanswered={}, stall=None, note="no rank of job j"))
    assert capsys.readouterr().err == "dynprof: watch: no rank of job j yet (waiting for ranks with an agent)\n"


def test_an_ended_round_says_why_and_nothing_else(capsys):
    printer = _watching.VerdictPrinter(False, None, 30.0, out=io.StringIO())
    printer.tick(Tick(ranks=2, nodes_unanswered={}, stall=_stall(), ended=True, note="every rank exited"))
    assert capsys.readouterr().err == "dynprof: watch: every rank exited; stopping\n"


def test_the_printer_keeps_the_last_two_rounds():
    printer = _watching.VerdictPrinter(False, None, 30.0, out=io.StringIO())
    ticks = [Tick(ranks=1, nodes_unanswered={}, stall=None) for _ in range(4)]
    for tick in ticks:
        printer.tick(tick)
    assert printer.ticks == ticks[-2:]


# -- the sidecars' source ----------------------------------------------------------------------------
@pytest.fixture
def node_args(tmp_path):
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    return argparse.Namespace(token_file=str(token), cacert=None, node_timeout=10.0, max_in_flight=8)


def test_the_node_source_shares_the_clients_total_among_the_polls(node_args):
    nodes = [Node("a", 8787), Node("b", 8787), Node("c", 8787)]
    source = _watching.node_source(node_args, nodes)
    assert isinstance(source, SidecarSource)
    assert source.client.shared_by == 3 and source.client.answers_per_node == 2 and source.node_list == nodes
    assert source.client.token == "t" * 32 and source.client.timeout == 10.0


def test_the_node_source_needs_the_sidecars_token(node_args, monkeypatch):
    monkeypatch.delenv("DYNPROF_TOKEN_FILE", raising=False)
    node_args.token_file = None
    with pytest.raises(errors.UsageError):
        _watching.node_source(node_args, [Node("a", 8787)])


@pytest.mark.parametrize(
    ("got", "expected"),
    [
        (SimpleNamespace(recorder_off=True, analysis=None, answers=[]), (None, FLIGHT_RECORDER_OFF)),
        (SimpleNamespace(recorder_off=False, analysis=[{"pg": 0}], answers=[]), ([{"pg": 0}], None)),
        (
            SimpleNamespace(recorder_off=False, analysis=None, answers=[]),
            (None, "no flight recorder dump (is it on?)"),
        ),
        (
            SimpleNamespace(
                recorder_off=False,
                analysis=None,
                answers=[NodeAnswer(Node("a", 8787), False, error=f"refused {ESC}")],
            ),
            (None, "node a:8787: refused \\x1b[2J"),
        ),
    ],
)
def test_the_node_sources_flight_recorder_is_nccls_job_wide_read(node_args, monkeypatch, got, expected):
    asked = []

    def collect_nodes(client, nodes, request, skip=None):
        asked.append((client, nodes, request, skip))
        return got

    monkeypatch.setattr(_watching, "collect_nodes", collect_nodes)
    nodes = [Node("a", 8787)]
    source = _watching.node_source(node_args, nodes)
    assert source._flight_recorder("j", {nodes[0]: (7,)}) == expected
    [(client, asked_nodes, request, skip)] = asked
    assert skip == {nodes[0]: (7,)}  # the processes to leave out go to the nodes as they are
    # a client of its own, not the polls' shared one
    assert client is not source.client and client.answers_per_node != source.client.answers_per_node
    assert asked_nodes == nodes and request.job == "j" and request.timeout == FLIGHT_RECORDER_TIMEOUT_S


# -- serve --watch ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--job", "j"], "--job goes with --watch"),
        (["--watch"], "--watch needs --job JOB"),
        (["--watch", "--job", "j" * 201], "--job takes at most 200 characters"),
    ],
)
def test_the_hosted_watchs_options_are_checked(argv, said):
    with pytest.raises(errors.UsageError) as info:
        _watching.check_hosted_watch(_serve_args(*argv))
    assert info.value.message == said


def test_options_that_make_sense_pass_the_check():
    _watching.check_hosted_watch(_serve_args())
    _watching.check_hosted_watch(_serve_args("--watch", "--job", "j" * 200))
    _watching.check_hosted_watch(argparse.Namespace())  # a serve without the watch's options at all


def test_no_watch_starts_nothing():
    assert _watching.start_hosted_watch(_serve_args(), "t" * 32) is None


class FakeEngine:
    made: list[FakeEngine] = []

    def __init__(self, config, source, on_verdict, samplers, on_sample) -> None:
        self.config, self.source, self.on_verdict, self.samplers, self.on_sample = (
            config,
            source,
            on_verdict,
            samplers,
            on_sample,
        )
        self.runs = 0
        self.done = threading.Event()
        FakeEngine.made.append(self)

    def run(self) -> None:
        self.runs += 1
        if self.runs == 1:
            raise RuntimeError(f"bug {ESC}")  # a bug in a round
        self.done.set()


@pytest.fixture
def fake_engine(monkeypatch):
    FakeEngine.made = []
    monkeypatch.setattr("dynprof.watch.engine.WatchEngine", FakeEngine)
    return FakeEngine


def _wait(event: threading.Event) -> None:
    deadline = time.monotonic() + 30
    while not event.is_set() and time.monotonic() < deadline:
        event.wait(0.05)
    assert event.is_set(), "the watch thread did not run again"


def test_the_hosted_watch_on_this_node_runs_on_and_survives_a_failed_round(fake_engine, capsys):
    args = _serve_args("--watch", "--job", f"j{ESC}", "--interval", "0.01", "--on-verdict", "n.sh")
    engine = _watching.start_hosted_watch(args, "t" * 32)
    assert engine is fake_engine.made[0]
    _wait(engine.done)
    assert engine.runs == 2
    assert isinstance(engine.source, LocalSource)
    assert engine.config.job == f"j{ESC}" and engine.config.interval_s == 0.01
    # the straggler's sample over this node's agents, at its default interval
    [sampler] = engine.samplers
    assert isinstance(sampler, StragglerSampler) and sampler.every_s == straggler_sampler.SAMPLE_EVERY_S
    assert sampler.source is engine.source
    printer = engine.on_verdict.__self__
    assert printer.as_json is False and printer.hook == "n.sh" and printer.out is sys.stderr
    err = capsys.readouterr().err
    assert "dynprof: watching job j\\x1b[2J" in err
    assert "dynprof: watch: a round failed: RuntimeError: bug \\x1b[2J" in err


def test_the_hosted_watch_over_nodes_reads_their_sidecars_with_this_token(fake_engine, capsys):
    token = "s" * 32
    engine = _watching.start_hosted_watch(
        _serve_args("--watch", "--job", "j", "--hosts", "node-a,node-b:9000", "--interval", "0.01"), token
    )
    _wait(engine.done)
    source = engine.source
    assert isinstance(source, SidecarSource)
    assert [str(n) for n in source.node_list] == ["node-a:8787", "node-b:9000"]
    assert source.client.shared_by == 2 and source.client.answers_per_node == 2
    assert source.client.token == token and source.client.tls is None
    # the straggler's sample over the same sidecars, and the samples printed by the verdicts' printer
    [sampler] = engine.samplers
    assert isinstance(sampler, StragglerSampler) and sampler.every_s == straggler_sampler.SAMPLE_EVERY_S
    assert sampler.source is source
    assert engine.on_sample == engine.on_verdict.__self__.sample


def test_the_hosted_watch_told_sample_every_0_never_samples(fake_engine):
    engine = _watching.start_hosted_watch(
        _serve_args("--watch", "--job", "j", "--interval", "0.01", "--sample-every", "0"), "t" * 32
    )
    _wait(engine.done)
    assert [(s.name, s.every_s) for s in engine.samplers] == [("straggler", None)]


def test_the_hosted_watch_checks_its_options_before_starting(fake_engine):
    with pytest.raises(errors.UsageError):
        _watching.start_hosted_watch(_serve_args("--watch"), "t" * 32)
    assert fake_engine.made == []
