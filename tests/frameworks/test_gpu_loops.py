"""The crash-prone loops on CUDA (run on a GPU machine: `pytest -m gpu tests/frameworks`):
activation checkpointing, and a job with its own profiler recording CUDA activity."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]


class TestCudaLoops(FrameworkChecks):
    CASES = [
        Case("checkpoint_cuda", "checkpoint_program.py", ("--device", "cuda", "--step-sleep", "0.002"), gpu=True),
        Case(
            "own_profiler_cuda",
            "own_profiler_program.py",
            ("--device", "cuda", "--step-sleep", "0.005"),
            gpu=True,
            own_profiler=True,
        ),
    ]
