"""Lightning ``Trainer.fit`` on CPU, with gradient accumulation."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]


class TestLightning(FrameworkChecks):
    CASES = [
        Case(
            "lightning",
            "lightning_program.py",
            ("--accum", "2", "--step-sleep", "0.01"),
            needs=("lightning|pytorch_lightning",),
        )
    ]
