"""`dynprof run` options of the hang watchdog."""

from __future__ import annotations

import argparse

import pytest

from dynprof import errors
from dynprof.cli import _run_hang


def _args(**kw) -> argparse.Namespace:
    base = {"hang_timeout": None, "hang_first_step_timeout": None, "quiet": True}
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
