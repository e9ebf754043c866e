"""DDP, FSDP2 (``fully_shard``) and DeepSpeed's ZeRO engine on gloo, two ranks launched by torchrun
under `dynprof run`."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]


class TestDistributed(FrameworkChecks):
    CASES = [
        Case("fsdp2", "dist_program.py", ("--mode", "fsdp2", "--step-sleep", "0.005"), ranks=2),
        Case("ddp", "dist_program.py", ("--mode", "ddp", "--step-sleep", "0.005"), ranks=2, ci=False),
        # DeepSpeed is not among CI's packages: on demand, where it is installed
        Case(
            "deepspeed_zero2",
            "deepspeed_program.py",
            ("--zero", "2", "--step-sleep", "0.005"),
            ranks=2,
            needs=("deepspeed",),
            ci=False,
        ),
    ]
