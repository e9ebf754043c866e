"""`python -m dynprof ARGS` run as a real subprocess, from the repository's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_dynprof(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``dynprof ARGS`` with exactly ``env``, to its end (or ``timeout``); its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "dynprof", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(ROOT),
    )
