"""collectors.torch_trace: the trace session around torch.profiler (driven here through a fake
profiler: its pause, its warnings kept out of the job's output, its export), Kineto's log level
(raised and given back), the readers of untrusted trace files (summary, steps, the spans'
check), the text `dynprof show` prints, and a request's trace read back from the store.

What needs torch itself is in the few tests marked so (skipped without it); a real profiler
inside a job is in test_trace_warnings.py and test_trace_kineto_quiet.py, the hostile trace files
in test_untrusted_store.py."""

from __future__ import annotations

import ctypes
import gzip
import io
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from collectors import torch_trace
from collectors.torch_trace import (
    KINETO_QUIET_LEVEL,
    MAX_WARNINGS_KEPT,
    SWITCHES,
    TRACE_FILE,
    TRACE_UNCOMPRESSED_FILE,
    TraceOptions,
    TraceSession,
    TraceSummary,
    check_step_spans,
    iter_trace,
    profiler_steps,
    read_trace,
    render_artifact,
    result_from_store,
    summarize,
    summarize_file,
    target_row,
)
from dynprof.errors import ArtifactError, MissingFile
from dynprof.registry import AgentRecord
from dynprof.store import ArtifactStore
from tests.support.records import agent_record


def x(name: str, ts: float, dur: float, cat: str = "cpu_op", **more: Any) -> dict[str, Any]:
    """A complete event (ph X) of a Chrome trace."""
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 1, "tid": 1, **more}


def step(n: int, ts: float, dur: float, cat: str = "user_annotation") -> dict[str, Any]:
    return x(f"ProfilerStep#{n}", ts, dur, cat)


def opt(ts: float, dur: float) -> dict[str, Any]:
    return x("Optimizer.step#SGD.step", ts, dur, "user_annotation")


# -- options, and the session with a fake profiler ------------------------------------------------
def test_options_are_plain_data():
    assert TraceOptions().to_dict() == {
        "record_shapes": False,
        "with_stack": False,
        "profile_memory": False,
        "with_flops": False,
        "with_modules": False,
        "activities": [],
    }
    o = TraceOptions(record_shapes=True, activities=["cpu"])
    assert o.to_dict()["record_shapes"] is True and o.to_dict()["activities"] == ["cpu"]


def test_options_are_read_from_what_carries_them_by_name():
    switches = dict.fromkeys(SWITCHES, False) | {"record_shapes": True, "profile_memory": True}
    carrier = types.SimpleNamespace(**switches, activities=("cuda",))
    assert TraceOptions.of(carrier) == TraceOptions(record_shapes=True, profile_memory=True, activities=["cuda"])
    assert set(SWITCHES) | {"activities"} == set(TraceOptions().to_dict())


class FakeProfiler:
    """What TraceSession calls of torch.profiler.profile; ``warn`` is what torch warns on stop."""

    def __init__(
        self, warn: list[str] | None = None, trace: bytes = b'{"traceEvents": []}', fail: bool = False
    ) -> None:
        self.warn = warn or []
        self.trace = trace
        self.fail = fail
        self.calls: list[str] = []
        self.exported_to: list[str] = []

    def step(self) -> None:
        self.calls.append("step")

    def stop(self) -> None:
        self.calls.append("stop")
        for message in self.warn:
            warnings.warn(message, UserWarning, stacklevel=1)

    def export_chrome_trace(self, path: str) -> None:
        self.exported_to.append(path)
        Path(path).write_bytes(self.trace[: len(self.trace) // 2] if self.fail else self.trace)
        if self.fail:
            raise OSError(28, "No space left on device")


@pytest.fixture
def no_kineto(monkeypatch):
    """A torch build without Kineto's level (the session leaves Kineto's lines alone)."""
    monkeypatch.setattr(torch_trace, "_KINETO_LEVEL", [None])


def session_with(prof: FakeProfiler) -> TraceSession:
    session = TraceSession(TraceOptions(activities=["cpu"]), {"rank": 0})
    session.prof = prof
    session.first_step = 5
    session.started_at = 100.0
    return session


def test_a_stop_keeps_torch_s_warnings_out_of_the_job_s_output(no_kineto):
    # GIVEN a profiler that warns when stopped
    prof = FakeProfiler(warn=["profiler stopped with a range open", "second"])
    session = session_with(prof)
    # WHEN the session steps and stops, the job's own warnings shown
    with warnings.catch_warnings(record=True) as job_saw:
        warnings.simplefilter("always")
        session.step()
        session.stop()
    # THEN the job saw none of them; the session keeps them for its manifest
    assert job_saw == []
    assert session.warnings == ["UserWarning: profiler stopped with a range open", "UserWarning: second"]
    assert prof.calls == ["step", "stop"]
    assert session.stopped_at > 0 and session.stop_pause_s >= 0


def test_at_most_twenty_warnings_are_kept(no_kineto):
    session = session_with(FakeProfiler(warn=[f"w{i}" for i in range(15)]))
    session.stop()
    session.stop()
    assert len(session.warnings) == MAX_WARNINGS_KEPT == 20
    assert session.warnings[-1] == "UserWarning: w4"


def test_export_writes_the_gzipped_trace_and_the_summary_fields(tmp_path, no_kineto):
    # GIVEN a stopped session whose stop was due 0.25 s before it came
    trace = json.dumps({"traceEvents": [step(5, 0, 10)]}).encode()
    prof = FakeProfiler(warn=["w"], trace=trace)
    session = session_with(prof)
    session.stop()
    session.stopped_at = 102.5
    session.stop_requested_at = 102.25
    session.stop_pause_s = 0.0123456
    # WHEN it is exported to the artifact's trace file
    fields = session.export(tmp_path / TRACE_FILE)
    # THEN torch wrote the plain trace beside it (never in $TMPDIR), compressed and removed
    assert prof.exported_to == [str(tmp_path / TRACE_UNCOMPRESSED_FILE)]
    assert gzip.decompress((tmp_path / TRACE_FILE).read_bytes()) == trace
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACE_FILE]
    # AND the manifest's figures say what the profile was
    export_s = fields.pop("export_s")
    assert isinstance(export_s, float) and export_s >= 0
    assert fields == {
        "trace_file": TRACE_FILE,
        "first_step": 5,
        "profiled_from": 100.0,
        "profiled_until": 102.5,
        "profiled_s": 2.5,
        "training_thread_pause_ms": 12.346,
        "stop_waited_s": 0.25,
        "activities": ["cpu"],
        "trace_bytes": (tmp_path / TRACE_FILE).stat().st_size,
        "torch_warnings": ["UserWarning: w"],
    }


def test_a_stop_that_was_not_waited_for_says_zero(tmp_path, no_kineto):
    session = session_with(FakeProfiler())
    session.stopped_at = 101.0
    assert session.export(tmp_path / TRACE_FILE)["stop_waited_s"] == 0.0
    # a stop that came before it was due (clocks) never says a negative wait
    session.stop_requested_at = 101.5
    assert session.export(tmp_path / TRACE_FILE)["stop_waited_s"] == 0.0


def test_a_trace_file_not_gzipped_is_written_by_torch_itself(tmp_path, no_kineto):
    prof = FakeProfiler(trace=b'{"traceEvents": [1]}')
    session = session_with(prof)
    fields = session.export(tmp_path / "trace.json")
    assert prof.exported_to == [str(tmp_path / "trace.json")]
    assert (tmp_path / "trace.json").read_bytes() == b'{"traceEvents": [1]}'
    assert fields["trace_bytes"] == len(b'{"traceEvents": [1]}')


def test_a_failed_export_leaves_no_uncompressed_trace_behind(tmp_path, no_kineto):
    session = session_with(FakeProfiler(trace=b"x" * 1000, fail=True))
    with pytest.raises(OSError, match="No space left"):
        session.export(tmp_path / TRACE_FILE)
    assert not (tmp_path / TRACE_UNCOMPRESSED_FILE).exists()


# -- Kineto's level: raised while dynprof's profiler starts and stops, then given back -----------
@pytest.fixture
def kineto(monkeypatch) -> ctypes.c_int:
    """Kineto's severity threshold, as a variable the test owns (Kineto's default: 2)."""
    level = ctypes.c_int(2)
    monkeypatch.setattr(torch_trace, "_KINETO_LEVEL", [level])
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    return level


def test_kineto_is_quiet_while_dynprof_s_profiler_starts_and_its_level_is_given_back(kineto):
    with torch_trace._KinetoQuiet():
        assert kineto.value == KINETO_QUIET_LEVEL == 6
    assert kineto.value == 2


def test_a_level_kineto_sets_at_its_first_initialisation_is_the_one_given_back(kineto):
    with torch_trace._KinetoQuiet() as quiet:
        kineto.value = 3  # Kineto initialising inside the profiler's prepare step
        quiet.again()
        assert kineto.value == KINETO_QUIET_LEVEL
    assert kineto.value == 3


def test_again_without_a_change_keeps_the_first_level(kineto):
    with torch_trace._KinetoQuiet() as quiet:
        quiet.again()
    assert kineto.value == 2


def test_a_level_set_meanwhile_stays(kineto):
    with torch_trace._KinetoQuiet():
        kineto.value = 4  # set by someone after the prepare step: not dynprof's to undo
    assert kineto.value == 4


def test_a_quieter_level_than_dynprof_s_is_kept(kineto):
    kineto.value = 9
    with torch_trace._KinetoQuiet():
        assert kineto.value == 9
    assert kineto.value == 9


def test_a_quiet_level_the_job_asked_for_stays(kineto, monkeypatch):
    # GIVEN a job whose KINETO_LOG_LEVEL is dynprof's quiet level, Kineto initialising at it
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")
    with torch_trace._KinetoQuiet() as quiet:
        kineto.value = 6
        quiet.again()
    # THEN the job's level is not undone
    assert kineto.value == 6


def test_without_kineto_s_level_nothing_is_touched(no_kineto):
    with torch_trace._KinetoQuiet() as quiet:
        quiet.again()
        assert quiet.level is None


@pytest.mark.parametrize(
    ("text", "level"),
    [(None, None), ("6", 6), (" 3 ", 3), ("-2", -2), ("+4", 4), ("5abc", 5), ("abc", 0), ("", 0), ("12", 12)],
)
def test_the_job_s_kineto_level_is_read_as_kineto_reads_it(monkeypatch, text, level):
    if text is None:
        monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("KINETO_LOG_LEVEL", text)
    assert torch_trace._env_kineto_level() == level


def test_a_torch_without_kineto_s_symbol_is_looked_at_once(monkeypatch, tmp_path):
    # GIVEN a torch whose library is not there (so no symbol), looked up for the first time
    fake_torch = types.ModuleType("torch")
    fake_torch.__file__ = str(tmp_path / "torch" / "__init__.py")
    monkeypatch.setattr(torch_trace, "_KINETO_LEVEL", [])
    opened: list[str] = []
    real_cdll = ctypes.CDLL

    def cdll(path: str, *args: Any, **kwargs: Any) -> Any:
        opened.append(path)
        return real_cdll(path, *args, **kwargs)

    # (the fake torch is gone again before the suite's own checks of torch after each test)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "torch", fake_torch)
        m.setattr(ctypes, "CDLL", cdll)
        # WHEN asked twice THEN there is none, and the library was looked for once, in torch's lib
        assert torch_trace._kineto_severity() is None
        assert torch_trace._kineto_severity() is None
        assert opened == [str(tmp_path / "torch" / "lib" / "libtorch_cpu.so")]
        # AND such a torch has no torch.distributed running either
        assert torch_trace._dist_initialized() is False


# -- what needs torch ------------------------------------------------------------------------------
def test_activities_are_named_and_an_unknown_one_is_refused():
    pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity

    assert torch_trace.resolve_activities(["cpu", "cuda"]) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with pytest.raises(ValueError, match=r"unknown activity 'tpu'; choose from cpu, cuda"):
        torch_trace.resolve_activities(["tpu"])
    # none named: the CPU, and CUDA only where it is in use
    import torch

    in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert torch_trace.resolve_activities([]) == [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if in_use else [])


def test_a_callback_runs_right_after_the_profiler_s_prepare_step():
    pytest.importorskip("torch")
    from torch.profiler import ProfilerAction

    order: list[str] = []

    class Prof:
        def prepare_trace(self) -> None:
            order.append("prepare")

        def start_trace(self) -> None:
            order.append("start")

    prof = Prof()
    key = (ProfilerAction.NONE, ProfilerAction.RECORD)
    prof.action_map = {key: [prof.prepare_trace, prof.start_trace]}  # type: ignore[attr-defined]
    torch_trace._after_prepare(prof, lambda: order.append("callback"))
    for action in prof.action_map[key]:  # type: ignore[attr-defined]
        action()
    assert order == ["prepare", "callback", "start"]


@pytest.mark.parametrize("layout", ["no-map", "not-a-dict", "no-key", "other-first"])
def test_a_profiler_laid_out_otherwise_is_left_as_it_is(layout):
    pytest.importorskip("torch")
    from torch.profiler import ProfilerAction

    class Prof:
        def prepare_trace(self) -> None:
            pass

        def start_trace(self) -> None:
            pass

    prof = Prof()
    key = (ProfilerAction.NONE, ProfilerAction.RECORD)
    table: Any = {
        "no-map": None,
        "not-a-dict": [prof.prepare_trace],
        "no-key": {(ProfilerAction.NONE, ProfilerAction.WARMUP): [prof.prepare_trace]},
        "other-first": {key: [prof.start_trace, prof.prepare_trace]},
    }[layout]
    if table is not None:
        prof.action_map = table  # type: ignore[attr-defined]
    before = repr(table)
    torch_trace._after_prepare(prof, lambda: None)
    assert repr(getattr(prof, "action_map", None)) == before


# -- reading a trace ---------------------------------------------------------------------------
def write_trace(path: Path, doc: Any, gz: bool = True) -> Path:
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.mark.parametrize("gz", [True, False], ids=["gzip", "plain"])
def test_a_trace_is_read_field_by_field_and_event_by_event(tmp_path, gz):
    doc = {"schemaVersion": 1, "traceEvents": [step(1, 0, 5), {"ph": "M"}], "distributedInfo": {"rank": 3}}
    path = write_trace(tmp_path / "t.json", doc, gz)
    with open(path, "rb") as fh:
        got = list(iter_trace(fh, "t"))
    assert got == [
        ("schemaVersion", 1, False),
        ("traceEvents", step(1, 0, 5), True),
        ("traceEvents", {"ph": "M"}, True),
        ("distributedInfo", {"rank": 3}, False),
    ]
    assert read_trace(path) == doc


@pytest.mark.parametrize(
    ("doc", "events"),
    [({"schemaVersion": 1}, []), ({"traceEvents": []}, []), ({"traceEvents": 5}, 5)],
    ids=["no-events", "empty", "not-a-list"],
)
def test_a_trace_read_whole_always_has_its_events_field(tmp_path, doc, events):
    assert read_trace(write_trace(tmp_path / "t.json.gz", doc))["traceEvents"] == events


def test_a_trace_is_never_read_through_a_link_or_past_its_cap(tmp_path, monkeypatch):
    real = write_trace(tmp_path / "real.json.gz", {"traceEvents": [step(1, 0, 5)] * 100})
    (tmp_path / "link.json.gz").symlink_to(real)
    with pytest.raises(ArtifactError, match="symbolic link"):
        read_trace(tmp_path / "link.json.gz")
    with pytest.raises(MissingFile):
        read_trace(tmp_path / "absent.json.gz")
    monkeypatch.setenv("DYNPROF_MAX_TRACE_BYTES", "1000")
    with pytest.raises(ArtifactError, match="inflates to more than 1000 bytes"):
        read_trace(real)


@pytest.mark.parametrize(
    ("value", "number"),
    [
        (5, 5.0),
        (-2.5, -2.5),
        (True, 0.0),
        ("12", 0.0),
        (None, 0.0),
        (10**400, 0.0),  # too large for a float
        (float("nan"), 0.0),
        (float("inf"), 0.0),
        (1e18, 0.0),  # past what a trace's microseconds hold
        (1e17, 1e17),
    ],
)
def test_a_trace_s_numbers_are_finite_and_bounded(value, number):
    assert torch_trace._number(value) == number


def test_the_summary_tallies_operators_kernels_and_steps():
    trace = {
        "traceEvents": [
            step(2, 2000, 900),
            step(1, 1000, 1000),
            step(1, 1000, 1000, cat="gpu_user_annotation"),  # the GPU timeline's copy: no step
            x("aten::mm", 1100, 300),
            x("aten::mm", 2100, 200, cat="Operator"),
            x("aten::add", 1500, 50),
            x("gemm_kernel", 1200, 400, cat="kernel"),
            x("gemm_kernel", 2200, 100, cat="kernel"),
            x("relu_kernel", 1300, 10, cat="kernel"),
            {"ph": "B", "name": "aten::mm", "ts": 0},  # only complete events count
            "not an event",
            x("python_function", 0, 99999, cat="python_function"),
        ],
        "distributedInfo": {"rank": 0, "world_size": 2},
    }
    got = summarize(trace, top=1)
    assert got == {
        "events": 10,
        "steps": [{"name": "ProfilerStep#1", "dur_ms": 1.0}, {"name": "ProfilerStep#2", "dur_ms": 0.9}],
        "distributed_info": {"rank": 0, "world_size": 2},
        "cpu_ops": [{"name": "aten::mm", "count": 2, "total_us": 500.0}],
        "gpu_kernels": [{"name": "gemm_kernel", "count": 2, "total_us": 500.0}],
        "gpu_kernel_count": 3,
    }
    # the same trace streamed from a file gives the same summary
    data = io.BytesIO(gzip.compress(json.dumps(trace).encode()))
    assert summarize_file(data, "t", top=1) == got
    assert [r["name"] for r in summarize(trace)["cpu_ops"]] == ["aten::mm", "aten::add"]


def test_a_summary_of_events_that_are_not_a_list_is_empty():
    got = summarize({"traceEvents": {"a": 1}})
    assert got["events"] == 0 and got["steps"] == [] and got["distributed_info"] is None


def test_distinct_names_and_steps_are_bounded(monkeypatch):
    monkeypatch.setattr(torch_trace, "_MAX_NAMES", 2)
    monkeypatch.setattr(torch_trace, "_MAX_STEPS", 3)
    acc = TraceSummary()
    for i in range(5):
        acc.add(x(f"op{i}", i, 10))
        acc.add(step(i, i, 10))
    acc.add(x("op0", 9, 10))
    assert dict(acc.cpu_ops) == {"op0": [2, 20.0], "op1": [1, 10.0], "(other names)": [3, 30.0]}
    assert len(acc.steps) == 3


def test_profiler_steps_are_the_training_thread_s_spans_in_time_order():
    trace = {
        "traceEvents": [
            step(2, 20, 10),
            step(1, 10, 10),
            step(1, 10, 10, cat="gpu_user_annotation"),
            {"ph": "i", "name": "ProfilerStep#3", "ts": 30},
            x("ProfilerStepper", 5, 1),  # no '#'
            7,
        ]
    }
    assert [e["name"] for e in profiler_steps(trace)] == ["ProfilerStep#1", "ProfilerStep#2"]
    assert profiler_steps({}) == []


def test_spans_of_one_optimizer_step_each_are_one_each():
    trace = {"traceEvents": [step(1, 0, 100), step(2, 100, 100), opt(80, 10), opt(180, 10)]}
    assert check_step_spans(trace) == {
        "spans": 2,
        "names": ["ProfilerStep#1", "ProfilerStep#2"],
        "per_span": [1, 1],
        "straddling": 0,
        "outside": 0,
        "one_each": True,
    }


def test_an_optimizer_step_across_a_span_s_end_straddles():
    # GIVEN one optimizer step ending after its span's end, one begun before the first span
    trace = {"traceEvents": [step(1, 100, 100), step(2, 200, 100), opt(190, 20), opt(50, 60), opt(290, 5)]}
    got = check_step_spans(trace)
    assert got["per_span"] == [1, 1] and got["straddling"] == 2 and got["outside"] == 0
    assert got["one_each"] is False


def test_an_optimizer_step_that_ends_with_its_span_does_not_straddle():
    got = check_step_spans({"traceEvents": [step(1, 100, 100), opt(190, 10)]})
    assert got["per_span"] == [1] and got["straddling"] == 0 and got["one_each"] is True


def test_optimizer_steps_outside_every_span_are_counted_apart():
    trace = {"traceEvents": [step(1, 100, 100), opt(150, 10), opt(10, 20), opt(500, 10)]}
    got = check_step_spans(trace)
    assert got["per_span"] == [1] and got["outside"] == 2 and got["straddling"] == 0
    assert got["one_each"] is True


@pytest.mark.parametrize(
    "events",
    [
        [],  # no span
        [step(1, 0, 100), step(2, 100, 100)],  # no optimizer step
        [step(1, 0, 100), step(2, 100, 100), opt(10, 5), opt(20, 5), opt(110, 5)],  # 2 then 1
    ],
    ids=["no-spans", "no-optimizer", "uneven"],
)
def test_spans_that_are_not_one_iteration_each_are_not_one_each(events):
    assert check_step_spans({"traceEvents": events})["one_each"] is False


# -- what `dynprof show` prints ------------------------------------------------------------------
def trace_artifact(events: list[Any], summary: dict[str, Any] | None = None, **doc: Any) -> Any:
    writer = ArtifactStore().create("trace", job="j", rank=0)
    writer.write_bytes(TRACE_FILE, gzip.compress(json.dumps({"traceEvents": events, **doc}).encode()))
    return writer.finish("complete", summary=summary)


def test_an_artifact_is_summarised_in_text():
    events = [step(i, i * 1000, 1000 + i) for i in range(1, 11)]
    events += [x("aten::" + "m" * 60, 10, 2500), x("gemm_kernel", 20, 1234.5, cat="kernel")]
    art = trace_artifact(
        events, {"training_thread_pause_ms": 1.5, "export_s": 0.25}, distributedInfo={"rank": 0, "backend": "gloo"}
    )
    summary, text = render_artifact(art)
    assert summary == summarize_file(art.open(TRACE_FILE))
    lines = text.splitlines()
    assert lines[0] == (
        "10 profiler steps: 1 (1.0 ms), 2 (1.0 ms), 3 (1.0 ms), 4 (1.0 ms), 5 (1.0 ms), 6 (1.0 ms), "
        "7 (1.0 ms), 8 (1.0 ms) ..."
    )
    assert lines[1] == (
        "12 events; training thread paused 1.5 ms to stop the profiler; export took 0.25 s off the training thread"
    )
    assert lines[2] == "distributedInfo: {'rank': 0, 'backend': 'gloo'}"
    assert lines[4].startswith("top CPU operators") and lines[4].split()[-3:] == ["calls", "total", "ms"]
    assert lines[5] == f"{'aten::' + 'm' * 42:<48} {1:>7} {2.5:>10.3f}"
    assert lines[7].startswith("top GPU kernels")
    assert lines[8] == f"{'gemm_kernel':<48} {1:>7} {1.2345:>10.3f}"


def test_an_artifact_without_figures_or_operators_says_what_it_has():
    _, text = render_artifact(trace_artifact([step(1, 0, 500)]))
    assert text.splitlines() == [
        "1 profiler steps: 1 (0.5 ms)",
        "1 events; training thread paused ? ms to stop the profiler; export took ? s off the training thread",
    ]


# -- a request's trace, read back from the store ---------------------------------------------------
def record(pid: int = 4242, rank: int | None = 3) -> AgentRecord:
    return agent_record(pid, rank=rank, world_size=4, job_id="j", socket="/nonexistent.sock")


def stored(pid: int, group: str, status: str = "complete", summary: dict[str, Any] | None = None, **extra: Any) -> Any:
    writer = ArtifactStore().create("trace", job="j", rank=0, pid=pid, options={"group_id": group}, extra=extra or None)
    writer.write_bytes(TRACE_FILE, b"")
    return writer.finish(status, summary=summary, error=extra.get("error"))


def test_a_target_row_names_the_process_and_its_start_step():
    assert target_row(record(), 50) == {"pid": 4242, "rank": 3, "job": "j", "start_step": 50}


def test_the_request_s_artifact_of_the_process_is_its_result():
    # GIVEN the trace artifact of this request, and newer ones of another process and of
    # another request of this process
    mine = stored(4242, "g1", summary={"start_step": 51}, created_at="2026-01-01T00:00:00.000Z")
    stored(99, "g1", created_at="2026-06-01T00:00:00.000Z")
    stored(4242, "g0", created_at="2026-06-02T00:00:00.000Z")
    # WHEN the request's result is read back
    got = result_from_store(record(), "g1", 50)
    # THEN it is that artifact, its start step its own
    assert got == {
        "pid": 4242,
        "rank": 3,
        "job": "j",
        "start_step": 51,
        "status": "complete",
        "artifact": str(mine.path),
        "error": None,
    }


def test_the_newest_artifact_of_the_request_is_taken():
    stored(4242, "g1", created_at="2026-01-01T00:00:00.000Z")
    newest = stored(4242, "g1", created_at="2026-01-02T00:00:00.000Z")
    stored(4242, "g1", created_at="2025-12-31T00:00:00.000Z")
    got = result_from_store(record(), "g1", 50)
    assert got is not None and got["artifact"] == str(newest.path)


def test_a_trace_cut_short_says_why():
    stored(4242, "g1", status="partial", summary={"stopped_by": "exit"})
    got = result_from_store(record(), "g1", 50)
    assert got is not None
    assert got["status"] == "partial" and got["start_step"] == 50
    assert got["error"] == "the process exited; stopped by exit"


def test_an_artifact_s_own_error_is_given_first():
    stored(4242, "g1", status="failed", error="export failed: no space left")
    got = result_from_store(record(), "g1", 50)
    assert got is not None and got["error"] == "export failed: no space left"


def test_no_artifact_of_the_request_is_no_result(tmp_path, monkeypatch):
    assert result_from_store(record(), "g1", 50) is None
    stored(4242, "g2")
    assert result_from_store(record(), "g1", 50) is None
    # a store that cannot be read is no result either, never an error
    (tmp_path / "not-a-dir").write_text("x")
    monkeypatch.setenv("DYNPROF_ARTIFACT_DIR", str(tmp_path / "not-a-dir"))
    assert result_from_store(record(), "g2", 50) is None
