"""DDP and FSDP2 (``fully_shard``) on gloo, two ranks launched by torchrun under `dynprof run`."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]


class TestDistributed(FrameworkChecks):
    CASES = [
        Case("fsdp2", "dist_program.py", ("--mode", "fsdp2", "--step-sleep", "0.005"), ranks=2),
        Case("ddp", "dist_program.py", ("--mode", "ddp", "--step-sleep", "0.005"), ranks=2, ci=False),
    ]
