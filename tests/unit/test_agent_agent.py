"""The agent's log file handler never raises into the thread that logs."""

from __future__ import annotations

import logging
import shutil

from dynprof.agent._agent import _AgentFileHandler


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
