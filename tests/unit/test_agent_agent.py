"""The in-process agent (dynprof/agent/_agent.py): it starts once, registers a private socket
that answers, unregisters at shutdown, never raises into the job (a failed start is one line on
stderr, a failed extension is skipped), and its logging never raises or prints a traceback."""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import sys
import threading
import types
from pathlib import Path
from typing import Any

import dynprof.agent
from dynprof import registry
from dynprof.agent import _agent
from dynprof.agent._agent import _AgentFileHandler, _AgentStderrHandler, _OneLineFormatter
from dynprof.client import AgentClient


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord("dynprof.agent", logging.INFO, __file__, 1, msg, None, None)


def test_a_log_directory_removed_while_detached_never_raises_into_the_logging_thread(tmp_path, capsys):
    # GIVEN an agent log handler that wrote once, was detached (agent stopped) and whose directory
    # was then removed (a per-job run directory cleaned up before the agent starts again)
    logs = tmp_path / "logs"
    logs.mkdir()
    handler = _AgentFileHandler(str(logs / "1.log"))
    handler.emit(_record("first"))
    handler.detach()
    shutil.rmtree(logs)
    handler.attach()

    # WHEN the training thread logs through it (emit reopens the file)
    handler.emit(_record("second"))
    handler.emit(_record("third"))

    # THEN nothing was raised, the job's stderr got one dynprof line, and later lines are dropped
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dynprof: warning: the agent cannot write its log")
    assert handler.failures == 2
    handler.close()


def test_a_detached_log_handler_writes_nothing(tmp_path):
    # GIVEN a handler that wrote a line and was detached (the agent stopped)
    path = tmp_path / "1.log"
    handler = _AgentFileHandler(str(path))
    handler.emit(_record("before"))
    handler.detach()

    # WHEN a thread of the agent that is still finishing logs
    handler.emit(_record("after"))
    handler.close()

    # THEN only the first line is in the file
    text = path.read_text()
    assert "before" in text and "after" not in text


def test_a_warning_reaches_stderr_as_one_prefixed_line_naming_the_log():
    # GIVEN the formatter of the job's stderr and a warning about a failure with a multi-line message
    formatter = _OneLineFormatter("/run/dynprof/logs/7.log")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("dynprof.agent", logging.WARNING, __file__, 1, "trace failed\nbadly", None, None)
        record.exc_info = sys.exc_info()

    # WHEN formatted
    line = formatter.format(record)

    # THEN one line, prefixed, with the exception's type and the log file, and no traceback
    assert "\n" not in line
    assert line == "dynprof: trace failed badly: ValueError: bad thing (details in /run/dynprof/logs/7.log)"


def test_a_stderr_that_cannot_be_written_drops_the_line_silently(monkeypatch):
    # GIVEN the agent's stderr handler over a stream that fails
    class Broken:
        def write(self, _: str) -> None:
            raise OSError("EPIPE")

        def flush(self) -> None:
            raise OSError("EPIPE")

    handler = _AgentStderrHandler()
    handler.setStream(Broken())  # type: ignore[arg-type]
    record = _record("warning")

    # WHEN it emits twice (logging's own handleError would print a block on sys.stderr)
    seen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", seen)
    handler.emit(record)
    handler.emit(record)

    # THEN nothing was printed anywhere, and the failures are counted
    assert seen.getvalue() == ""
    assert handler.failures == 2


def test_start_registers_a_private_socket_that_answers_and_shutdown_removes_it(dynprof_dirs):
    # GIVEN no agent in this process
    assert dynprof.agent.get() is None

    # WHEN it starts (twice: start is idempotent)
    agent = dynprof.agent.start("api", note="x")
    again = dynprof.agent.start()

    # THEN one agent is registered, its socket is this user's only, and it answers status
    assert agent is not None and again is agent and dynprof.agent.get() is agent
    assert agent.wait_ready(10)
    record = registry.read_record(os.getpid())
    assert record is not None and record.pid == os.getpid() and record.activation == "api"
    assert record.extra == {"note": "x"}, "plain options are kept in the record"
    assert Path(record.socket).parent == dynprof_dirs["run"] / "agents"
    assert stat.S_IMODE(os.stat(record.socket).st_mode) & 0o077 == 0, "nobody else may connect"
    status = AgentClient.for_record(record, timeout=10).status()
    assert status.pid == os.getpid() and status.rank == -1

    # WHEN it shuts down
    dynprof.agent.shutdown()

    # THEN it is gone: no agent, no record, no socket
    assert dynprof.agent.get() is None
    assert registry.read_record(os.getpid()) is None and not os.path.exists(record.socket)


def test_an_agent_that_cannot_start_says_so_on_one_line_and_returns_none(monkeypatch, tmp_path, capsys):
    # GIVEN a run directory whose socket path is longer than a Unix socket allows
    long_dir = tmp_path / ("d" * 120)
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(long_dir))

    # WHEN the agent starts
    agent = dynprof.agent.start()

    # THEN no exception, no agent, and one dynprof line on stderr that says why (the log file
    # of an earlier agent of this process, in a run directory since removed, may say so too)
    assert agent is None and dynprof.agent.get() is None
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if line.startswith("dynprof: agent not started: OSError")]
    assert len(said) == 1 and "DYNPROF_RUN_DIR" in said[0], lines
    assert all(line.startswith("dynprof: ") for line in lines), f"no traceback reaches the job: {lines}"


def test_an_extension_that_fails_is_skipped_and_the_others_still_answer(monkeypatch):
    # GIVEN extensions: one missing, one that fails to install, then a working one
    def broken(agent: Any) -> None:
        raise RuntimeError("no")

    def works(agent: Any) -> str:
        agent.handlers["hello"] = lambda _: ("pong", None)
        return "installed"

    monkeypatch.setitem(sys.modules, "dp_test_ext_broken", types.SimpleNamespace(install=broken))
    monkeypatch.setitem(sys.modules, "dp_test_ext_works", types.SimpleNamespace(install=works))
    monkeypatch.setattr(_agent, "EXTENSIONS", ("dp_test_ext_missing", "dp_test_ext_broken", "dp_test_ext_works"))

    # WHEN the agent starts
    agent = dynprof.agent.start()

    # THEN the core commands and the working extension are there; the broken one is not
    assert agent is not None and agent.wait_ready(10)
    assert {"ping", "status", "hello"} <= set(agent.handlers)
    assert agent.extensions == {"dp_test_ext_works": "installed"}


def test_stop_runs_every_exit_callback_last_first_even_after_one_fails():
    # GIVEN an agent with three exit callbacks, the middle one failing
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10)
    ran: list[str] = []
    agent.exit_callbacks.append(lambda: ran.append("first"))
    agent.exit_callbacks.append(lambda: 1 / 0)  # type: ignore[func-returns-value]
    agent.exit_callbacks.append(lambda: ran.append("last"))

    # WHEN it stops, twice
    dynprof.agent.shutdown()
    agent.stop()

    # THEN the callbacks ran once each, in reverse order of registration
    assert ran == ["last", "first"]


def test_the_identity_follows_the_environment_and_the_record_follows_it(monkeypatch):
    # GIVEN an agent started before the launcher set the rank
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10) and agent.identity.rank is None

    # WHEN the rank and world size appear (torch.multiprocessing.spawn sets them in the child)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")

    # THEN the agent and its record on disk say so
    assert (agent.identity.rank, agent.identity.world_size) == (3, 8)
    record = registry.read_record(os.getpid())
    assert record is not None and (record.rank, record.world_size) == (3, 8)


def test_a_stopped_agent_never_writes_its_record_again(monkeypatch):
    # GIVEN an agent that stopped
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10)
    dynprof.agent.shutdown()

    # WHEN its identity changes and is read again
    monkeypatch.setenv("RANK", "5")
    assert agent.identity.rank == 5

    # THEN no record reappears
    assert registry.read_record(os.getpid()) is None


def test_cuda_is_not_initialised_by_asking():
    # GIVEN an agent and no torch import of its own
    agent = dynprof.agent.start()
    assert agent is not None and agent.wait_ready(10)

    # WHEN asked whether CUDA is initialised (torch may be imported by the suite: CPU build)
    answer = agent.cuda_initialized()

    # THEN the answer is what torch says, and asking initialised nothing
    torch = sys.modules.get("torch")
    assert answer is (bool(torch.cuda.is_initialized()) if torch is not None else False)


def test_a_shutdown_right_after_start_leaves_no_server_thread(monkeypatch):
    # GIVEN an agent stopped before its server thread has loaded its extensions (a DataLoader
    # worker withdraws this early): the extension below holds the thread until then
    gate = threading.Event()
    monkeypatch.setitem(sys.modules, "dp_test_ext_gate", types.SimpleNamespace(install=lambda agent: gate.wait(5)))
    monkeypatch.setattr(_agent, "EXTENSIONS", ("dp_test_ext_gate",))
    agent = dynprof.agent.start()
    assert agent is not None and agent._thread is not None
    dynprof.agent.shutdown()
    gate.set()
    try:
        # WHEN its server thread has got as far as it gets
        agent.wait_ready(10)
        agent._thread.join(0.5)

        # THEN it has ended: a stopped agent runs nothing in the job
        assert not agent._thread.is_alive(), "the stopped agent's server thread still runs"
    finally:
        if agent._server is not None:  # end the leaked thread, so that the next test starts clean
            agent._server.close()
        agent._thread.join(5)
