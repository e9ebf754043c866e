"""The CLI on bad input: numbers, replies and files that are wrong on purpose."""

from __future__ import annotations

import json
import os
import re

import pytest

from dynprof.cli import main
from tests.support.records import agent_record


@pytest.mark.parametrize("pid", ["2147483648", "9" * 200, "0", "-1", "4194305"])
def test_attach_refuses_an_out_of_range_pid_as_a_usage_error(capsys, pid):
    # GIVEN a pid no kernel hands out
    # WHEN attach is asked for it
    with pytest.raises(SystemExit) as exit_info:
        main(["attach", pid])

    # THEN it is a usage error (exit 2) naming the pid, with no traceback
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "not a valid pid" in err and "Traceback" not in err


@pytest.mark.parametrize("option", ["--wait", "--ready-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1e400"])
def test_attach_refuses_non_finite_waits(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["attach", "1", option, value])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--top", "1" * 100], ["--workers", "-3"], ["--workers", "10000000"]])
def test_analyze_refuses_absurd_counts(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", *args])
    assert exit_info.value.code == 2
    assert args[0] in capsys.readouterr().err


# -- an agent that answers with the wrong reply type ---------------------------------------------
class FakeAgent:
    """A registered 'agent' for a real sleeping process whose socket answers every request
    with ``reply`` (a Reply field name, whatever the command calls for), or with what
    ``answer(request, reply)`` fills in."""

    def __init__(self, run_dir, reply: str = "pong", answer=None) -> None:
        import socket
        import subprocess
        import sys
        import threading

        from dynprof.registry import process_start_ticks, socket_path, write_record

        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.pid = self.child.pid
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        path = str(socket_path(self.pid, run_dir / "agents"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.reply = reply
        self.answer = answer
        self.stopped = False
        write_record(
            agent_record(self.pid, ppid=os.getpid(), start_ticks=process_start_ticks(self.pid), socket=path),
            run_dir / "agents",
        )
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from dynprof.proto import pb, recv_frame, send_frame

        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                try:
                    req = pb.Request()
                    req.ParseFromString(recv_frame(conn))
                    reply = pb.Reply(protocol_version=req.protocol_version, request_id=req.request_id)
                    if self.answer is not None:
                        self.answer(req, reply)
                    else:
                        getattr(reply, self.reply).SetInParent()
                    send_frame(conn, reply.SerializeToString())
                except Exception:
                    pass

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        self.child.kill()
        self.child.wait()


@pytest.fixture
def wrong_reply_agent(dynprof_dirs):
    agents = []

    def make(reply: str = "pong", answer=None) -> FakeAgent:
        agent = FakeAgent(dynprof_dirs["run"], reply, answer)
        agents.append(agent)
        return agent

    yield make
    for agent in agents:
        agent.close()


def test_stacks_from_an_agent_answering_another_reply_type_is_a_protocol_error(capsys, wrong_reply_agent):
    # GIVEN an agent that answers a stack dump with a Pong
    agent = wrong_reply_agent("pong")

    # WHEN its stacks are asked for through the agent
    code = main(["stacks", "--pid", str(agent.pid), "--method", "agent", "--no-save"])

    # THEN a clean agent error says the reply was of the wrong kind; no traceback
    err = capsys.readouterr().err
    assert code == 8, err
    assert "answered pong to dump_stacks" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["ps"],
        ["start", "--steps", "2"],
        ["stop"],
        ["memory"],
        ["memory", "--history-stop"],
    ],
)
def test_every_command_refuses_a_reply_of_the_wrong_type(capsys, wrong_reply_agent, argv):
    # GIVEN an agent that answers everything with an Ack (or, to a status, with a Pong)
    agent = wrong_reply_agent("ack" if argv != ["memory", "--history-stop"] else "pong")

    # WHEN a command talks to it
    code = main([*argv, "--pid", str(agent.pid)] if argv != ["ps"] else ["ps", "--json"])

    # THEN no command takes the wrong reply for an answer
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "answered ack" in captured.out + captured.err or "answered pong" in captured.out + captured.err
    if argv != ["ps"]:
        assert code != 0


def test_client_checks_the_reply_type_of_every_command(wrong_reply_agent):
    from dynprof import errors
    from dynprof.client import AgentClient, expected_reply
    from dynprof.proto import pb

    agent = wrong_reply_agent("job_nodes")
    client = AgentClient.for_pid(agent.pid, timeout=3)
    for name in pb.Request.DESCRIPTOR.oneofs_by_name["command"].fields:
        assert expected_reply(name.name) != "job_nodes" or name.name == "discover_nodes"
        if name.name == "discover_nodes":
            continue
        message = getattr(pb, name.message_type.name)()
        with pytest.raises(errors.AgentError, match="answered job_nodes"):
            client.request(**{name.name: message})


def test_stacks_from_an_agent_that_writes_no_file_is_a_clean_error(capsys, wrong_reply_agent):
    # GIVEN an agent that says it wrote the stack dump but wrote nothing
    agent = wrong_reply_agent("artifact")

    # WHEN its stacks are asked for through the agent
    code = main(["stacks", "--pid", str(agent.pid), "--method", "agent", "--no-save"])

    # THEN a clean agent error, no traceback
    err = capsys.readouterr().err
    assert code == 8, err
    assert "unreadable stack dump" in err and "Traceback" not in err


# -- untrusted text on the terminal ------------------------------------------------------------
EVIL = "\x1b[2J\x1b]0;owned\x07\u202eevil\x9b\x7f"


def _assert_escaped(text: str) -> None:
    for raw in ("\x1b", "\x07", "\u202e", "\x9b", "\x7f"):
        assert raw not in text, repr(text)


def test_start_progress_escapes_the_agent_s_state(capsys, wrong_reply_agent):
    # GIVEN an agent whose trace state is a terminal escape sequence
    def answer(req, reply):
        which = req.WhichOneof("command")
        if which == "status":
            reply.status.step = 5
            reply.status.trace.state = EVIL
        elif which == "start_trace":
            reply.trace_started.trace.state = "armed"
        elif which == "stop_trace":
            reply.trace_stopped.SetInParent()

    agent = wrong_reply_agent(answer=answer)

    # WHEN a trace is started and its progress shown
    code = main(["start", "--pid", str(agent.pid), "--steps", "2", "--timeout", "0.3"])

    # THEN the state is shown escaped, never raw
    err = capsys.readouterr().err
    assert code == 9, err
    assert "\\x1b[2J" in err
    _assert_escaped(err)


def test_stop_escapes_the_agent_s_error_text(capsys, wrong_reply_agent):
    # GIVEN an agent whose finished trace reports an error full of escapes
    def answer(req, reply):
        which = req.WhichOneof("command")
        if which == "stop_trace":
            reply.trace_stopped.trace.group_id = "g"
        elif which == "status":
            reply.status.trace.state = "idle"
            reply.status.trace.group_id = "g"
            reply.status.trace.last_artifact_status = "failed"
            reply.status.trace.last_error = EVIL

    agent = wrong_reply_agent(answer=answer)

    # WHEN the trace is stopped
    code = main(["stop", "--pid", str(agent.pid)])

    # THEN the error is printed escaped
    out = capsys.readouterr().out
    assert code == 1
    assert "evil" in out
    _assert_escaped(out)


def test_memory_report_escapes_frame_names_of_the_snapshot(tmp_path, capsys):
    # GIVEN a snapshot whose allocation frames carry terminal escapes in their names
    import pickle

    frame = {"filename": f"/home/u/{EVIL}.py", "line": 3, "name": f"fwd{EVIL}"}
    snapshot = {
        "segments": [
            {
                "device": 0,
                "address": 0x7F0000000000,
                "total_size": 4 << 20,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": 0x7F0000000000,
                        "size": 2 << 20,
                        "requested_size": 2 << 20,
                        "state": "active_allocated",
                        "frames": [frame],
                    },
                    {
                        "address": 0x7F0000200000,
                        "size": 2 << 20,
                        "requested_size": 0,
                        "state": "inactive",
                        "frames": [],
                    },
                ],
            }
        ],
        "device_traces": [[{"action": "alloc", "addr": 0x7F0000000000, "size": 2 << 20, "frames": [frame]}]],
    }
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))

    # WHEN its report is printed
    code = main(["memory-report", str(path), "--no-html"])

    # THEN the names are shown, escaped
    out = capsys.readouterr().out
    assert code == 0
    assert "fwd\\x1b[2J" in out
    _assert_escaped(out)


# -- "cannot summarise": what is wrong with the file, not Python's exception text ----------------
@pytest.mark.parametrize(
    "kind,name,data,raw",
    [
        ("memory", "snapshot.pickle", {"segments": [1, 2], "device_traces": []}, "'int' object"),
        (
            "memory",
            "snapshot.pickle",
            {"segments": [{"blocks": [], "total_size": "big"}], "device_traces": []},
            "base 10",
        ),
        ("memory", "summary.json", b'{"devices": 5}', "not iterable"),
    ],
)
def test_show_names_what_is_wrong_with_a_damaged_artifact(capsys, kind, name, data, raw):
    import pickle

    from dynprof.store import ArtifactStore

    # GIVEN an artifact whose file holds values of the wrong types
    writer = ArtifactStore().create(kind, job="j")
    writer.write_bytes(name, data if isinstance(data, bytes) else pickle.dumps(data, protocol=4))
    art = writer.finish("complete")

    # WHEN it is shown, as text and as JSON
    assert main(["show", str(art.path)]) == 0
    out = capsys.readouterr().out
    assert main(["show", str(art.path), "--json"]) == 0
    contents = json.loads(capsys.readouterr().out)["contents"]

    # THEN the manifest still shows and the message names the file and what to do, not Python's text
    assert "cannot summarise" in out and name in out and "--verify" in out
    assert raw not in out and "Error" not in out
    assert raw not in contents["error"] and name in contents["error"]


def test_memory_report_names_what_is_wrong_with_a_damaged_snapshot(tmp_path, capsys):
    import pickle

    # GIVEN a snapshot pickle whose segments are numbers
    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps({"segments": [1, 2], "device_traces": []}, protocol=4))

    # WHEN its report is asked for
    code = main(["memory-report", str(path), "--no-html"])

    # THEN a clean error names the file and what is wrong, without Python's exception text
    err = capsys.readouterr().err
    assert code == 1
    assert "odd.pickle" in err and "segments" in err
    assert "'int' object" not in err and "AttributeError" not in err


# -- crafted traces: non-finite and absurd numbers ---------------------------------------------
def _crafted_trace(store_root, bad_ts: float, bad_dur: float, name: str = "aten::evil"):
    import gzip

    from dynprof.store import ArtifactStore

    events = []
    for k in range(3):
        t = 1_000_000.0 + k * 10_000
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{k}",
                "pid": 1,
                "tid": 1,
                "ts": t,
                "dur": 10_000,
            }
        )
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + 100, "dur": 800})
    events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": bad_ts, "dur": bad_dur})
    events.append(
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#9",
            "pid": 1,
            "tid": 1,
            "ts": bad_ts,
            "dur": bad_dur,
        }
    )
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": events}
    writer = ArtifactStore().create("trace", job="crafted", rank=0, options={"group_id": "g1"})
    writer.write_bytes("trace.json.gz", gzip.compress(json.dumps(doc).encode()))  # json writes NaN/Infinity
    return writer.finish("complete")


@pytest.mark.parametrize(
    "ts,dur",
    [
        (float("inf"), 1.0),
        (float("nan"), 1.0),
        (1_000_050.0, float("inf")),
        (1_000_050.0, float("nan")),
        (1e300, 1e300),
        (-1e300, 5.0),
        (1_000_050.0, 1e200),
    ],
)
def test_analyze_skips_non_finite_and_absurd_timestamps(capsys, ts, dur):
    # GIVEN a trace whose last events carry NaN, infinite or absurd times
    art = _crafted_trace(None, ts, dur)

    # WHEN it is analysed, as JSON and as a table
    assert main(["analyze", str(art.path), "--no-save", "--json"]) == 0
    text = capsys.readouterr().out
    assert main(["analyze", str(art.path), "--no-save"]) == 0
    table = capsys.readouterr().out

    # THEN the JSON is strict (no NaN/Infinity), the bad events are left out, numbers stay short
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert data["common_steps"] == [0, 1, 2]
    assert all(row["name"] != "aten::evil" for row in data["top_ops"])
    assert re.search(r"\d{16}", table) is None, table


def test_print_json_is_strict_json(capsys):
    from dynprof.cli._common import print_json

    # GIVEN values JSON cannot carry
    print_json({"a": float("nan"), "b": [float("inf"), -float("inf")], "c": 1.5})

    # THEN they come out as null: valid JSON for any reader
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(c)) == {"a": None, "b": [None, None], "c": 1.5}


def test_analyze_escapes_operator_names_from_the_trace(capsys):
    # GIVEN a trace whose operator name holds terminal escapes
    art = _crafted_trace(None, 1_000_050.0, 30.0, name=f"aten::{EVIL}")

    # WHEN its analysis is printed
    assert main(["analyze", str(art.path), "--no-save"]) == 0

    # THEN the name is shown escaped
    out = capsys.readouterr().out
    assert "aten::\\x1b[2J" in out
    _assert_escaped(out)


def test_show_of_a_trace_with_absurd_times_prints_short_numbers(capsys):
    # GIVEN a trace whose last step lasts 1e300 microseconds
    art = _crafted_trace(None, 1e300, 1e300)

    # WHEN it is shown
    assert main(["show", str(art.path)]) == 0

    # THEN no number runs to hundreds of digits
    out = capsys.readouterr().out
    assert "profiler steps" in out
    assert re.search(r"\d{16}", out) is None, out


# -- attach: ready means answering ---------------------------------------------------------------
def test_attach_readiness_is_a_status_round_trip_with_the_reason_from_the_log(tmp_path):
    import socket

    from dynprof import errors
    from dynprof.attach import confirm_ready

    # GIVEN an agent that bound and reported its socket, but whose server died (nobody answers)
    path = str(tmp_path / "a.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    log = tmp_path / "a.log"
    log.write_text(
        "2026-01-01 00:00:00,000 7 MainThread INFO agent started (attach)\n"
        "2026-01-01 00:00:00,100 7 dynprof-agent ERROR the agent's server thread failed; the job continues\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\n'
        "ModuleNotFoundError: No module named 'google'\n"
    )
    try:
        # WHEN attach confirms that it is ready
        with pytest.raises(errors.AgentError) as info:
            confirm_ready(7, {"socket": path, "log": str(log)}, timeout=0.5)
    finally:
        listener.close()

    # THEN it is not: the error says so and gives the reason the agent logged
    message = info.value.message
    assert "does not answer" in message
    assert "server thread failed" in message and "No module named 'google'" in message
    assert str(log) in (info.value.help or "")


# -- found by crafting files: values of the wrong type deep inside ---------------------------------
def _trace_artifact(events):
    import gzip

    from dynprof.store import ArtifactStore

    writer = ArtifactStore().create("trace", job="crafted", rank=0, options={"group_id": "g2"})
    writer.write_bytes("trace.json.gz", gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return writer.finish("complete")


@pytest.mark.parametrize(
    "odd",
    [
        {"ts": 10**400, "dur": 10**400},  # json reads a 400-digit integer; float() overflows
        {"pid": [1], "tid": {"a": 1}},  # unhashable ids
    ],
)
def test_analyze_skips_events_with_odd_values(capsys, odd):
    # GIVEN a trace with good steps and one event whose values are of the wrong kind
    steps = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": f"ProfilerStep#{k}",
            "pid": 1,
            "tid": 1,
            "ts": 1000.0 + 100 * k,
            "dur": 100.0,
        }
        for k in range(2)
    ]
    odd_event = {"ph": "X", "cat": "cpu_op", "name": "aten::odd", "pid": 1, "tid": 1, "ts": 1010.0, "dur": 5.0, **odd}
    art = _trace_artifact([*steps, odd_event])

    # WHEN it is analysed
    code = main(["analyze", str(art.path), "--no-save", "--json"])

    # THEN the analysis holds the good steps; no traceback
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["common_steps"] == [0, 1]


@pytest.mark.parametrize(
    "snapshot",
    [
        {
            "segments": [
                {
                    "device": 0,
                    "address": 0,
                    "total_size": 10**400,
                    "blocks": [{"size": 10**400, "state": "active_allocated", "address": 0, "frames": []}],
                }
            ],
            "device_traces": [],
        },
        {"segments": [], "device_traces": [[{"action": 5, "size": "x", "addr": None, "frames": 3}]]},
    ],
)
def test_memory_report_of_a_snapshot_with_odd_values_is_a_clean_error(tmp_path, capsys, snapshot):
    import pickle

    path = tmp_path / "odd.pickle"
    path.write_bytes(pickle.dumps(snapshot, protocol=4))

    code = main(["memory-report", str(path), "--no-html"])

    err = capsys.readouterr().err
    assert code in (0, 1)
    assert "Traceback" not in err
    if code:
        assert "odd.pickle is not a well-formed PyTorch memory snapshot" in err


def test_attach_escapes_what_the_target_reported(capsys, monkeypatch):
    from dynprof.attach import AttachResult
    from dynprof.cli import attach as attach_cli

    # GIVEN a target whose bootstrap reported a log path full of terminal escapes
    def fake_attach(pid, options):
        return AttachResult(pid=pid, status="attached", method="gdb-pending-call", log=f"/tmp/{EVIL}.log")

    monkeypatch.setattr(attach_cli, "attach", fake_attach)

    # WHEN attach reports it
    assert main(["attach", str(os.getpid())]) == 0

    # THEN the path is shown escaped
    err = capsys.readouterr().err
    assert "agent ready" in err and "\\x1b[2J" in err
    _assert_escaped(err)
