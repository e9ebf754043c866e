"""A child process whose output lines a thread collects while it runs."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path


def start_in_session(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    """``argv`` in a session of its own (its group is its pid), its stdout and stderr one text pipe."""
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(cwd), start_new_session=True
    )


class LineReader:
    """``proc``'s stdout (text, piped) read line by line into ``lines``, as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
