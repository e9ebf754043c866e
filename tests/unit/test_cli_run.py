"""`dynprof run`: the environment the command is started in (the agent's start-up hook first on
PYTHONPATH, one job id for all ranks: the user's, the scheduler's or a generated one), and what
it refuses before it replaces itself with the command."""

from __future__ import annotations

import argparse
import os
import socket

import pytest

from dynprof.cli import main
from dynprof.cli.run import BOOTSTRAP_DIR, RunCommand, build_environment, generated_job_id
from tests.support.records import agent_record


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    RunCommand().prepare_parser(parser)
    return parser.parse_args([*argv, "--", "python", "train.py"])


def test_the_start_up_hook_goes_first_on_pythonpath_once():
    env = build_environment(_args(), {"PYTHONPATH": f"/mine{os.pathsep}{BOOTSTRAP_DIR}{os.pathsep}"})
    assert env["DYNPROF"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(BOOTSTRAP_DIR), "/mine"]
    assert (BOOTSTRAP_DIR.parent / "__init__.py").is_file()
    assert env["DYNPROF_HOME"] == str(BOOTSTRAP_DIR.parent.parent)


@pytest.mark.parametrize(
    ("argv", "base", "job"),
    [
        (["--job-id", "mine"], {"SLURM_JOB_ID": "7", "DYNPROF_JOB_ID": "set"}, "mine"),
        ([], {"DYNPROF_JOB_ID": "set", "SLURM_JOB_ID": "7"}, "set"),
        ([], {"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "elastic"}, "7"),
        ([], {"TORCHELASTIC_RUN_ID": "elastic"}, "elastic"),
    ],
)
def test_the_job_id_is_the_users_then_the_schedulers(argv, base, job):
    assert build_environment(_args(*argv), base)["DYNPROF_JOB_ID"] == job


def test_without_any_id_one_is_generated_from_host_and_pid():
    job = build_environment(_args(), {"TORCHELASTIC_RUN_ID": "none"})["DYNPROF_JOB_ID"]
    assert job.startswith(socket.gethostname().split(".")[0] + "-") and job.endswith(f"-{os.getpid()}")
    assert generated_job_id().endswith(f"-{os.getpid()}")


def test_the_callers_environment_is_kept_and_not_changed():
    base = {"KEEP": "1"}
    env = build_environment(_args(), base)
    assert env["KEEP"] == "1" and base == {"KEEP": "1"}


def test_no_command_is_a_usage_error(capsys):
    assert main(["run", "--"]) == 2
    assert "no command given" in capsys.readouterr().err


def test_an_unknown_command_is_a_usage_error(capsys):
    assert main(["run", "--", "no-such-command-dynprof-test"]) == 2
    assert "command not found: no-such-command-dynprof-test" in capsys.readouterr().err


def test_a_run_dir_too_long_for_sockets_is_refused_before_the_command_runs(monkeypatch, tmp_path, capsys):
    long_dir = tmp_path / ("d" * 100)
    monkeypatch.setenv("DYNPROF_RUN_DIR", str(long_dir))
    assert main(["run", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert "too long a path" in err and "DYNPROF_RUN_DIR" in err


def _bash_reads(word: str) -> str:
    """What bash gives a command for ``word`` pasted onto its command line."""
    import subprocess

    got = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True, check=True).stdout
    return os.fsdecode(got)


def test_a_job_id_that_is_not_utf8_is_shown_as_recorded_with_a_ps_line_that_finds_it(monkeypatch, capsys):
    from dynprof.identity import detect

    ran = {}
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: ran.update(env=env))
    # GIVEN a job id holding the byte 0xff (os.environ and argv carry it as '\udcff')
    raw = os.fsdecode(b"bad\xff")
    # WHEN dynprof run starts a command under it
    assert main(["run", "--job-id", raw, "--", "true"]) == 0
    err = capsys.readouterr().err
    # THEN the banner shows the id as the agents record it, says why, and gives a ps line
    recorded = detect(ran["env"]).job_id
    assert recorded == "bad\\xff"
    assert "dynprof: job bad\\xff: agent enabled for true" in err
    assert "the job id is not UTF-8" in err and "\udcff" not in err
    assert "`dynprof ps --job 'bad\\xff'`" in err
    # and that line, pasted into a shell, selects the recorded job, as the raw bytes do
    pasted = _bash_reads("'bad\\xff'")
    seen = []
    monkeypatch.setattr("dynprof.job.ps.list_records", lambda: [_record(recorded), _record("other")])
    monkeypatch.setattr("dynprof.job.ps.agent_rows", lambda records, timeout: seen.append(records) or [])
    for spelling in (pasted, raw):
        main(["ps", "--job", spelling])
    assert [[r.job_id for r in records] for records in seen] == [[recorded], [recorded]]


def _record(job: str):
    return agent_record(1, ppid=0, rank=0, world_size=1, job_id=job, socket="/s", log="/l")


def test_a_utf8_job_id_keeps_its_plain_banner(monkeypatch, capsys):
    monkeypatch.setattr(os, "execvpe", lambda exe, cmd, env: None)
    # GIVEN a plain id WHEN run THEN the banner is the two lines it always was
    assert main(["run", "--job-id", "j1", "--", "true"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "dynprof: job j1: agent enabled for true",
        "dynprof: see it with `dynprof ps --job j1`",
    ]
