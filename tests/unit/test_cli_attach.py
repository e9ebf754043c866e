"""dynprof.cli.attach: `dynprof attach` without a debugger (dynprof.attach's attach and job search
replaced): its options and their usage errors, the settings it hands the agent, one pid or many
or a job's, and what it says about each (text on stderr, the report with --json)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from dynprof import errors
from dynprof.attach import AttachOptions, AttachResult, JobProcess, JobSearch
from dynprof.cli import attach as attach_cli
from dynprof.cli import main
from dynprof.result import Result

ESC = "\x1b[2J"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dynprof attach")
    attach_cli.AttachCommand().prepare_parser(parser)
    return parser.parse_args(argv)


class FakeAttach:
    """attach(): each pid's answer (a result, or the error it raises), the calls remembered."""

    def __init__(self, fails: dict[int, errors.DynprofError] | None = None) -> None:
        self.fails = fails or {}
        self.calls: list[tuple[int, AttachOptions]] = []

    def __call__(self, pid: int, options: AttachOptions) -> AttachResult:
        self.calls.append((pid, options))
        if pid in self.fails:
            raise self.fails[pid]
        return AttachResult(pid=pid, status="attached", method="remote-exec", seconds=0.5, log=f"/run/{pid}.log")


@pytest.fixture
def fake(monkeypatch):
    def install(fails=None, job=None):
        fake_attach = FakeAttach(fails)
        monkeypatch.setattr(attach_cli, "attach", fake_attach)
        if job is not None:
            monkeypatch.setattr(attach_cli, "find_job_processes", lambda name: job if name == job.job else None)
        return fake_attach

    return install


# -- options ---------------------------------------------------------------------------------------
def test_the_defaults_and_the_run_options_it_takes():
    args = _parse(["5"])
    assert args.pids == [5] and args.job is None and args.json is False
    assert (args.method, args.wait, args.ready_timeout) == ("auto", 2.0, 30.0)
    # the memory and hang options of `dynprof run` apply to a running process ...
    args = _parse(["5", "--memory-history", "off", "--hang-timeout", "60"])
    assert args.memory_history == "off" and args.hang_timeout == 60.0


@pytest.mark.parametrize("option", ["--flight-recorder", "--gpu-coredump", "--job-id"])
def test_the_run_options_read_at_process_start_are_not_taken(option, capsys):
    # ... those read when the process starts (NCCL's flight recorder, the GPU core dump) are not
    with pytest.raises(SystemExit) as info:
        _parse(["5", option, "1"])
    assert info.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_attach_usage_errors(capsys):
    assert main(["attach"]) == 2
    assert "give either PIDs or --job JOB" in capsys.readouterr().err
    assert main(["attach", "1", "--memory-history", "lots"]) == 2
    assert "--memory-history" in capsys.readouterr().err


def test_pids_and_a_job_together_are_a_usage_error(capsys, fake):
    attached = fake()
    assert main(["attach", "5", "--job", "j"]) == 2
    err = capsys.readouterr().err
    assert "give either PIDs or --job JOB" in err and "dynprof attach --job J" in err
    assert attached.calls == []


@pytest.mark.parametrize("method", ["ptrace", "", "GDB"])
def test_an_unknown_method_is_refused_by_the_parser(method, capsys):
    with pytest.raises(SystemExit) as info:
        main(["attach", "5", "--method", method])
    assert info.value.code == 2
    assert "--method" in capsys.readouterr().err


def test_a_pid_that_is_not_positive_from_another_parser_is_a_usage_error(fake):
    # collect() is also given namespaces the CLI's parser did not make
    args = _parse(["5"])
    args.pids = [5, 0]
    with pytest.raises(errors.UsageError) as info:
        attach_cli.AttachCommand().collect(args)
    assert info.value.message == "invalid pid 0: a pid is a positive integer"


# -- the settings and options the agent gets ---------------------------------------------------------
def test_the_run_options_become_the_agents_settings():
    args = _parse(["5", "--memory-history", "state", "--hang-timeout", "30", "--memory-oom-max", "0"])
    assert attach_cli.attach_settings(args) == {
        "DYNPROF_MEMORY_HISTORY": "state",
        "DYNPROF_MEMORY_OOM_MAX": "0",
        "DYNPROF_HANG_TIMEOUT": "30.0",
    }
    assert attach_cli.attach_settings(_parse(["5"])) == {}


def test_the_attach_options_carry_method_waits_and_settings():
    args = _parse(["5", "--method", "gdb", "--wait", "0.5", "--ready-timeout", "12"])
    options = attach_cli.attach_options(args, {"A": "1"})
    assert options == AttachOptions(method="gdb", settings={"A": "1"}, main_thread_wait_s=0.5, ready_timeout_s=12.0)


@pytest.mark.parametrize(("wait", "ready"), [(0.0, 30.0), (2.0, -1.0)])
def test_waits_that_are_not_positive_are_a_usage_error(wait, ready):
    args = argparse.Namespace(method="auto", wait=wait, ready_timeout=ready)
    with pytest.raises(errors.UsageError) as info:
        attach_cli.attach_options(args, {})
    assert "--wait and --ready-timeout" in info.value.message


@pytest.mark.parametrize("value", ["0", "nan", "x"])
def test_waits_are_checked_by_the_parser_too(value, capsys):
    with pytest.raises(SystemExit) as info:
        _parse(["5", "--wait", value])
    assert info.value.code == 2
    assert "--wait" in capsys.readouterr().err


# -- one pid -----------------------------------------------------------------------------------------
def test_one_pid_is_attached_and_said_on_stderr(fake, capsys):
    attached = fake()
    assert main(["attach", "4242", "--memory-history", "off"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "dynprof: pid 4242: attached (sys.remote_exec, 0.50 s): agent ready, log /run/4242.log\n"
    [(pid, options)] = attached.calls
    assert pid == 4242 and options.settings == {"DYNPROF_MEMORY_HISTORY": "off"}


def test_one_pid_that_fails_is_the_commands_error(fake, capsys):
    fake({7: errors.PtraceRefused("ptrace of 7 refused", help="set ptrace_scope")})
    assert main(["attach", "7"]) == 11
    err = capsys.readouterr().err
    assert "dynprof: error: ptrace of 7 refused" in err and "what to do: set ptrace_scope" in err


def test_one_pid_that_fails_with_json_is_a_json_error(fake, capsys):
    fake({7: errors.NotPython("7 is not a Python process")})
    assert main(["attach", "7", "--json"]) == 10
    error = json.loads(capsys.readouterr().out)["error"]
    assert (error["type"], error["message"], error["exit_code"]) == ("NotPython", "7 is not a Python process", 10)


def test_json_reports_each_process_and_says_nothing_on_stderr(fake, capsys):
    fake()
    assert main(["attach", "4242", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    [row] = doc["processes"]
    assert row["pid"] == 4242 and row["status"] == "attached" and row["method"] == "remote-exec"
    assert row["log"] == "/run/4242.log" and "job" not in doc
    assert err == ""


# -- several pids ------------------------------------------------------------------------------------
def test_several_pids_are_each_attached_once_and_an_error_does_not_end_the_command(fake, capsys):
    attached = fake({6: errors.Unsupported("6 runs Python 2", help="use py-spy")})
    code = main(["attach", "5", "6", "5", "8"])
    err = capsys.readouterr().err
    # the first failure's code; the others still attached, each pid once, in the order given
    assert code == 7
    assert [pid for pid, _ in attached.calls] == [5, 6, 8]
    lines = err.splitlines()
    assert lines[0].startswith("dynprof: pid 5: attached")
    assert lines[1:3] == ["dynprof: pid 6: error: 6 runs Python 2", "  what to do: use py-spy"]
    assert lines[3].startswith("dynprof: pid 8: attached")


def test_several_pids_with_json_name_the_failed_one(fake, capsys):
    fake({6: errors.Timeout("no answer in 30 s")})
    assert main(["attach", "5", "6", "--json"]) == 9
    doc = json.loads(capsys.readouterr().out)
    assert doc["processes"][0]["status"] == "attached"
    assert doc["processes"][1] == {
        "pid": 6,
        "status": "failed",
        "error": {"type": "Timeout", "message": "no answer in 30 s", "help": errors.Timeout("x").help, "exit_code": 9},
    }


def test_attach_many_keeps_each_answer_in_order(fake):
    fake({2: errors.AgentError("boom")})
    got = attach_cli.attach_many([1, 2, 3], AttachOptions())
    assert [type(g).__name__ for g in got] == ["AttachResult", "AgentError", "AttachResult"]
    assert [g.pid for g in got if isinstance(g, AttachResult)] == [1, 3]


def test_what_is_said_of_each_pid():
    result = AttachResult(pid=3, status="already", method="none", activation="run")
    assert attach_cli.said(3, result, many=False) == "pid 3: already has a dynprof agent (started by run); nothing done"
    # an error alone is the command's own error: not said twice
    assert attach_cli.said(3, errors.AgentError("bad"), many=False) is None
    assert attach_cli.said(3, errors.AgentError("bad"), many=True) == "pid 3: error: bad"
    assert attach_cli.said(3, errors.AgentError("bad", help="retry"), many=True) == (
        "pid 3: error: bad\n  what to do: retry"
    )


def test_the_text_is_all_on_stderr():
    assert attach_cli.AttachCommand().render(Result({"processes": []})) == ""


# -- a job -------------------------------------------------------------------------------------------
def _job(name: str, pids: list[int], skipped: list[tuple[int, str]] = ()) -> JobSearch:
    found = [
        JobProcess(pid=p, ppid=1, matched="SLURM_JOB_ID", rank=i, cmdline=["python", "train.py"])
        for i, p in enumerate(pids)
    ]
    return JobSearch(
        name, found, [(JobProcess(pid=p, ppid=1, matched="SLURM_JOB_ID", rank=None), why) for p, why in skipped]
    )


def test_a_job_with_no_process_here_is_exit_3(fake, capsys):
    attached = fake(job=_job("j1", []))
    assert main(["attach", "--job", "j1"]) == 3
    err = capsys.readouterr().err
    assert "no Python process of job 'j1' found on this node (for this user)" in err
    assert "dynprof attach PID" in err
    assert attached.calls == []


def test_a_jobs_processes_are_found_attached_and_named_by_the_job(fake, capsys):
    attached = fake(job=_job("j1", [os.getpid()], skipped=[(77, "not Python")]))
    assert main(["attach", "--job", "j1", "--memory-history", "off", "--json"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["job"] == "j1" and doc["found"] == [os.getpid()]
    assert doc["skipped"] == [{"pid": 77, "why": "not Python"}]
    assert [r["status"] for r in doc["processes"]] == ["attached"]
    [(_, options)] = attached.calls
    assert options.settings == {"DYNPROF_MEMORY_HISTORY": "off", "DYNPROF_JOB_ID": "j1"}
    # the search's own lines are said with --json too
    assert f"dynprof: job j1: found 1 process(es): pid {os.getpid()} (rank 0, SLURM_JOB_ID): python train.py" in err
    assert "dynprof: job j1: skipped pid 77: not Python" in err


def test_a_jobs_command_lines_and_reasons_are_shown_escaped(fake, capsys):
    search = _job("j1", [os.getpid()], skipped=[(77, f"odd {ESC}")])
    search.found[0].cmdline = ["python", f"{ESC}evil\nline"]
    fake(job=search)
    assert main(["attach", "--job", "j1"]) == 0
    err = capsys.readouterr().err
    assert ESC not in err and "\\x1b[2J" in err
    assert "evil\\nline" in err


def test_a_job_process_that_exited_meanwhile_is_gone_not_failed(fake, monkeypatch, capsys):
    # GIVEN two processes of the job: one attached, one that exited during its attach
    fake(fails={999_999: errors.ProcessNotFound("no process with pid 999999")}, job=_job("j1", [os.getpid(), 999_999]))
    monkeypatch.setattr(attach_cli, "_exited", lambda pid, result: pid == 999_999)
    # WHEN the job is attached
    assert main(["attach", "--job", "j1"]) == 0
    # THEN the command succeeds and says so
    assert "dynprof: job j1: pid 999999 exited meanwhile (gone, not a failure)" in capsys.readouterr().err
    assert main(["attach", "--job", "j1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["processes"][1] == {"pid": 999_999, "status": "gone"}


def test_a_job_process_that_fails_and_lives_is_a_failure(fake, monkeypatch, capsys):
    fake(fails={os.getpid(): errors.AgentError("agent did not start")}, job=_job("j1", [1, os.getpid()]))
    assert main(["attach", "--job", "j1"]) == 8
    err = capsys.readouterr().err
    assert "dynprof: pid 1: attached" in err
    assert f"dynprof: pid {os.getpid()}: error: agent did not start" in err
    assert "exited meanwhile" not in err


def test_the_one_process_of_a_job_that_fails_says_why(fake, capsys):
    fake(
        fails={os.getpid(): errors.AgentError("agent did not start", help="see its log")}, job=_job("j1", [os.getpid()])
    )
    assert main(["attach", "--job", "j1"]) == 8
    err = capsys.readouterr().err
    assert f"dynprof: pid {os.getpid()}: error: agent did not start\n  what to do: see its log" in err
    assert "exited meanwhile" not in err


# -- _exited ----------------------------------------------------------------------------------------
def test_a_result_is_never_exited():
    assert attach_cli._exited(os.getpid(), AttachResult(pid=1, status="attached", method="gdb")) is False


def test_a_live_process_has_not_exited():
    assert attach_cli._exited(os.getpid(), errors.AgentError("x")) is False


def test_a_reaped_process_has_exited():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert attach_cli._exited(child.pid, errors.AgentError("x")) is True


def test_a_zombie_has_exited():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it has exited, unreaped
            with open(f"/proc/{child.pid}/stat", "rb") as fh:
                stat = fh.read()
            if stat[stat.rfind(b")") + 2 :].startswith(b"Z"):
                break
            time.sleep(0.02)
        else:
            pytest.fail("the child did not exit")
        assert attach_cli._exited(child.pid, errors.AgentError("x")) is True
    finally:
        child.wait()


def test_another_users_process_is_not_taken_for_gone(monkeypatch):
    def kill(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(attach_cli.os, "kill", kill)
    assert attach_cli._exited(1, errors.PermissionDenied("x")) is False
