"""dynprof.cli.sidecar_actions: the CLI's commands as the sidecar's actions run them. The command
table `dynprof serve` hands the sidecar (each action's request and its collector), the tests'
mapping of an action's options to its command's own flags (tests/unit/_action_flags.py:
refusals as usage errors, never an exit or a print), one action's answer, and the child process's entry point (run here
in-process: its request on stdin, its answer on stdout), against requests that are wrong on
purpose."""

from __future__ import annotations

import functools
import io
import json
import sys

import pytest

from collectors.memory.collect import MemoryPlanRequest
from dynprof import errors
from dynprof.cli import sidecar_actions as sa
from dynprof.cli.healthcheck import collect_request, decode_request
from dynprof.cli.link_test import LinkTestCommand
from dynprof.cli.ls import LsCommand
from dynprof.cli.start import StartCommand
from dynprof.node_requests import LsRequest
from dynprof.result import Result
from dynprof.sidecar.actions import ACTIONS, ActionCommand
from healthcheck.links.side import LinkTestRequest
from tests.unit import _action_flags as af


# -- commands and their parsers ---------------------------------------------------------------------
def test_a_command_is_loaded_by_its_subcommand_name():
    assert isinstance(sa.load_command("ls"), LsCommand)
    assert type(sa.load_command("gpu-coredump")).__name__ == "GpuCoredumpCommand"
    with pytest.raises(KeyError):
        sa.load_command("gpu_coredump")  # the module's name is not the subcommand's
    with pytest.raises(KeyError):
        sa.load_command("../ls")


def test_the_parser_is_the_commands_own():
    parser = af.command_parser("ls", sa.load_command("ls"))
    assert parser.prog == "dynprof ls"
    assert parser.parse_args(["--job", "j"]).job == "j"


def test_options_are_parsed_without_a_print(capsys):
    args = af.parse_options("ls", sa.load_command("ls"), {"job": "j"}, None, None)
    assert args.job == "j" and args.json is True
    assert capsys.readouterr() == ("", "")


def test_each_option_is_one_flag_of_the_command():
    assert af.flags("start", {"job": "j", "steps": 3, "record_shapes": True, "with_stack": False}, None, None) == [
        "--job=j",
        "--steps=3",
        "--record-shapes",
        "--json",
    ]
    assert af.flags("stacks", {"pid": [1, 2], "timeout": 5.0}, None, None) == ["--pid=1,2", "--timeout=5.0", "--json"]
    # an action of a command's own subcommand: its words first
    assert af.flags("memory-plan", {"pid": [7], "budget": "60%"}, None, None) == [
        "plan",
        "--pid=7",
        "--budget=60%",
        "--json",
    ]
    # job-wide: the nodes and the CA file first; a value that looks like a flag stays a value
    assert af.flags("ps", {"job": "--all"}, ("node-1", "[::1]:8787"), "/etc/ca.pem") == [
        "--hosts=node-1,[::1]:8787",
        "--cacert=/etc/ca.pem",
        "--job=--all",
        "--json",
    ]
    args = af.parse_options("ps", sa.load_command("ps"), {"job": "--all"}, ("node-1",), None)
    assert args.job == "--all" and args.hosts == "node-1"


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"limit": -3}, "ls: argument --limit"),
        ({"limit": "x"}, "ls: argument --limit"),
        ({"bogus": 1}, "ls: unrecognized arguments: --bogus=1"),
    ],
)
def test_a_refused_value_is_a_usage_error_with_nothing_printed(options, said, capsys):
    with pytest.raises(errors.UsageError) as info:
        af.parse_options("ls", sa.load_command("ls"), options, None, None)
    assert info.value.message.startswith(said)
    assert "error:" not in info.value.message and "usage:" not in info.value.message
    assert info.value.help == "See `dynprof ls --help`."
    assert info.value.exit_code == 2
    assert capsys.readouterr() == ("", "")


def test_healthchecks_refusal_keeps_its_own_usage_code():
    # healthcheck's 2 means "unhealthy": its usage error is 3, "could not run"
    with pytest.raises(errors.UsageError) as info:
        af.parse_options("healthcheck", sa.load_command("healthcheck"), {"level": "thorough"}, None, None)
    assert info.value.exit_code == 3 and info.value.message.startswith("healthcheck: argument --level")


# -- the table ----------------------------------------------------------------------------------------
def test_the_table_has_every_action_each_with_its_commands_entry_points():
    table = sa.action_commands()
    assert set(table) == set(ACTIONS)
    assert all(isinstance(command, ActionCommand) for command in table.values())
    # a job-level command: its local and job-wide answers
    assert table["ls"].collect_job.func is sa.collect_job
    assert isinstance(table["ls"].collect_job.args[0], LsCommand)
    # ls carries its request: read from JSON and collected by the command, without argv
    assert table["ls"].decode == LsRequest.from_json
    assert table["ls"].collect_request.__func__ is LsCommand.collect_request
    # every action carries its kind's request: the healthcheck's and the link test's too
    assert table["healthcheck"].decode is decode_request and table["healthcheck"].collect_request is collect_request
    assert table["link-test"].decode == LinkTestRequest.from_json
    assert table["link-test"].collect_request.__func__ is LinkTestCommand.collect_request
    # a kind with a request: read from JSON and collected without argv
    assert table["start"].decode.__func__ is StartCommand.action_requests(StartCommand())["start"][0].__func__
    assert table["start"].collect_request.__func__ is StartCommand.collect_request
    # a command that is not job-level: on this node only
    assert table["healthcheck"].collect_job is None


def test_an_action_of_a_subcommand_reads_that_subcommands_request():
    table = sa.action_commands(["memory-plan"])
    assert list(table) == ["memory-plan"]
    assert table["memory-plan"].decode == MemoryPlanRequest.from_json
    with pytest.raises(errors.UsageError) as info:
        table["memory-plan"].decode({"bogus": 1})
    assert "bogus" in info.value.message


def test_an_unknown_action_is_a_key_error():
    with pytest.raises(KeyError):
        sa.action_commands(["rm"])


# -- one answer ---------------------------------------------------------------------------------------
def test_an_answer_is_the_commands_json_result(dynprof_dirs):
    answer = sa.answer("ls", {"job": "j"}, None, None)
    assert answer["error"] is None and answer["exit_code"] == 0 and answer["messages"] == []
    assert answer["result"]["artifacts"] == []


def test_a_refused_option_is_answered_as_a_structured_error():
    answer = sa.answer("ls", {"limit": "x"}, None, None)
    assert answer["result"] is None and answer["exit_code"] == 2 and answer["messages"] == []
    assert answer["error"]["type"] == "UsageError"
    assert answer["error"]["message"] == "ls: option 'limit' must be an integer"


def test_a_refused_healthcheck_option_is_its_could_not_run():
    answer = sa.answer("healthcheck", {"level": "thorough"}, None, None)
    assert answer["exit_code"] == 3 and answer["error"]["type"] == "UsageError"
    assert answer["error"]["message"].startswith("healthcheck: --level 'thorough'")


def test_a_refused_link_test_is_answered_before_any_worker_starts():
    answer = sa.answer("link-test", {"rank": 1, "store_host": "gpu01", "store_port": 22}, None, None)
    assert answer["exit_code"] == 2 and "no privileged port" in answer["error"]["message"]


def test_a_command_of_this_node_only_is_never_job_wide():
    answer = sa.answer("healthcheck", {}, ["node-1"], None)
    assert answer["exit_code"] == 2
    assert answer["error"]["message"] == "healthcheck runs on this node only"


class Recorder:
    """A table of one action whose entry points record what they were given."""

    def __init__(self, result: Result | Exception) -> None:
        self.result = result
        self.calls: list[tuple[str, object]] = []

    def table(self, names):
        def local(request):
            self.calls.append(("local", request.job))
            print("the command's own chatter")
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

        recorder = self

        class JobWide:
            def collect_job(self, options, node_list, reach):
                recorder.calls.append(("nodes", [str(n) for n in node_list]))
                recorder.reach = reach
                return recorder.result

        job = functools.partial(sa.collect_job, JobWide())
        return {name: ActionCommand(LsRequest.from_json, local, job) for name in names}


@pytest.fixture
def clients(monkeypatch):
    """The sidecars' clients a job-wide answer makes: (token file, CA file) each."""
    made = []

    def client_of(token_file, cacert, *rest):
        made.append((token_file, cacert))
        return "a client"

    monkeypatch.setattr("dynprof.cli.job.client_of", client_of)
    return made


def test_a_job_wide_answer_asks_the_hosts_it_was_given(monkeypatch, clients):
    recorder = Recorder(Result({"ok": 1}, 12, ["node b: refused"]))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    answer = sa.answer("ls", {"job": "j"}, ["node-a", "node-b:9000"], None)
    assert recorder.calls == [("nodes", ["node-a:8787", "node-b:9000"])]
    assert answer == {"result": {"ok": 1}, "exit_code": 12, "messages": ["node b: refused"], "error": None}


def test_a_job_wide_answer_reaches_the_nodes_with_the_sidecars_token_and_ca_file(monkeypatch, clients):
    recorder = Recorder(Result({}))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    sa.answer("ls", {"job": "j"}, ["node-a"], "/etc/ca.pem")
    assert recorder.calls == [("nodes", ["node-a:8787"])]
    # the token of $DYNPROF_TOKEN_FILE (the sidecar gives its own), the CA file it was given,
    # nothing fetched, no progress
    assert clients == [(None, "/etc/ca.pem")]
    assert recorder.reach.client == "a client" and recorder.reach.fetch is None and not recorder.reach.progress


def test_a_job_wide_option_the_request_refuses_is_a_usage_error_before_any_node_is_asked(monkeypatch, clients):
    answer = sa.answer("stacks", {"job": "j", "method": "gdb"}, ["node-a"], None)
    assert answer["exit_code"] == 2 and "unknown method 'gdb'" in answer["error"]["message"]
    assert clients == []


def test_a_dynprof_error_of_the_command_is_the_answers_error(monkeypatch):
    recorder = Recorder(errors.NoAgent("no agent of job 'j'", help="attach one"))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    answer = sa.answer("ls", {"job": "j"}, None, None)
    assert answer == {
        "result": None,
        "exit_code": 5,
        "messages": [],
        "error": {"type": "NoAgent", "message": "no agent of job 'j'", "help": "attach one", "exit_code": 5},
    }


# -- the child's request ------------------------------------------------------------------------------
def test_a_request_is_read_as_it_was_written():
    doc = {"action": "memory-plan", "options": {"job": "j"}, "hosts": ["node-1"], "cacert": "/etc/ca.pem"}
    assert sa.read_request(json.dumps(doc)) == doc
    # no hosts: this node's answer
    assert sa.read_request(json.dumps({"action": "ls", "options": {}})) == {
        "action": "ls",
        "options": {},
        "hosts": None,
        "cacert": None,
    }


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("x" * (sa.MAX_REQUEST_CHARS + 1), "over 1 MiB"),
        ('["ls"]', "no known action"),
        ('{"action": "rm", "options": {}}', "no known action"),
        ('{"action": "ls"}', "options is not a JSON object"),
        ('{"action": "ls", "options": []}', "options is not a JSON object"),
        ('{"action": "ls", "options": "--all"}', "options is not a JSON object"),
        ('{"action": "ls", "options": {}, "hosts": []}', "hosts is not a list of HOST[:PORT]"),
        ('{"action": "ls", "options": {}, "hosts": "node-1"}', "hosts is not a list of HOST[:PORT]"),
        ('{"action": "ls", "options": {}, "hosts": ["node-1", 3]}', "hosts is not a list of HOST[:PORT]"),
        ('{"action": "ls", "options": {}, "hosts": ["n"], "cacert": 1}', "cacert is not a file name"),
    ],
)
def test_a_malformed_request_is_refused_with_why(text, said):
    with pytest.raises(ValueError) as info:
        sa.read_request(text)
    assert str(info.value) == said


@pytest.mark.parametrize("action", [{"ls": 1}, ["ls"]])
def test_an_unhashable_action_is_refused_with_why(action):
    with pytest.raises(ValueError) as info:
        sa.read_request(json.dumps({"action": action, "options": {}}))
    assert str(info.value) == "no known action"


@pytest.mark.parametrize("text", ["", "{", "nul\x00", '{"action": "ls", "options": {}} trailing'])
def test_text_that_is_not_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        sa.read_request(text)


# -- the child ------------------------------------------------------------------------------------------
def _child(monkeypatch, capsys, text: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = sa.main()
    out, err = capsys.readouterr()
    return code, out, err


def test_the_child_writes_one_json_answer_and_the_commands_prints_go_to_stderr(monkeypatch, capsys):
    recorder = Recorder(Result({"artifacts": ["a\x1b"]}, 0, ["warning"]))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    code, out, err = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {"job": "j7"}}))
    assert code == 0
    assert json.loads(out) == {
        "result": {"artifacts": ["a\x1b"]},
        "exit_code": 0,
        "messages": ["warning"],
        "error": None,
    }
    assert "the command's own chatter" in err and "chatter" not in out
    assert recorder.calls == [("local", "j7")]
    assert sys.stdout is not sys.stderr  # put back


def test_the_child_answers_a_real_command(monkeypatch, capsys, dynprof_dirs):
    code, out, _ = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {"job": "j"}}))
    assert code == 0 and json.loads(out)["result"]["artifacts"] == []


def test_a_bad_request_ends_the_child_with_2_and_a_line(monkeypatch, capsys):
    code, out, err = _child(monkeypatch, capsys, '{"action": "rm -rf", "options": {}}')
    assert (code, out) == (2, "")
    assert err == "dynprof: bad action request: no known action\n"


@pytest.mark.parametrize("action", [{"ls": 1}, ["ls"], 7, None])
def test_a_request_whose_action_is_not_a_name_ends_the_child_with_2_and_a_line(monkeypatch, capsys, action):
    code, out, err = _child(monkeypatch, capsys, json.dumps({"action": action, "options": {}}))
    assert (code, out) == (2, "")
    assert err == "dynprof: bad action request: no known action\n"


def test_an_answer_over_the_bound_is_refused_as_an_error(monkeypatch, capsys):
    # GIVEN a command whose answer is 4 MiB, over a bound of 3 MiB
    recorder = Recorder(Result({"big": "x" * (4 << 20)}))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    monkeypatch.setattr(sa, "MAX_OUTPUT_BYTES", 3 << 20)
    code, out, _ = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {}}))
    doc = json.loads(out)
    assert code == 0 and doc["result"] is None and doc["exit_code"] == 1
    assert doc["error"]["message"] == "the answer of ls is over 3 MiB: refused"
    assert "--job" in doc["error"]["help"]


def test_an_answer_is_strict_json_even_of_odd_values(monkeypatch, capsys):
    recorder = Recorder(Result({"nan": float("nan"), "set": {1}}))
    monkeypatch.setattr(sa, "action_commands", recorder.table)
    code, out, _ = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {}}))
    assert code == 0
    doc = json.loads(out, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert doc["error"] is None and doc["result"]["nan"] is None
