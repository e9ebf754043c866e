"""dynprof.sidecar.actions: options checked per action (against the commands' parsers), results
answered as they are, structured errors, slots, hard time limits, child process groups."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dynprof import errors
from dynprof.result import Result
from dynprof.sidecar import actions, outcome
from dynprof.sidecar.actions import (
    ActionError,
    ActionsBusy,
    ActionSlots,
    check_options,
    effective_timeout,
    run_action,
)


def stub_table(collect: Any = None, seen: list[dict[str, Any]] | None = None, collect_nodes: Any = None):
    """A table whose every action reads its options as the request itself (recording them in
    ``seen``) and answers with ``collect`` (default: an empty result)."""

    def decode(options: dict[str, Any]) -> dict[str, Any]:
        if seen is not None:
            seen.append(options)
        return options

    local = collect or (lambda request: Result({}))
    return {
        name: dataclasses.replace(row, decode=decode, collect=local, job=collect_nodes or row.job)
        for name, row in actions.ACTIONS.items()
    }


def test_options_are_checked_for_their_kind_and_unknown_ones_are_refused():
    checked = check_options("start", {"job": "j", "steps": 3, "record_shapes": True, "with_stack": False})
    # every option given stays itself (false too: the request reads it); none becomes a flag
    assert checked.options == {"job": "j", "steps": 3, "record_shapes": True, "with_stack": False}
    assert checked.hosts is None and checked.cacert is None
    # a list kind takes one item for a list of one; a float takes an integer; null is unset
    assert check_options("stacks", {"pid": 7, "timeout": 5, "job": None}).options == {"pid": [7], "timeout": 5.0}
    assert check_options("memory-plan", {"pid": [7], "budget": "60%"}).options == {"pid": [7], "budget": "60%"}
    for name, params in (
        ("ps", {"output": "x"}),
        ("start", {"steps": "3"}),
        ("start", {"steps": True}),
        ("stacks", {"pid": ["1"]}),
        ("stacks", {"pid": []}),
        ("stacks", {"timeout": float("nan")}),
        ("ps", {"job": "a\x00b"}),
        ("ps", {"job": "x" * 5000}),
        ("healthcheck", {"skip": [1]}),
        ("nope", {}),
    ):
        with pytest.raises(ActionError):
            check_options(name, params)


def test_timeouts_are_capped_per_action():
    assert effective_timeout("ps", None) == actions.ACTIONS["ps"].default_timeout_s
    assert effective_timeout("ps", 10_000) == actions.ACTIONS["ps"].max_timeout_s
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ActionError):
            effective_timeout("ps", bad)  # type: ignore[arg-type]


def test_a_command_that_overruns_is_answered_timed_out_and_keeps_its_slot(monkeypatch):
    # GIVEN a command that takes longer than its hard limit, and one slot
    monkeypatch.setattr(actions, "SUBPROCESS_GRACE_S", 0.0)
    release = threading.Event()

    def slow(args):
        release.wait(300)
        return Result({"late": True})

    slots = ActionSlots(1, table=stub_table(slow))
    # WHEN it runs with a 0.3 s limit
    t0 = time.monotonic()
    answer = slots.run("ls", {}, timeout=0.3)
    # THEN its caller is answered "timed out" (9) at the limit, not when the command ended
    assert answer["exit_code"] == 9 and time.monotonic() - t0 < 60
    assert "ran past" in answer["messages"][0]
    # AND the slot stays taken while the command still runs, and is free once it ends
    with pytest.raises(ActionsBusy):
        slots.run("ls", {})
    release.set()
    deadline = time.monotonic() + 60
    while True:
        try:
            assert slots.run("ls", {})["result"] == {"late": True}
            break
        except ActionsBusy:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_bad_request_is_refused_before_taking_a_slot():
    slots = ActionSlots(1)
    with pytest.raises(ActionError):
        slots.run("ps", {"bogus": 1})
    with pytest.raises(ActionError):
        run_action("ps", {}, timeout=-1)
    assert slots._sem.acquire(blocking=False)  # the slot was never taken


def test_an_own_timeout_option_is_capped_too():
    seen: list[dict[str, Any]] = []
    table = stub_table(seen=seen)
    run_action("ps", {"timeout": 1e9}, table=table)
    assert seen[0]["timeout"] == actions.ACTIONS["ps"].max_timeout_s
    run_action("ps", {}, table=table)
    assert "timeout" not in seen[1]  # the command's own default stands
    run_action("start", {"pid": [1]}, table=table)
    assert seen[2]["timeout"] == 600.0  # start waits for ever by itself: never over HTTP


# -- job-wide actions: `hosts` ----------------------------------------------------------------------
def test_hosts_are_checked_and_travel_apart_from_the_options():
    from dynprof.sidecar.actions import FanoutConfig

    fanout = FanoutConfig("/run/token", cacert="/etc/ca.pem")
    checked = check_options("stacks", {"job": "j", "hosts": ["node-1", " node-2:9000", "[::1]:8787"]}, fanout)
    assert checked.options == {"job": "j"} and checked.cacert == "/etc/ca.pem"
    assert checked.hosts == ("node-1", "node-2:9000", "[::1]:8787")
    assert checked.to_json("stacks") == {
        "action": "stacks",
        "options": {"job": "j"},
        "hosts": ["node-1", "node-2:9000", "[::1]:8787"],
        "cacert": "/etc/ca.pem",
    }
    for bad in (["a b"], ["a,b"], [], "node-1", [1], ["node:99999"], ["x/y"]):
        with pytest.raises(ActionError, match="hosts"):
            check_options("ps", {"hosts": bad}, fanout)
    with pytest.raises(ActionError, match="does not reach other nodes"):
        check_options("ps", {"hosts": ["node-1"]}, None)
    with pytest.raises(ActionError, match="this node only"):
        check_options("healthcheck", {"hosts": ["node-1"]}, fanout)


def test_hosts_is_never_among_the_options_the_fan_out_forwards():
    # the fan-out sends a node exactly the action's options: `hosts` must not be one of them,
    # so a node asked by a fan-out never fans out again
    for name, action in actions.ACTIONS.items():
        assert "hosts" not in action.options, name
        assert "hostfile" not in action.options and "token_file" not in action.options, name
    # AND the actions that fan out are those whose row names a job-wide function, never an
    # action of a command's own subcommand (memory-plan: `memory plan`), which runs on this node only
    fans_out = {n for n, a in actions.ACTIONS.items() if a.fans_out}
    assert fans_out == {n for n, a in actions.ACTIONS.items() if a.job is not None}
    assert not any(actions.ACTIONS[n].leading for n in fans_out)
    assert {"ps", "ls", "stacks", "start", "stop", "memory", "nccl"} <= fans_out
    assert not {"memory-plan", "healthcheck", "link-test"} & fans_out


def test_a_job_wide_action_runs_in_a_child_with_the_sidecars_token_file(monkeypatch):
    from dynprof.sidecar.actions import FanoutConfig

    calls = []

    def child(name, checked, timeout, extra_env=None, failed_exit=1):
        calls.append((checked, timeout, extra_env))
        return actions.Outcome(0, {"nodes": [], "agents": []})

    monkeypatch.setattr(actions, "run_child", child)
    in_process = stub_table(lambda args: pytest.fail("ran in the sidecar's process"))
    slots = ActionSlots(1, FanoutConfig("/run/dynprof/token"), table=in_process)
    answer = slots.run("ps", {"job": "j", "hosts": ["node-1", "node-2"]}, timeout=20)
    assert answer["exit_code"] == 0 and answer["result"] == {"nodes": [], "agents": []}
    ((checked, timeout, env),) = calls
    assert checked.options == {"job": "j", "timeout": 20.0} and checked.hosts == ("node-1", "node-2")
    assert env == {"DYNPROF_TOKEN_FILE": "/run/dynprof/token"} and timeout == 20.0
    assert slots._sem.acquire(blocking=False)  # the slot was given back


# -- the rows hold to the commands' parsers ----------------------------------------------------------
SAMPLES: dict[str, Any] = {"int": 1, "float": 1.5, "str": "x", "bool": True, "ints": [1, 2], "strs": ["x"]}
# options whose parser accepts names only: a name it knows
NAMED_SAMPLES: dict[str, Any] = {
    "activities": ["cpu"],
    "skip": ["disk_free"],
    "keep_groups": ["sample-0123456789ab"],
    # fractions between 0 and 1
    **dict.fromkeys(("fail_below", "warn_below", "peer_fail", "peer_warn"), 0.5),
}
KIND_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,)}


def row_problems(name: str, action: actions.Action) -> list[str]:
    """What is wrong with ``action``'s options against the parser of its command: a flag it
    does not have, or a kind that does not fit (bool is store_true; int, float and str parse
    to their type; a list kind parses, from the comma-joined value the sidecar sends, to a list)."""
    from tests.unit._action_flags import command_parser, load_command, parse_options

    command = load_command(action.command)
    parser = command_parser(action.command, command)
    by_flag = {flag: a for a in parser._actions for flag in a.option_strings}
    problems = []
    for key, opt in action.options.items():
        arg = by_flag.get(opt.flag)
        if arg is None:
            problems.append(f"{name}.{key}: dynprof {action.command} has no {opt.flag}")
            continue
        is_switch = arg.nargs == 0 and arg.const is True
        if (opt.kind == "bool") != is_switch:
            problems.append(f"{name}.{key}: {opt.kind} for {opt.flag}, which is {'' if is_switch else 'not '}a switch")
            continue
        if opt.kind == "bool":
            continue
        choices = list(arg.choices or [])
        sample = NAMED_SAMPLES.get(key, SAMPLES[opt.kind])
        if choices:
            sample = choices[:1] if opt.kind == "strs" else choices[0]
        # a command that must be told its targets (one of --job, --pid, --all) gets --all
        base = {} if key in ("job", "pid", "all") or "all" not in action.options else {"all": True}
        try:
            parsed = parse_options(name, command, {**base, key: actions._checked(opt, key, sample)}, None, None)
            value = getattr(parsed, arg.dest)
        except errors.DynprofError as exc:
            problems.append(f"{name}.{key}: {opt.flag} refuses a {opt.kind} ({sample!r}): {exc.message}")
            continue
        if opt.kind in ("ints", "strs"):
            if isinstance(arg, argparse._AppendAction) or arg.nargs in ("+", "*"):
                value = [v for item in value for v in (item if isinstance(item, (list, tuple, set)) else [item])]
            want = int if opt.kind == "ints" else str
            if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, want) for v in value):
                problems.append(f"{name}.{key}: {opt.flag} does not parse to a list of {want.__name__}: {value!r}")
        elif isinstance(value, bool) or not isinstance(value, KIND_TYPES[opt.kind]):
            problems.append(f"{name}.{key}: {opt.flag} parses to {type(value).__name__}, not {opt.kind}")
    return problems


def test_every_action_option_exists_in_its_commands_parser_with_its_kind():
    # GIVEN the rows of every action WHEN each option is held to its command's parser
    problems = [p for name, action in actions.ACTIONS.items() for p in row_problems(name, action)]
    # THEN every flag exists there, with a kind that fits
    assert problems == []


def test_a_wrong_row_is_caught():
    # GIVEN rows that drifted from the parser: a flag it lacks, a switch read as a number, a
    # number read as a switch, a single value read as a list
    wrong = actions.Action(
        "ls",
        {
            "kinds": actions.Option("--kinds", "str"),
            "all": actions.Option("--all", "int"),
            "limit": actions.Option("--limit", "bool"),
            "job": actions.Option("--job", "ints"),
        },
        collect=lambda request: request,
        decode=dict,
    )
    # WHEN they are held to `dynprof ls`'s parser
    problems = row_problems("ls", wrong)
    # THEN each is named
    assert len(problems) == 4, problems
    assert "has no --kinds" in problems[0] and "--all, which is a switch" in problems[1]
    assert "--limit, which is not a switch" in problems[2] and "list of int" in problems[3]


# -- results, not printed output -------------------------------------------------------------------
def test_an_action_answers_the_result_and_takes_no_stdout(capsys):
    # GIVEN a command whose collect returns while another thread of the sidecar prints
    started, printed = threading.Event(), threading.Event()

    def collect(args):
        started.set()
        assert printed.wait(60)
        return Result({"agents": [{"pid": 1}]}, 0, ["skipping 1 process\n  (it is gone)"])

    table = stub_table(collect)
    stdout = sys.stdout

    def chatter():
        assert started.wait(60)
        print("the sidecar's own line")
        printed.set()

    other = threading.Thread(target=chatter)
    other.start()
    # WHEN the action runs
    answer = run_action("ps", {}, table=table)
    other.join(60)
    # THEN its answer is exactly the Result, with its messages as the CLI's stderr lines, and
    # the line printed meanwhile went where it was printed, not into the answer
    assert answer["result"] == {"agents": [{"pid": 1}]} and answer["exit_code"] == 0 and answer["error"] is None
    assert answer["messages"] == ["dynprof: skipping 1 process", "  (it is gone)"]
    assert capsys.readouterr().out == "the sidecar's own line\n"
    assert sys.stdout is stdout  # nothing stands in for it
    assert not hasattr(actions, "_Routed") and not hasattr(actions, "install_capture")


def test_a_result_is_answered_as_strict_json_and_bounded(monkeypatch):
    # GIVEN results with a non-finite number, a value JSON lacks, and one over the limit
    table = stub_table(lambda args: Result({"ratio": float("nan"), "path": Path("/x")}))
    answer = run_action("ls", {}, table=table)
    assert answer["result"] == {"ratio": None, "path": "/x"}
    monkeypatch.setattr(outcome, "MAX_OUTPUT_BYTES", 100)
    big = run_action("ls", {}, table=stub_table(lambda args: Result({"x": "y" * 200})))
    assert big["exit_code"] == 1 and big["result"] is None and "over" in big["error"]["message"]


def test_a_dynprof_error_is_answered_structured_and_the_client_reads_it():
    # GIVEN a command that stops on a DynprofError
    from dynprof.job.client import _answer
    from dynprof.nodes import Node

    def collect(args):
        raise errors.NoAgent("no agent of job 'j' on this node")

    # WHEN it runs as an action
    answer = run_action("ps", {"job": "j"}, table=stub_table(collect))
    # THEN the answer carries the error, structured, and the CLI's --json error document
    expected = {
        "type": "NoAgent",
        "message": "no agent of job 'j' on this node",
        "help": errors.NoAgent.default_help,
        "exit_code": 5,
    }
    assert answer["exit_code"] == 5 and answer["error"] == expected and answer["result"] == {"error": expected}
    assert answer["messages"][0] == "dynprof: error: no agent of job 'j' on this node"
    # AND the fan-out's client reads that field, whatever the messages say
    node = Node("node-a", 8787)
    got = _answer(node, json.loads(json.dumps({**answer, "messages": ["something else"]})), "ps", 0.1)
    assert got.failure is not None and got.failure.type == "NoAgent" and got.failure.exit_code == 5
    assert got.command_error() == "no agent of job 'j' on this node"
    assert got.summary("node-a")["error"] == "no agent of job 'j' on this node"
    # AND a malformed error field is refused as not a sidecar's answer
    from dynprof.job.client import NodeFailure

    for bad in ("no agent", {"message": 5}, {"type": "X", "message": "m", "help": "", "exit_code": "5"}):
        with pytest.raises(NodeFailure, match="error that is not"):
            _answer(node, {**answer, "error": bad}, "ps", 0.1)


def test_a_bug_in_a_command_is_an_internal_error_not_a_crash():
    def collect(args):
        raise KeyError("oops")

    answer = run_action("ps", {}, table=stub_table(collect))
    assert answer["exit_code"] == 1 and answer["error"]["message"] == "internal error: KeyError: 'oops'"


def test_the_node_side_of_a_job_level_action_collects_its_request_here():
    # GIVEN a job-level command WHEN a node runs its action (as the fan-out asks: no hosts)
    def collect_nodes(options, hosts, cacert):
        raise AssertionError("fanned out")

    answer = run_action("stacks", {"job": "j"}, table=stub_table(collect_nodes=collect_nodes))
    # THEN the node answers from its request's collect, on this node
    assert answer["exit_code"] == 0 and answer["result"] == {}


# -- the real command table --------------------------------------------------------------------------
def test_the_command_table_parses_with_each_commands_own_parser():

    # GIVEN the table `dynprof serve` hands the sidecar
    table = actions.ACTIONS
    assert set(table) == set(actions.ACTIONS)
    # WHEN healthcheck gets a level its parser refuses
    answer = run_action("healthcheck", {"level": "thorough"}, table=table)
    # THEN it is a usage error with healthcheck's own code (3: 2 means "unhealthy"), nothing run
    assert answer["exit_code"] == 3 and answer["error"]["type"] == "UsageError", answer
    assert "--level" in answer["error"]["message"] and "thorough" in answer["error"]["message"]
    # AND a job-level command's refused value is a usage error (2)
    answer = run_action("ls", {"limit": -3}, table=table)
    assert answer["exit_code"] == 2 and answer["error"]["type"] == "UsageError", answer


def test_an_action_answers_what_the_cli_prints_with_json(dynprof_dirs, capsys):
    # GIVEN an artifact in the store
    from dynprof.cli import main
    from dynprof.store import ArtifactStore

    writer = ArtifactStore().create("trace", job="j", rank=0)
    writer.write_text("x.txt", "data")
    writer.finish("complete")
    # WHEN ls runs as an action, and as the CLI with --json
    answer = run_action("ls", {"job": "j"})
    assert main(["ls", "--job", "j", "--json"]) == 0
    # THEN the answer's result is what the CLI printed
    assert answer["exit_code"] == 0 and answer["result"] == json.loads(capsys.readouterr().out)


def test_the_sidecar_imports_no_cli():
    # GIVEN a fresh interpreter WHEN the sidecar's app and actions are imported
    code = (
        "import sys, dynprof.sidecar.app, dynprof.sidecar.actions, dynprof.sidecar.page; "
        "print(sorted(m for m in sys.modules if m == 'dynprof.cli' or m.startswith('dynprof.cli.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # THEN no CLI module came with them (dynprof serve hands the sidecar its commands and views)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- link-test: the sidecar's allow-list, its binding, no privileged port ---------------------------
LINK = {"rank": 1, "world": 2, "store_host": "10.9.9.9", "store_port": 29720}


def test_a_sidecar_without_job_wide_runs_no_link_test():
    # GIVEN a sidecar started with --no-job-wide (no fan-out, hence no link policy)
    slots = actions.ActionSlots(2)
    # WHEN a token holder asks for a link test toward any host, of either rank
    for rank in (0, 1):
        with pytest.raises(actions.ActionError, match="no-job-wide"):
            slots.run("link-test", {**LINK, "rank": rank, "store_host": "127.0.0.9", "store_port": 29999})
    # THEN it is refused before anything runs (and before a slot is taken)
    assert slots._sem.acquire(blocking=False)


# -- actions whose kind has a request ----------------------------------------------------------------
def test_an_action_with_a_request_is_read_by_its_from_json_and_collected_without_argv():
    # GIVEN a command that reads its action's options as a request
    seen: list[Any] = []

    def collect_request(request):
        seen.append(request)
        return Result({"asked": request})

    table = {
        "memory": dataclasses.replace(
            actions.ACTIONS["memory"], decode=lambda options: dict(options), collect=collect_request
        )
    }
    # WHEN the action runs on this node
    answer = run_action("memory", {"job": "j", "history_start": 10}, timeout=20, table=table)
    # THEN the request is what the options say (the action's limit given as its timeout)
    assert answer["exit_code"] == 0 and answer["error"] is None, answer
    assert seen == [{"job": "j", "history_start": 10, "timeout": 20.0}]


def test_the_real_table_reads_requests_for_the_kinds_that_have_them():
    from collectors.flight_recorder.collect import NcclRequest
    from collectors.memory.collect import MemoryPlanRequest, MemoryRequest
    from collectors.stacks.collect import StacksRequest
    from collectors.torch_trace.collect import TraceRequest

    table = actions.ACTIONS
    # GIVEN the sidecar's rows: memory, memory-plan, stacks, nccl, start decode requests
    assert table["memory"].decode == MemoryRequest.from_json
    assert table["memory-plan"].decode == MemoryPlanRequest.from_json
    assert table["nccl"].decode == NcclRequest.from_json
    assert table["start"].decode == TraceRequest.from_json
    assert table["stacks"].decode is not None
    assert table["stacks"].decode({"job": "j", "full": True}) == StacksRequest(job="j")
    # AND ps, ls, stop decode theirs; the actions run in a child process have none
    from dynprof.node_requests import LsRequest, PsRequest, StopRequest

    assert table["ps"].decode == PsRequest.from_json and table["ls"].decode == LsRequest.from_json
    assert table["stop"].decode == StopRequest.from_json
    from healthcheck.links.side import LinkTestRequest

    assert table["link-test"].decode == LinkTestRequest.from_json and table["healthcheck"].decode is not None
    loopback = actions.LinkPolicy.for_sidecar("127.0.0.1", env={})
    # WHEN a request its kind refuses is sent (no target; a plan without a budget; an unknown stack mode)
    for name, options, said in (
        ("memory", {}, "exactly one of --pid, --job or --all"),
        ("memory-plan", {"job": "j"}, "needs --budget SIZE or --save SIZE"),
        ("memory", {"job": "j", "stacks": "cpp"}, "--stacks 'cpp'"),
        ("stacks", {"job": "j", "method": "gdb"}, "unknown method 'gdb'"),
        ("nccl", {"pid": [1], "all": True}, "exactly one of --pid, --job or --all"),
        ("start", {"job": "j", "steps": 2, "duration": 1.0}, "not both"),
        ("ls", {"limit": -3}, "ls: argument --limit: -3 is out of range"),
        ("link-test", {"rank": 1, "store_host": "127.0.0.1", "size": 2}, "--size is 4 bytes to 1 GiB"),
        ("stop", {}, "stop: one of the arguments --pid --job --all is required"),
    ):
        answer = run_action(name, options, table=table, links=loopback)
        # THEN it is the command's usage error (2), answered, as when the parser refused it
        assert answer["exit_code"] == 2 and answer["error"]["type"] == "UsageError", answer
        assert said in answer["error"]["message"], answer
    # AND a value of the wrong type is still refused before anything runs (HTTP 400)
    with pytest.raises(actions.ActionError, match="'history_start' must be an integer"):
        run_action("memory", {"job": "j", "history_start": "5"}, table=table)
    # AND a request that is run answers as the command does: a process that is gone is named
    answer = run_action("memory", {"pid": [2**22]}, table=table)
    assert answer["exit_code"] != 0 and str(2**22) in answer["error"]["message"], answer


def test_each_request_read_from_json_takes_exactly_its_actions_options():
    """A kind's request (``OPTIONS``, what its ``from_json`` reads) is the one table of its
    action's options: the row is made from it (``Action.request``), so every action whose
    command reads a request must carry that request in its row, with the same options and
    kinds, or a body the sidecar accepts would be refused by the request (or the other way round)."""

    table = actions.ACTIONS
    with_requests = {name for name, command in table.items() if command.decode is not None}
    assert with_requests == {name for name, action in actions.ACTIONS.items() if action.request is not None}
    assert {"stacks", "nccl", "start", "memory", "memory-plan"} <= with_requests
    for name in with_requests:
        action = actions.ACTIONS[name]
        assert action.request is not None
        kinds = {key: opt.kind for key, opt in action.options.items() if key not in action.text_options}
        assert dict(action.request.OPTIONS) == kinds, name
