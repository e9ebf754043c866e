"""A job whose environment is not UTF-8 (``DYNPROF_JOB_ID=$'bad\\xff'``): the agent reads its
identity as valid text, every reader of a registration record does too, and a handler that
fails on every request writes into the job's stderr once."""

from __future__ import annotations

import logging
import os
import socket
import time

from dynprof.identity import detect
from dynprof.registry import AgentRecord
from tests.support.records import record_doc


def test_identity_of_an_environment_that_is_not_utf8():
    # GIVEN an environment whose job id and host name are bytes that are not UTF-8
    env = {"DYNPROF_JOB_ID": os.fsdecode(b"bad\xff"), "DYNPROF_HOST": os.fsdecode(b"h\xc3"), "RANK": "1"}
    # WHEN the identity is read from it, twice
    first, second = detect(env), detect(env)
    # THEN the id and host are valid text with the bytes escaped, the same on each read
    assert first.job_id == "bad\\xff" and first.host == "h\\xc3" and first.rank == 1
    assert first == second
    first.job_id.encode("utf-8")


def _record(**kw):
    doc = record_doc(
        os.getpid(),
        ppid=os.getppid(),
        host=socket.gethostname(),
        rank=0,
        world_size=1,
        job_id="j",
        cmdline=["python", "train.py"],
        started_at=time.time(),
        socket="/tmp/x.sock",
    )
    doc.update(kw)
    return doc


def test_a_record_with_undecodable_text_is_read_as_valid_text():
    # GIVEN a registration record whose job id, host and command line hold a lone surrogate
    # (what an agent that wrote a non-UTF-8 environment raw leaves in its JSON)
    doc = _record(job_id="bad\udcff", host="node\udcfe", cmdline=["python", "a\udcff.py"])
    # WHEN it is read
    record = AgentRecord.from_dict(doc)
    # THEN its text is valid, the bytes escaped
    assert record.job_id == "bad\\xff" and record.host == "node\\xfe" and record.cmdline[1] == "a\\xff.py"


def test_a_failing_handler_writes_to_the_jobs_stderr_once():
    # GIVEN the agent's control server with a status handler that fails on every request,
    # and the job's stderr as the agent sees it (its warnings)
    from dynprof.agent._server import ControlServer
    from dynprof.proto import PROTOCOL_VERSION, pb

    def status(_msg):
        raise UnicodeEncodeError("utf-8", "bad\udcff", 3, 4, "surrogates not allowed")

    warnings: list[logging.LogRecord] = []
    quiet: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            (warnings if record.levelno >= logging.WARNING else quiet).append(record)

    log = logging.getLogger("dynprof.agent")
    handler, level = Catch(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server = ControlServer(sock, "", {"status": status})
        request = pb.Request(protocol_version=PROTOCOL_VERSION, request_id=7, status=pb.StatusRequest())
        # WHEN 20 status requests come in
        replies = [server.dispatch(request.SerializeToString()) for _ in range(20)]
    finally:
        sock.close()
        log.removeHandler(handler)
        log.setLevel(level)
    # THEN each gets its error, and one warning reaches the job's stderr, the rest the log file
    assert all(r.error.code == pb.INTERNAL and "status failed" in r.error.message for r in replies)
    assert len(warnings) == 1 and "later failures go to the agent's log file only" in warnings[0].getMessage()
    assert len(quiet) == 19
    assert server.failed_commands == {"status": 20}
