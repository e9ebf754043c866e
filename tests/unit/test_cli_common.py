"""dynprof.cli._common: the option groups the commands share (--json, the targets, --attach), the
selection of the agents they name (and --attach's start of missing agents), and the progress
line on stderr."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

import dynprof.attach
from dynprof import errors
from dynprof.attach import AttachOptions, AttachResult, JobProcess, JobSearch
from dynprof.cli import _common, main


def _parser(required: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    _common.add_targets(parser, required=required)
    _common.add_attach_flag(parser)
    _common.add_json(parser)
    return parser


# -- option groups ------------------------------------------------------------------------------
def test_the_targets_are_one_of_pid_job_or_all():
    parser = _parser()
    args = parser.parse_args(["--pid", "12,13"])
    assert args.pid == [12, 13] and args.job is None and args.all is False
    assert args.attach is False and args.json is False
    args = parser.parse_args(["--job", "j-1", "--attach", "--json"])
    assert args.pid is None and args.job == "j-1" and args.attach is True and args.json is True
    assert parser.parse_args(["--all"]).all is True


@pytest.mark.parametrize(
    "argv",
    [[], ["--pid", "1", "--all"], ["--job", "j", "--pid", "3"], ["--pid", "x"], ["--pid", "0"], ["--pid", "1,,y"]],
)
def test_no_target_two_targets_or_a_bad_pid_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    assert "usage: t" in capsys.readouterr().err


def test_targets_may_be_optional():
    args = _parser(required=False).parse_args([])
    assert args.pid is None and args.job is None and args.all is False


def test_the_targets_given_are_a_requests_fields():
    parser = _parser(required=False)
    assert _common.targets_from_args(parser.parse_args(["--pid", "12,13"])) == {
        "pids": (12, 13),
        "job": None,
        "all": False,
    }
    assert _common.targets_from_args(parser.parse_args(["--job", "j-1"])) == {"pids": (), "job": "j-1", "all": False}
    assert _common.targets_from_args(parser.parse_args([])) == {"pids": (), "job": None, "all": False}


# -- target selection ------------------------------------------------------------------------------
def test_resolve_agents_asks_for_the_pids_or_the_job(monkeypatch):
    asked = []
    monkeypatch.setattr(_common, "resolve", lambda pids=None, job=None: asked.append((pids, job)) or ["rec"])
    monkeypatch.setattr(_common, "attach_first", lambda args: pytest.fail("no --attach: nothing is attached"))

    assert _common.resolve_agents(argparse.Namespace(pid=[5, 6], job=None, attach=False)) == ["rec"]
    assert _common.resolve_agents(argparse.Namespace(pid=None, job="j")) == ["rec"]
    # a command without target options at all (no attributes) asks for every agent
    assert _common.resolve_agents(argparse.Namespace()) == ["rec"]
    assert asked == [([5, 6], None), (None, "j"), (None, None)]


def test_resolve_agents_with_attach_attaches_first(monkeypatch):
    order = []
    monkeypatch.setattr(_common, "attach_first", lambda args: order.append("attach"))
    monkeypatch.setattr(_common, "resolve", lambda pids=None, job=None: order.append("resolve") or [])
    _common.resolve_agents(argparse.Namespace(pid=[1], job=None, attach=True))
    assert order == ["attach", "resolve"]


def test_a_request_is_made_before_attach_and_a_bad_one_attaches_nothing(monkeypatch):
    order = []
    monkeypatch.setattr(_common, "attach_first", lambda args: order.append("attach"))

    def make(args):
        order.append("request")
        if args.pid == [0]:
            raise errors.UsageError("a process id is 1-4194304")
        return "the request"

    assert _common.request_then_attach(argparse.Namespace(pid=[1], attach=True), make) == "the request"
    assert _common.request_then_attach(argparse.Namespace(pid=[1], attach=False), make) == "the request"
    assert order == ["request", "attach", "request"]
    with pytest.raises(errors.UsageError):
        _common.request_then_attach(argparse.Namespace(pid=[0], attach=True), make)
    assert order == ["request", "attach", "request", "request"]


@pytest.fixture
def attaching(monkeypatch):
    """dynprof.attach without a debugger: who has an agent, and the calls of attach()."""
    state = SimpleNamespace(calls=[], has_agent=set(), jobs={})

    def fake_attach(pid, options):
        state.calls.append((pid, options))
        return AttachResult(pid=pid, status="attached", method="gdb-pending-call", log=f"/run/{pid}.log")

    monkeypatch.setattr(dynprof.attach, "attach", fake_attach)
    monkeypatch.setattr(dynprof.attach, "existing_agent", lambda pid: "record" if pid in state.has_agent else None)
    monkeypatch.setattr(dynprof.attach, "find_job_processes", lambda job: JobSearch(job, state.jobs.get(job, []), []))
    monkeypatch.setattr(errors, "probe_pid", lambda pid: None)
    return state


def test_attach_first_with_all_is_a_usage_error(attaching):
    with pytest.raises(errors.UsageError) as info:
        _common.attach_first(argparse.Namespace(pid=None, job=None, all=True, attach=True))
    assert info.value.message == "--attach needs --pid or --job"
    assert "--all" in (info.value.help or "")
    assert attaching.calls == []


def test_attach_first_attaches_only_the_pids_without_an_agent(attaching, capsys):
    attaching.has_agent = {11}
    _common.attach_first(argparse.Namespace(pid=[10, 11, 12], job=None, all=False))
    assert [pid for pid, _ in attaching.calls] == [10, 12]
    assert all(isinstance(o, AttachOptions) and o.settings == {} for _, o in attaching.calls)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "dynprof: pid 10: attached (gdb, pending call, 0.00 s): agent ready, log /run/10.log",
        "dynprof: pid 12: attached (gdb, pending call, 0.00 s): agent ready, log /run/12.log",
    ]


def test_attach_first_by_job_names_the_job_in_each_agents_settings(attaching, capsys):
    attaching.jobs["j7"] = [JobProcess(pid=21, ppid=1, matched="SLURM_JOB_ID", rank=0), JobProcess(22, 1, "X", 1)]
    _common.attach_first(argparse.Namespace(pid=None, job="j7", all=False))
    assert [(pid, o.settings) for pid, o in attaching.calls] == [
        (21, {"DYNPROF_JOB_ID": "j7"}),
        (22, {"DYNPROF_JOB_ID": "j7"}),
    ]
    # each attach has a settings dict of its own (one changed leaves the others alone)
    assert attaching.calls[0][1].settings is not attaching.calls[1][1].settings


def test_attach_first_without_targets_does_nothing(attaching):
    _common.attach_first(argparse.Namespace())
    _common.attach_first(argparse.Namespace(pid=None, job=None, all=False))
    assert attaching.calls == []


def test_attach_first_stops_at_a_pid_that_is_gone(attaching, monkeypatch):
    def probe(pid):
        if pid == 99:
            raise errors.ProcessNotFound(f"no process with pid {pid}")

    monkeypatch.setattr(errors, "probe_pid", probe)
    with pytest.raises(errors.ProcessNotFound):
        _common.attach_first(argparse.Namespace(pid=[98, 99, 100], job=None, all=False))
    assert [pid for pid, _ in attaching.calls] == [98]


def test_attach_flag_needs_pid_or_job(capsys):
    # GIVEN --attach with --all (which selects processes that already have agents)
    code = main(["start", "--all", "--attach", "--steps", "1"])
    # THEN it is a usage error that says what --attach works with
    assert code == 2
    assert "--attach needs --pid or --job" in capsys.readouterr().err
