"""`dynprof ps`: this node's agents (a live one in this very process, a dead one's record left
out), the hint when there is none, and the job-wide table of the nodes' agents."""

from __future__ import annotations

import json
import os

import dynprof.agent
from dynprof.cli import job, main
from dynprof.cli.ps import _age
from tests.support.job_client import FakeJobClient, answered


def test_no_agent_says_how_to_start_one(capsys):
    assert main(["ps"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no dynprof agents on this node\n") and "dynprof run -- python train.py" in out
    assert main(["ps", "--job", "j<1>"]) == 0
    assert "no dynprof agents on this node for job j<1>" in capsys.readouterr().out


def test_the_agent_of_this_process_is_listed_as_text_and_json(capsys):
    dynprof.agent.start()
    assert main(["ps", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["agents"]
    assert [r["pid"] for r in rows] == [os.getpid()]
    assert rows[0]["state"] == "idle" and "error" not in rows[0]
    assert main(["ps"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["PID", "ROLE", "RANK", "JOB", "STEP", "STATE", "AGE", "COMMAND"]
    assert lines[1].split()[0] == str(os.getpid())


def test_job_filters_the_agents(capsys):
    dynprof.agent.start()
    assert main(["ps", "--job", "another-job", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["agents"] == []


def test_ages_of_nodes_are_shown_whatever_they_answer():
    assert _age("soon") == "-" and _age(None) == "-"
    assert _age(10**400) == "?"
    assert _age(5) != "-"


def test_nodes_agents_are_one_table_in_rank_order(monkeypatch, capsys):
    fake = FakeJobClient(
        "ps",
        [
            answered("node-a", {"agents": [{"pid": 11, "rank": 1, "state": "idle", "age_s": 3}]}),
            answered("node-b", {"agents": [{"pid": 22, "rank": 0, "state": "idle", "cmdline": ["python", "t.py"]}]}),
        ],
    )
    monkeypatch.setattr(job, "client_for", lambda args: fake)
    assert main(["ps", "--hosts", "node-a,node-b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["NODE", "RANK", "PID"]
    assert [line.split()[:3] for line in lines[1:3]] == [["node-b", "0", "22"], ["node-a", "1", "11"]]
    assert lines[-1] == "2 agent(s) on 2 node(s)"


def test_the_sidecars_ps_action_answers_what_ps_json_prints(capsys):
    from dynprof.sidecar.actions import run_action

    # GIVEN the agent of this process, and the command table `dynprof serve` hands the sidecar
    dynprof.agent.start()
    for options, argv in (({}, []), ({"job": "another-job"}, ["--job", "another-job"])):
        # WHEN ps runs as an action (its options read as the request) and as the CLI with --json
        answer = run_action("ps", options)
        assert main(["ps", *argv, "--json"]) == answer["exit_code"] == 0
        printed = json.loads(capsys.readouterr().out)
        # THEN the answer is what the CLI printed (but each agent's age, which moved on)
        for doc in (answer["result"], printed):
            for row in doc["agents"]:
                row.pop("age_s")
        assert answer["result"] == printed and answer["error"] is None
    assert [r["pid"] for r in printed["agents"]] == [] and [r["pid"] for r in answer["result"]["agents"]] == []
    assert [r["pid"] for r in run_action("ps", {})["result"]["agents"]] == [os.getpid()]
