"""Hugging Face Trainer on a tiny random-init GPT-2: plain, with gradient checkpointing and
accumulation, and a second Trainer (new optimizer) in the same process."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(600)]

NEEDS = ("transformers", "accelerate")


class TestHFTrainer(FrameworkChecks):
    CASES = [
        Case("hf_ckpt_accum", "hf_trainer_program.py", ("--grad-ckpt", "--accum", "2"), needs=NEEDS),
        Case("hf_plain", "hf_trainer_program.py", ("--step-sleep", "0.01"), needs=NEEDS, ci=False),
        Case(
            "hf_two_trainers",
            "hf_trainer_program.py",
            ("--trainers", "2", "--stage-steps", "150", "--step-sleep", "0.03"),
            needs=NEEDS,
            plain_steps=170,
            wait_for="STAGE 2",
            ci=False,
        ),
    ]
