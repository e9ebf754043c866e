"""dynprof.sidecar.child: the child process of an action that runs apart from the sidecar. One
action's answer (its row's collect, or job-wide its row's job-wide function), the child's entry
point (run here in-process: its request on stdin, its answer on stdout) against requests that
are wrong on purpose, and the sidecar's side (a child's answer read, a child killed)."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import threading

import pytest

from dynprof import errors
from dynprof.node_requests import LsRequest
from dynprof.result import Result
from dynprof.sidecar import child
from dynprof.sidecar.actions import Checked, run_action
from dynprof.sidecar.table import ACTIONS
from tests.support.waiting import wait_for


# -- one answer ---------------------------------------------------------------------------------------
def test_an_answer_is_the_commands_json_result(dynprof_dirs):
    answer = child.answer("ls", {"job": "j"}, None, None)
    assert answer["error"] is None and answer["exit_code"] == 0 and answer["messages"] == []
    assert answer["result"]["artifacts"] == []


def test_a_refused_option_is_answered_as_a_structured_error():
    answer = child.answer("ls", {"limit": "x"}, None, None)
    assert answer["result"] is None and answer["exit_code"] == 2 and answer["messages"] == []
    assert answer["error"]["type"] == "UsageError"
    assert answer["error"]["message"] == "ls: option 'limit' must be an integer"


def test_a_refused_healthcheck_option_is_its_could_not_run():
    answer = child.answer("healthcheck", {"level": "thorough"}, None, None)
    assert answer["exit_code"] == 3 and answer["error"]["type"] == "UsageError"
    assert answer["error"]["message"].startswith("healthcheck: --level 'thorough'")


def test_a_refused_link_test_is_answered_before_any_worker_starts():
    answer = child.answer("link-test", {"rank": 1, "store_host": "gpu01", "store_port": 22}, None, None)
    assert answer["exit_code"] == 2 and "no privileged port" in answer["error"]["message"]


def test_a_command_of_this_node_only_is_never_job_wide():
    answer = child.answer("healthcheck", {}, ["node-1"], None)
    assert answer["exit_code"] == 2
    assert answer["error"]["message"] == "healthcheck runs on this node only"


class Recorder:
    """The ``ls`` row, its collect and its job-wide function recording what they were given."""

    def __init__(self, result: Result | Exception) -> None:
        self.result = result
        self.calls: list[tuple[str, object]] = []

    def install(self, monkeypatch) -> None:
        def local(request):
            self.calls.append(("local", request.job))
            print("the command's own chatter")
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

        def job(options, node_list, reach):
            self.calls.append(("nodes", [str(n) for n in node_list]))
            self.reach = reach
            return self.result

        row = dataclasses.replace(ACTIONS["ls"], decode=LsRequest.from_json, collect=local, job=job)
        monkeypatch.setattr(child, "ACTIONS", {**ACTIONS, "ls": row})


@pytest.fixture
def clients(monkeypatch):
    """The sidecars' clients a job-wide answer makes: (token file, CA file) each."""
    made = []

    def client_of(token_file, cacert, *rest):
        made.append((token_file, cacert))
        return "a client"

    monkeypatch.setattr(child, "client_of", client_of)
    return made


def test_a_job_wide_answer_asks_the_hosts_it_was_given(monkeypatch, clients):
    recorder = Recorder(Result({"ok": 1}, 12, ["node b: refused"]))
    recorder.install(monkeypatch)
    answer = child.answer("ls", {"job": "j"}, ["node-a", "node-b:9000"], None)
    assert recorder.calls == [("nodes", ["node-a:8787", "node-b:9000"])]
    assert answer == {"result": {"ok": 1}, "exit_code": 12, "messages": ["node b: refused"], "error": None}


def test_a_job_wide_answer_reaches_the_nodes_with_the_sidecars_token_and_ca_file(monkeypatch, clients):
    recorder = Recorder(Result({}))
    recorder.install(monkeypatch)
    child.answer("ls", {"job": "j"}, ["node-a"], "/etc/ca.pem")
    assert recorder.calls == [("nodes", ["node-a:8787"])]
    # the token of $DYNPROF_TOKEN_FILE (the sidecar gives its own), the CA file it was given,
    # nothing fetched, no progress
    assert clients == [(None, "/etc/ca.pem")]
    assert recorder.reach.client == "a client" and recorder.reach.fetch is None and not recorder.reach.progress


def test_a_job_wide_option_the_request_refuses_is_a_usage_error_before_any_node_is_asked(monkeypatch, clients):
    answer = child.answer("stacks", {"job": "j", "method": "gdb"}, ["node-a"], None)
    assert answer["exit_code"] == 2 and "unknown method 'gdb'" in answer["error"]["message"]
    assert clients == []


def test_a_dynprof_error_of_the_command_is_the_answers_error(monkeypatch):
    recorder = Recorder(errors.NoAgent("no agent of job 'j'", help="attach one"))
    recorder.install(monkeypatch)
    answer = child.answer("ls", {"job": "j"}, None, None)
    assert answer == {
        "result": None,
        "exit_code": 5,
        "messages": [],
        "error": {"type": "NoAgent", "message": "no agent of job 'j'", "help": "attach one", "exit_code": 5},
    }


# -- the child's request ------------------------------------------------------------------------------
def test_a_request_is_read_as_it_was_written():
    doc = {"action": "memory-plan", "options": {"job": "j"}, "hosts": ["node-1"], "cacert": "/etc/ca.pem"}
    assert child.read_request(json.dumps(doc)) == doc
    # no hosts: this node's answer
    assert child.read_request(json.dumps({"action": "ls", "options": {}})) == {
        "action": "ls",
        "options": {},
        "hosts": None,
        "cacert": None,
    }


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("x" * (child.MAX_REQUEST_CHARS + 1), "over 1 MiB"),
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
        child.read_request(text)
    assert str(info.value) == said


@pytest.mark.parametrize("action", [{"ls": 1}, ["ls"]])
def test_an_unhashable_action_is_refused_with_why(action):
    with pytest.raises(ValueError) as info:
        child.read_request(json.dumps({"action": action, "options": {}}))
    assert str(info.value) == "no known action"


@pytest.mark.parametrize("text", ["", "{", "nul\x00", '{"action": "ls", "options": {}} trailing'])
def test_text_that_is_not_json_is_a_value_error(text):
    with pytest.raises(ValueError):
        child.read_request(text)


# -- the child ------------------------------------------------------------------------------------------
def _child(monkeypatch, capsys, text: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    code = child.main()
    out, err = capsys.readouterr()
    return code, out, err


def test_the_child_writes_one_json_answer_and_the_commands_prints_go_to_stderr(monkeypatch, capsys):
    recorder = Recorder(Result({"artifacts": ["a\x1b"]}, 0, ["warning"]))
    recorder.install(monkeypatch)
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
    recorder.install(monkeypatch)
    monkeypatch.setattr(child, "MAX_OUTPUT_BYTES", 3 << 20)
    code, out, _ = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {}}))
    doc = json.loads(out)
    assert code == 0 and doc["result"] is None and doc["exit_code"] == 1
    assert doc["error"]["message"] == "the answer of ls is over 3 MiB: refused"
    assert "--job" in doc["error"]["help"]


def test_an_answer_is_strict_json_even_of_odd_values(monkeypatch, capsys):
    recorder = Recorder(Result({"nan": float("nan"), "set": {1}}))
    recorder.install(monkeypatch)
    code, out, _ = _child(monkeypatch, capsys, json.dumps({"action": "ls", "options": {}}))
    assert code == 0
    doc = json.loads(out, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    assert doc["error"] is None and doc["result"]["nan"] is None


# -- the sidecar's side ----------------------------------------------------------------------------
def _children_run(monkeypatch, script: str) -> None:
    """Every child the sidecar starts runs the shell ``script`` instead of the action."""
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        return real_popen(["sh", "-c", script], **kwargs)

    monkeypatch.setattr(child.subprocess, "Popen", popen)
    monkeypatch.setattr(child, "_closing", False)


def test_stopping_kills_running_children_and_starts_no_more(monkeypatch):
    # GIVEN an action whose child (and its own child) would run for ten minutes
    _children_run(monkeypatch, "sleep 600 & wait")
    answers = []
    worker = threading.Thread(target=lambda: answers.append(child.run_child("healthcheck", Checked({}), 60)))
    worker.start()
    wait_for(lambda: child._children, 600, "the action's child started")
    # WHEN the sidecar stops
    assert child.kill_children() == 1
    worker.join(300)
    # THEN the action has ended (its child would have run for 600 s), answered "killed", and no
    # new child starts
    assert not worker.is_alive() and answers
    assert answers[0].exit_code == 9 and "stopped" in answers[0].messages[0]
    assert child.run_child("healthcheck", Checked({}), 60).exit_code == 9
    assert not child._children


def test_a_child_writes_the_result_as_json(dynprof_dirs):
    # GIVEN an artifact in the store WHEN ls runs in an action's child process
    from dynprof.store import ArtifactStore

    writer = ArtifactStore().create("trace", job="j", rank=0)
    writer.finish("complete")
    outcome = child.run_child("ls", Checked({"job": "j"}), 120)
    # THEN the child's answer is the listing
    assert outcome.exit_code == 0 and outcome.messages == [] and outcome.error is None, outcome
    assert [a["kind"] for a in outcome.result["artifacts"]] == ["trace"]


def test_a_childs_error_is_structured():
    outcome = child.child_answer(
        "healthcheck",
        json.dumps(
            {
                "result": None,
                "exit_code": 3,
                "messages": [],
                "error": {"type": "Unsupported", "message": "no NVML", "help": "install it", "exit_code": 3},
            }
        ),
        0,
        3,
    )
    assert outcome.exit_code == 3 and outcome.error == {
        "type": "Unsupported",
        "message": "no NVML",
        "help": "install it",
        "exit_code": 3,
    }
    assert outcome.messages == ["dynprof: error: no NVML", "  what to do: install it"]
    broken = child.child_answer("healthcheck", "Traceback ...", 1, 3)
    assert broken.exit_code == 3 and "ended without an answer" in broken.error["message"]


def test_a_healthcheck_killed_by_a_signal_says_so_with_a_documented_code(monkeypatch):
    # GIVEN a healthcheck whose process is killed by SIGKILL (the OOM killer, say)
    _children_run(monkeypatch, "kill -9 $$")
    # WHEN the action runs
    answer = run_action("healthcheck", {})
    # THEN it answers "could not run" (3, in healthcheck's documented set) and says why
    assert answer["exit_code"] == 3, answer
    assert "killed by SIGKILL" in answer["error"]["message"], answer
    assert answer["messages"][0].startswith("dynprof: error: healthcheck could not finish")
