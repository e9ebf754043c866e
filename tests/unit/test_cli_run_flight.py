"""`dynprof run --flight-recorder [N]`: the variables that turn on PyTorch's flight recorder in
the job's environment, its dumps in the store and its pipes in the runtime directory."""

from __future__ import annotations

import argparse
import socket

import pytest

from collectors import flight_recorder as fr
from dynprof import errors
from dynprof.cli import _run_flight


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"flight_recorder": None, "quiet": True, **kw})


def test_flight_recorder_sets_buffer_dump_and_pipe(dynprof_dirs):
    env = {"DYNPROF_JOB_ID": "job1"}
    _run_flight.apply(_args(flight_recorder=300), env)
    assert env["DYNPROF_FLIGHT_RECORDER"] == "300"
    buffers = [env[v] for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") if v in env]
    assert buffers and set(buffers) == {"300"}
    dumps = [v for v in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE") if v in env]
    assert dumps and env[dumps[0]].startswith(str(dynprof_dirs["artifacts"] / "job1"))
    assert (dynprof_dirs["artifacts"] / "job1").is_dir()


def test_dumps_go_under_the_jobs_host_and_pipes_under_the_run_dir(dynprof_dirs):
    env = {"DYNPROF_JOB_ID": "job1"}
    _run_flight.apply(_args(flight_recorder=10), env)
    dump_dir = dynprof_dirs["artifacts"] / "job1" / socket.gethostname() / ".flight-recorder"
    assert dump_dir.is_dir()
    pipe_dir = dynprof_dirs["run"] / "flight" / "job1"
    assert pipe_dir.is_dir() and (pipe_dir.stat().st_mode & 0o077) == 0
    every = fr.recorder_environment(
        10, str(dump_dir / "nccl_trace_rank_"), str(pipe_dir / "rank_"), fr.detect_environment()
    )
    assert {k: env[k] for k in every} == every


def test_a_job_without_id_is_nojob(dynprof_dirs):
    env: dict[str, str] = {}
    _run_flight.apply(_args(flight_recorder=5), env)
    assert (dynprof_dirs["artifacts"] / "nojob").is_dir()
    assert (dynprof_dirs["run"] / "flight" / "nojob").is_dir()


@pytest.mark.parametrize("entries", [0, -1, _run_flight.MAX_ENTRIES + 1])
def test_flight_recorder_size_is_checked(entries):
    with pytest.raises(errors.UsageError, match="--flight-recorder takes"):
        _run_flight.apply(_args(flight_recorder=entries), {"DYNPROF_JOB_ID": "j"})


def test_without_the_option_nothing_is_set(dynprof_dirs):
    env = {"DYNPROF_JOB_ID": "j"}
    _run_flight.apply(_args(), env)
    assert env == {"DYNPROF_JOB_ID": "j"}
    assert not (dynprof_dirs["run"] / "flight").exists()


def test_the_option_alone_takes_the_default_size():
    parser = argparse.ArgumentParser()
    _run_flight.add_arguments(parser)
    assert parser.parse_args(["--flight-recorder"]).flight_recorder == fr.DEFAULT_ENTRIES
    assert parser.parse_args(["--flight-recorder", "7"]).flight_recorder == 7
    assert parser.parse_args([]).flight_recorder is None


def test_not_quiet_says_how_many_entries(dynprof_dirs, capsys):
    _run_flight.apply(_args(flight_recorder=42, quiet=False), {"DYNPROF_JOB_ID": "j"})
    assert "dynprof: flight recorder:" in capsys.readouterr().err
