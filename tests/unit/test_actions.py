"""dynprof.sidecar.actions: options checked per action, slots, hard time limits, child process groups."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from dynprof.sidecar import actions
from dynprof.sidecar.actions import ActionError, ActionsBusy, ActionSlots, argv_for, effective_timeout, run_action


def test_options_become_one_flag_each_and_unknown_ones_are_refused():
    assert argv_for("start", {"job": "j", "steps": 3, "record_shapes": True, "with_stack": False}) == [
        "start",
        "--job=j",
        "--steps=3",
        "--record-shapes",
        "--json",
    ]
    assert argv_for("stacks", {"pid": [1, 2]}) == ["stacks", "--pid=1,2", "--json"]
    for name, params in (
        ("ps", {"output": "x"}),
        ("start", {"steps": "3"}),
        ("start", {"steps": True}),
        ("stacks", {"pid": ["1"]}),
        ("stacks", {"pid": []}),
        ("ps", {"job": "a\x00b"}),
        ("ps", {"job": "x" * 5000}),
        ("nope", {}),
    ):
        with pytest.raises(ActionError):
            argv_for(name, params)


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

    def slow(argv):
        release.wait(300)
        return 0, '{"late": true}', ""

    monkeypatch.setattr(actions, "run_captured", slow)
    slots = ActionSlots(1)
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


def test_an_own_timeout_option_is_capped_too(monkeypatch):
    seen = []
    monkeypatch.setattr(actions, "run_captured", lambda argv: (seen.append(argv), (0, "{}", ""))[1])
    run_action("ps", {"timeout": 1e9})
    assert f"--timeout={actions.ACTIONS['ps'].max_timeout_s!r}" in seen[0]
    run_action("ps", {})
    assert not any(a.startswith("--timeout") for a in seen[1])  # the command's own default stands
    run_action("start", {"pid": [1]})
    assert "--timeout=600.0" in seen[2]  # start waits for ever by itself: never over HTTP


def test_killing_a_child_kills_its_whole_process_group():
    # GIVEN a child in its own session that started a grandchild
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    # WHEN the group is killed
    actions._kill_group(proc)  # type: ignore[arg-type]
    proc.wait(timeout=10)
    # THEN the grandchild is gone too
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init; a zombie still answers kill(0)
            with open(f"/proc/{grandchild}/stat") as fh:
                if fh.read().split(") ", 1)[1].startswith("Z"):
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the grandchild outlived its group's kill")


def test_stopping_kills_running_children_and_starts_no_more(monkeypatch):
    # GIVEN an action whose child (and its own child) would run for ten minutes
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        return real_popen(["sh", "-c", "sleep 600 & wait"], **kwargs)

    monkeypatch.setattr(actions.subprocess, "Popen", popen)
    monkeypatch.setattr(actions, "_closing", False)
    answers = []
    worker = threading.Thread(target=lambda: answers.append(actions._run_child(["healthcheck", "--json"], 60)))
    worker.start()
    deadline = time.monotonic() + 60
    while not actions._children:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # WHEN the sidecar stops
    t0 = time.monotonic()
    assert actions.kill_children() == 1
    worker.join(120)
    # THEN the action ends at once (not when its child would have), answered "killed", and no
    # new child starts
    assert answers and answers[0][0] == 9 and "stopped" in answers[0][2]
    assert time.monotonic() - t0 < 300
    assert actions._run_child(["healthcheck"], 60)[0] == 9
    assert not actions._children


def test_a_command_knows_it_runs_as_an_action(monkeypatch):
    import dynprof.cli

    seen = []
    monkeypatch.setattr(dynprof.cli, "main", lambda argv: seen.append(actions.in_action()) or 0)
    assert not actions.in_action()
    run_action("ps", {})
    assert seen == [True] and not actions.in_action()


# -- job-wide actions: `hosts` ----------------------------------------------------------------------
def test_hosts_become_the_commands_own_hosts_flag():
    from dynprof.sidecar.actions import FanoutConfig

    fanout = FanoutConfig("/run/token", cacert="/etc/ca.pem")
    assert argv_for("stacks", {"job": "j", "hosts": ["node-1", "node-2:9000", "[::1]:8787"]}, fanout) == [
        "stacks",
        "--hosts=node-1,node-2:9000,[::1]:8787",
        "--cacert=/etc/ca.pem",
        "--job=j",
        "--json",
    ]
    for bad in (["a b"], ["a,b"], [], "node-1", [1], ["node:99999"], ["x/y"]):
        with pytest.raises(ActionError, match="hosts"):
            argv_for("ps", {"hosts": bad}, fanout)
    with pytest.raises(ActionError, match="does not reach other nodes"):
        argv_for("ps", {"hosts": ["node-1"]}, None)
    with pytest.raises(ActionError, match="this node only"):
        argv_for("healthcheck", {"hosts": ["node-1"]}, fanout)


def test_hosts_is_never_among_the_options_the_fan_out_forwards():
    # the fan-out sends a node exactly the action's options: `hosts` must not be one of them,
    # so a node asked by a fan-out never fans out again
    for name, action in actions.ACTIONS.items():
        assert "hosts" not in action.options, name
        assert "hostfile" not in action.options and "token_file" not in action.options, name
    assert {n for n, a in actions.ACTIONS.items() if a.fans_out} == {
        "ps",
        "ls",
        "stacks",
        "start",
        "stop",
        "memory",
        "nccl",
    }


def test_a_job_wide_action_runs_in_a_child_with_the_sidecars_token_file(monkeypatch):
    from dynprof.sidecar.actions import FanoutConfig

    calls = []

    def child(argv, timeout, extra_env=None):
        calls.append((argv, timeout, extra_env))
        return 0, '{"nodes": [], "agents": []}', ""

    monkeypatch.setattr(actions, "_run_child", child)
    monkeypatch.setattr(actions, "run_captured", lambda argv: pytest.fail("ran in the sidecar's process"))
    slots = ActionSlots(1, FanoutConfig("/run/dynprof/token"))
    answer = slots.run("ps", {"job": "j", "hosts": ["node-1", "node-2"]}, timeout=20)
    assert answer["exit_code"] == 0 and answer["result"] == {"nodes": [], "agents": []}
    ((argv, timeout, env),) = calls
    assert argv == ["ps", "--hosts=node-1,node-2", "--job=j", "--timeout=20.0", "--json"]
    assert env == {"DYNPROF_TOKEN_FILE": "/run/dynprof/token"} and timeout == 20.0
    assert slots._sem.acquire(blocking=False)  # the slot was given back
