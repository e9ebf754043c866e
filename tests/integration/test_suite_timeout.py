"""The suite's own safety net: a test that times out shows where its child processes were stuck."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

HANGING_TEST = r"""
import subprocess, sys, time

def test_waits_on_a_stuck_child():
    code = "import time\ndef stuck_in_the_child():\n    time.sleep(120)\nstuck_in_the_child()"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        child.wait()
    finally:
        child.kill()
        child.wait()
"""


def test_a_timed_out_test_dumps_its_childrens_stacks(tmp_path):
    # GIVEN a test (under this suite's conftest) that waits on a child stuck in a function, with
    # a short pytest-timeout
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_hangs.py").write_text(HANGING_TEST)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}

    # WHEN it runs into its timeout
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "8", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        env=env,
        timeout=240,
    )

    # THEN it fails as timed out, after `dynprof stacks` showed where the child was stuck
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-3000:]
    assert "Timeout: stacks of the 1 processes this test started" in out, out[-3000:]
    assert "stuck_in_the_child" in out, out[-3000:]
    assert "Timeout (>8.0s) from pytest-timeout" in out, out[-3000:]
