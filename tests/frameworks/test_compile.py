"""``torch.compile`` of the model and of the optimizer step (CPU inductor: compiling takes
30-60 s on two cores, so this runs on demand only)."""

from __future__ import annotations

import pytest
from _checks import FrameworkChecks
from _scenario import Case

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(900)]


class TestCompile(FrameworkChecks):
    CASES = [Case("compile", "compile_program.py", ("--step-sleep", "0.005"), ci=False, slow=True)]
