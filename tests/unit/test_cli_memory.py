"""dynprof.cli.memory: `dynprof memory` (snapshots, allocator history on or off) and `dynprof
memory plan`: its usage errors and exit codes, the request its options make, the answer and its
text (one row per process, the artifact under a snapshot's row, `what to do` for each failure
that has one).

The kind's collection (collectors.memory.collect) stands in where a test names what it answers,
so the command runs in-process without a training process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from collectors.memory import collect as kind
from collectors.memory.collect import Collected, MemoryPlanRequest, MemoryRequest
from dynprof import errors
from dynprof.cli import main
from dynprof.cli.memory import (
    MemoryCommand,
    MemoryPlanResults,
    MemoryResults,
    plan_request_from_args,
    request_from_args,
)
from dynprof.job import memory
from dynprof.result import Result

# -- the answer and its text (moved whole from test_memory_command.py) -----------------------------
SNAPSHOT_ROWS = [
    {
        "pid": 1,
        "rank": 0,
        "job": "j",
        "status": "complete",
        "artifact": "/a/b",
        "summary": {
            "allocated_bytes": 123456789,
            "reserved_bytes": 2**31,
            "capture_s": 0.01,
            "top_site": "x.py:1 in f",
            "top_site_bytes": 5000,
        },
    },
    {"pid": 2, "rank": None, "job": "j", "status": "failed", "error": "no cuda", "help": "use a gpu", "exit_code": 7},
]


def test_snapshot_results_render_as_a_table_with_the_artifact_and_what_to_do():
    # GIVEN a snapshot taken in one process and refused in another
    result = MemoryResults(results=SNAPSHOT_ROWS, exit_code=7)
    # WHEN it is rendered
    text = MemoryCommand().render(result)
    # THEN the text is the table the command has always printed, then the failure's help
    assert text == (
        "rank    pid  status    result\n"
        "rank 0  1    complete  117.7 MiB allocated / 2.0 GiB reserved, 0.01 s; top site x.py:1 in f (4.9 KiB)\n"
        "                       /a/b\n"
        "-       2    failed    no cuda\n"
        "  what to do: use a gpu"
    )
    # AND the --json document is the rows, as they were
    assert result.to_json() == {"results": SNAPSHOT_ROWS}


def test_history_results_name_the_policy_now_recording():
    # GIVEN a history request answered by one process
    rows = [{"pid": 1, "rank": 3, "job": "j", "status": "ok", "memory_history": "python:100"}]
    # WHEN it is rendered
    text = MemoryCommand().render(MemoryResults(results=rows, history=True))
    # THEN each row says what the process records now
    assert text == "rank    pid  status  result\nrank 3  1    ok      memory history: python:100"


# -- usage errors ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["memory", "--pid", "1", "--budget", "40G"],
            "--budget, --save and --undo are options of `dynprof memory plan`",
        ),
        (["memory", "--pid", "1", "--save", "10%"], "--budget, --save and --undo are options of `dynprof memory plan`"),
        (
            ["memory", "plan", "--pid", "1", "--budget", "1G", "--history-stop"],
            "dynprof memory plan takes no --history-start/--history-stop",
        ),
        (
            ["memory", "plan", "--pid", "1", "--history-start", "5"],
            "dynprof memory plan takes no --history-start/--history-stop",
        ),
        (["memory", "plan", "--pid", "1"], "dynprof memory plan needs --budget SIZE or --save SIZE"),
        (
            ["memory", "plan", "--pid", "1", "--budget", "140%"],
            "--budget '140%': a percentage must be between 0 and 100",
        ),
        (
            ["memory", "plan", "--job", "j", "--hosts", "a,b", "--budget", "1G"],
            "dynprof memory plan asks this node's agents only",
        ),
    ],
)
def test_options_that_do_not_go_together_are_a_usage_error(capsys, argv, said):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"dynprof: error: {said}" in err and "Traceback" not in err


def test_the_budget_s_misuse_says_what_to_run_instead(capsys):
    assert main(["memory", "--pid", "1", "--budget", "40G"]) == 2
    assert "what to do: Run dynprof memory plan --pid PID --budget SIZE." in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["memory"], "one of the arguments --pid --job --all is required"),
        (["memory", "--pid", "1", "--history-start", "0"], "argument --history-start: 0 is out of range"),
        (
            ["memory", "--pid", "1", "--history-start", "10000000000"],
            "argument --history-start: 10000000000 is out of range",
        ),
        (
            ["memory", "--pid", "1", "--history-start", "5", "--history-stop"],
            "not allowed with argument --history-start",
        ),
        (["memory", "--pid", "1", "--stacks", "cpp"], "argument --stacks: invalid choice: 'cpp'"),
        (
            ["memory", "plan", "--pid", "1", "--budget", "1G", "--save", "1G"],
            "argument --save: not allowed with argument --budget",
        ),
        (["memory", "--pid", "1", "--timeout", "-1"], "argument --timeout: -1 is out of range"),
        (["memory", "snapshot", "--pid", "1"], "argument what: invalid choice: 'snapshot'"),
    ],
)
def test_malformed_options_are_refused_by_the_parser(capsys, argv, said):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def _no_such_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_a_process_that_is_not_there_exits_3_in_text_and_json(capsys):
    pid = _no_such_pid()
    assert main(["memory", "--pid", str(pid)]) == 3
    assert f"dynprof: error: no process with pid {pid}" in capsys.readouterr().err
    assert main(["memory", "--pid", str(pid), "--json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["type"] == "ProcessNotFound" and doc["error"]["exit_code"] == 3


# -- the request its options make --------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    MemoryCommand().prepare_parser(parser)
    return parser.parse_args(argv)


def test_the_options_are_the_kind_s_request():
    assert request_from_args(_parse(["--pid", "7,8", "--timeout", "4"])) == MemoryRequest(pids=(7, 8), timeout=4.0)
    assert request_from_args(_parse(["--all", "--history-start", "1000", "--stacks", "all"])) == MemoryRequest(
        all=True, history_start=1000, stacks="all"
    )
    assert request_from_args(_parse(["--job", "j", "--history-stop"])) == MemoryRequest(job="j", history_stop=True)
    defaults = request_from_args(_parse(["--job", "j"]))
    assert defaults.timeout == 300.0 and defaults.stacks == "python" and not defaults.history
    assert plan_request_from_args(_parse(["plan", "--job", "j", "--save", "8G"])) == MemoryPlanRequest(
        job="j", save="8G"
    )
    assert plan_request_from_args(
        _parse(["plan", "--pid", "3", "--budget", "60%", "--timeout", "9"])
    ) == MemoryPlanRequest(pids=(3,), budget="60%", timeout=9.0)


def test_the_sidecar_s_actions_are_read_as_the_kind_s_requests():
    from dynprof.job import memory
    from dynprof.sidecar.table import ACTIONS

    row = ACTIONS["memory"]
    assert row.decode({"job": "j", "history_stop": True}) == MemoryRequest(job="j", history_stop=True)
    assert row.collect is memory.collect and row.command == "memory"
    row = ACTIONS["memory-plan"]
    assert row.decode({"job": "j", "budget": "40G"}) == MemoryPlanRequest(job="j", budget="40G")
    assert row.collect is memory.collect_plan and row.leading == ("plan",)


# -- the answer ---------------------------------------------------------------------------------------
@pytest.fixture
def answers(monkeypatch):
    """What the kind answers: set ``answers["collect"]`` / ``answers["collect_plan"]``; the
    requests it was asked are kept in ``answers["asked"]``."""
    got: dict[str, Any] = {"asked": []}

    def collect(request: MemoryRequest) -> Collected:
        got["asked"].append(request)
        return got["collect"]

    def collect_plan(request: MemoryPlanRequest) -> Collected:
        got["asked"].append(request)
        return got["collect_plan"]

    monkeypatch.setattr(kind, "collect", collect)
    monkeypatch.setattr(kind, "collect_plan", collect_plan)
    return got


def test_a_snapshot_is_printed_as_its_table_with_the_kind_s_exit_code(answers, capsys):
    answers["collect"] = Collected(SNAPSHOT_ROWS, 7, [errors.Unsupported("no cuda", help="use a gpu")])
    # two processes, one failed: the table, not the failure alone
    assert main(["memory", "--job", "j"]) == 7
    out = capsys.readouterr().out
    assert out == MemoryCommand().render(MemoryResults(results=SNAPSHOT_ROWS)) + "\n"
    assert answers["asked"] == [MemoryRequest(job="j")]
    assert main(["memory", "--job", "j", "--json"]) == 7
    assert json.loads(capsys.readouterr().out) == {"results": SNAPSHOT_ROWS}


def test_the_one_process_asked_that_failed_is_its_error_in_text_and_a_row_in_json(answers, capsys):
    row = {
        "pid": 2,
        "rank": None,
        "job": "j",
        "status": "failed",
        "error": "no cuda",
        "help": "use a gpu",
        "exit_code": 7,
    }
    answers["collect"] = Collected([row], 7, [errors.Unsupported("no cuda", help="use a gpu")])
    assert main(["memory", "--job", "j"]) == 7
    captured = capsys.readouterr()
    assert "dynprof: error: no cuda" in captured.err and "what to do: use a gpu" in captured.err
    assert captured.out == ""
    assert main(["memory", "--job", "j", "--json"]) == 7
    assert json.loads(capsys.readouterr().out) == {"results": [row]}


def test_history_on_and_off_are_asked_and_answered_as_history(answers, capsys):
    rows = [{"pid": 1, "rank": 0, "job": "j", "status": "ok", "memory_history": "python:500"}]
    answers["collect"] = Collected(rows, 0)
    assert main(["memory", "--job", "j", "--history-start", "500"]) == 0
    assert "memory history: python:500" in capsys.readouterr().out
    assert answers["asked"][-1] == MemoryRequest(job="j", history_start=500)
    rows[0]["memory_history"] = "off"
    assert main(["memory", "--job", "j", "--history-stop"]) == 0
    assert "memory history: off" in capsys.readouterr().out
    assert answers["asked"][-1] == MemoryRequest(job="j", history_stop=True)


def test_collect_raises_only_for_a_single_failed_process(answers):
    failure = errors.Timeout("took too long")
    row = {"pid": 1, "rank": None, "status": "failed", "error": "took too long", "exit_code": 9}
    answers["collect"] = Collected([row], 9, [failure])
    with pytest.raises(errors.Timeout) as raised:
        memory.collect(MemoryRequest(job="j"), raise_single=True)
    assert raised.value is failure
    result = memory.collect(MemoryRequest(job="j", history_stop=True))
    assert isinstance(result, MemoryResults) and result.history and result.exit_code == 9
    assert result.to_json() == {"results": [row]}


def test_a_plan_is_asked_with_its_options_and_its_notes_said(answers, capsys):
    plan_row = {"pid": 4, "rank": 1, "job": "j", "status": "failed", "error": "no step ran", "help": "train"}
    answers["collect_plan"] = Collected([plan_row], 9, [], ["the step was measured twice"])
    assert main(["memory", "plan", "--job", "j", "--budget", "40G", "--json"]) == 9
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {
        "schema": 1,
        "results": [plan_row],
        "jobs": [],
        "notes": ["the step was measured twice"],
    }
    assert "dynprof: the step was measured twice" in captured.err
    assert answers["asked"] == [MemoryPlanRequest(job="j", budget="40G")]
    # in text, the failed plan's row and what to do
    assert main(["memory", "plan", "--job", "j", "--budget", "40G"]) == 9
    out = capsys.readouterr().out
    assert "rank 1  4    failed  no step ran" in out and "what to do: train" in out


def test_collect_plan_raises_only_for_a_single_failed_process(answers):
    failure = errors.AgentError("the agent died")
    answers["collect_plan"] = Collected([{"pid": 1, "rank": None, "status": "failed", "error": "x"}], 8, [failure], [])
    with pytest.raises(errors.AgentError):
        memory.collect_plan(MemoryPlanRequest(job="j", save="1G"), raise_single=True)
    result = memory.collect_plan(MemoryPlanRequest(job="j", save="1G"))
    assert isinstance(result, MemoryPlanResults) and result.exit_code == 8 and result.messages == []


# -- the text ------------------------------------------------------------------------------------------
def test_a_snapshot_without_a_summary_or_a_top_site_says_what_it_has():
    rows = [{"pid": 5, "rank": 2, "job": "j", "status": "complete", "artifact": "/x", "summary": None}]
    text = MemoryCommand().render(MemoryResults(results=rows))
    assert text.splitlines()[1] == "rank 2  5    complete  0 B allocated / 0 B reserved, None s"
    assert "top site" not in text and text.splitlines()[2].strip() == "/x"


def test_a_process_that_answered_is_given_no_what_to_do():
    rows = [{"pid": 1, "rank": 0, "job": "j", "status": "ok", "memory_history": "off", "help": "never shown"}]
    assert "what to do" not in MemoryCommand().render(MemoryResults(results=rows, history=True))


def test_a_job_wide_answer_is_rendered_rank_by_rank():
    # not this node's own answer: the job-wide layer's rows, one line per rank with its node
    rows = [
        {"rank": 0, "pid": 1, "node": "node-a", "status": "complete", "artifact": "/a/0"},
        {"rank": 1, "pid": 2, "node": "node-b", "status": "ok", "memory_history": "python:10"},
    ]
    text = MemoryCommand().render(Result(doc={"results": rows}))
    assert "rank 0 on node-a: complete: /a/0" in text
    assert "rank 1 on node-b: ok: python:10" in text
    assert "status" not in text.splitlines()[0]  # not the node's table
