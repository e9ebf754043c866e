"""`dynprof stop`: ending a trace on this node's agents. What it says when no trace runs, when
no agent is there, and the text of each process's result."""

from __future__ import annotations

import json
import os

import dynprof.agent
from dynprof.cli import main
from dynprof.cli.stop import StopCommand
from dynprof.job.stop import Stopped


def test_an_agent_without_a_running_trace_is_not_running_exit_1(capsys):
    dynprof.agent.start()
    assert main(["stop", "--pid", str(os.getpid()), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    [row] = doc["results"]
    assert row["pid"] == os.getpid() and row["status"] == "not-running" and row["artifact"] is None
    assert row["error"]
    # As text, only what each process said (it names its process already).
    assert main(["stop", "--pid", str(os.getpid())]) == 1
    assert capsys.readouterr().out.strip() == row["error"]


def test_no_agent_for_the_pid_is_exit_5(capsys):
    assert main(["stop", "--pid", str(os.getpid())]) == 5
    assert str(os.getpid()) in capsys.readouterr().err


def test_results_read_as_one_line_per_process():
    result = Stopped(
        results=[
            {"pid": 10, "rank": 0, "status": "complete", "artifact": "/store/a", "error": None},
            {"pid": 11, "rank": None, "status": "stopping", "artifact": None, "error": None},
            {"pid": 12, "rank": 2, "status": "failed", "artifact": None, "error": "boom\x1b[0m"},
        ]
    )
    assert StopCommand().render(result).splitlines() == [
        "rank 0 (pid 10): complete: /store/a",
        "pid 11: stopping",
        "rank 2 (pid 12): failed: boom\\x1b[0m",
    ]


def test_when_nothing_stops_the_text_is_the_errors():
    result = Stopped(exit_code=1, results=[{"error": "pid 3: no trace running"}], none_stopping=True)
    assert StopCommand().render(result) == "pid 3: no trace running"


def test_the_sidecars_stop_action_answers_what_stop_json_prints(capsys):

    from dynprof.sidecar.actions import run_action

    # GIVEN the agent of this process, running no trace, and the command table `dynprof serve` hands the sidecar
    dynprof.agent.start()
    # WHEN stop runs as an action (its options read as the request) and as the CLI with --json
    answer = run_action("stop", {"pid": [os.getpid()], "no_wait": True})
    assert main(["stop", "--pid", str(os.getpid()), "--no-wait", "--json"]) == 1
    # THEN the answer is what the CLI printed: this process, not running a trace, exit 1
    assert answer["exit_code"] == 1 and answer["error"] is None
    assert answer["result"] == json.loads(capsys.readouterr().out)
    [row] = answer["result"]["results"]
    assert row["pid"] == os.getpid() and row["status"] == "not-running"
    # AND a job no agent here runs is answered with the CLI's error, its code and its document
    answer = run_action("stop", {"job": "no-such-job"})
    code = main(["stop", "--job", "no-such-job", "--json"])
    assert answer["exit_code"] == code != 0 and answer["result"] == json.loads(capsys.readouterr().out)
