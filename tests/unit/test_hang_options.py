"""`dynprof run` options of the hang watchdog and the flight recorder."""

from __future__ import annotations

import argparse

import pytest

from dynprof import errors
from dynprof.cli import _run_flight, _run_hang


def _args(**kw) -> argparse.Namespace:
    base = {"hang_timeout": None, "hang_first_step_timeout": None, "flight_recorder": None, "quiet": True}
    base.update(kw)
    return argparse.Namespace(**base)


def test_hang_timeout_sets_the_agent_variables():
    env: dict[str, str] = {}
    _run_hang.apply(_args(hang_timeout=30, hang_first_step_timeout=600), env)
    assert env == {"DYNPROF_HANG_TIMEOUT": "30.0", "DYNPROF_HANG_FIRST_STEP_TIMEOUT": "600.0"}


@pytest.mark.parametrize(
    "kw", [{"hang_timeout": 0}, {"hang_timeout": -1}, {"hang_timeout": float("nan")}, {"hang_first_step_timeout": 5}]
)
def test_bad_hang_options_are_usage_errors(kw):
    with pytest.raises(errors.UsageError):
        _run_hang.apply(_args(**kw), {})


def test_flight_recorder_sets_buffer_dump_and_pipe(dynprof_dirs):
    env = {"DYNPROF_JOB_ID": "job1"}
    _run_flight.apply(_args(flight_recorder=300), env)
    assert env["DYNPROF_FLIGHT_RECORDER"] == "300"
    buffers = [env[v] for v in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE") if v in env]
    assert buffers and set(buffers) == {"300"}
    dumps = [v for v in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE") if v in env]
    assert dumps and env[dumps[0]].startswith(str(dynprof_dirs["artifacts"] / "job1"))
    assert (dynprof_dirs["artifacts"] / "job1").is_dir()


def test_flight_recorder_size_is_checked():
    with pytest.raises(errors.UsageError):
        _run_flight.apply(_args(flight_recorder=0), {"DYNPROF_JOB_ID": "j"})
