"""The CLI on bad input: numbers, replies and files that are wrong on purpose."""

from __future__ import annotations

import os

import pytest

from dynprof.cli import main


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
class WrongReplyAgent:
    """A registered 'agent' for a real sleeping process whose socket answers every request
    with ``reply`` (a Reply field name) instead of the reply the command calls for."""

    def __init__(self, run_dir, reply: str = "pong") -> None:
        import socket
        import subprocess
        import sys
        import threading

        from dynprof.registry import AgentRecord, process_start_ticks, socket_path, write_record

        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.pid = self.child.pid
        (run_dir / "agents").mkdir(parents=True, exist_ok=True)
        path = str(socket_path(self.pid, run_dir / "agents"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(8)
        self.reply = reply
        self.stopped = False
        write_record(
            AgentRecord(
                pid=self.pid,
                ppid=os.getpid(),
                host="h",
                rank=None,
                local_rank=None,
                world_size=None,
                job_id=None,
                cmdline=["python"],
                python_version="3",
                torch_version=None,
                dynprof_version="0",
                started_at=0.0,
                start_ticks=process_start_ticks(self.pid),
                socket=path,
                log="",
                activation="run",
            ),
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

    def make(reply: str = "pong") -> WrongReplyAgent:
        agent = WrongReplyAgent(dynprof_dirs["run"], reply)
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
