"""`dynprof stacks --merge` of a crafted 64 MiB file costs bounded memory: the file is read piece
by piece and the decoder keeps no more than its budget (a whole-file JSON parse of such a file
took over 3 GB)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

FILE_BYTES = 64 << 20
PEAK_RSS_BOUND = 200 << 20
HEAD = b'{"schema": "dynprof.stacks", "schema_version": 2, "processes": ['


def _fill(path: Path, head: bytes, item: Callable[[int], bytes], tail: bytes) -> Path:
    """``head``, then ``item(0), item(1), ...`` separated by commas, then ``tail``: 64 MiB at most."""
    with open(path, "wb") as fh:
        fh.write(head)
        written, i = len(head), 0
        while True:
            chunk = item(i)
            if written + len(chunk) + 1 + len(tail) > FILE_BYTES:
                break
            fh.write((b"," if i else b"") + chunk)
            written += len(chunk) + 1
            i += 1
        fh.write(tail)
    return path


def _one_endless_stack(path: Path) -> Path:
    return _fill(path, HEAD + b'{"pid": 1, "main_thread": {"frames": [', lambda i: b"{}", b"]}}]}")


def _many_different_frames(path: Path) -> Path:
    def row(pid: int) -> bytes:
        frames = b",".join(
            b'{"function": "f%d", "file": "/a.py", "line": %d}' % (pid * 1000 + j, j) for j in range(1000)
        )
        return b'{"pid": %d, "main_thread": {"frames": [%s]}}' % (pid, frames)

    return _fill(path, HEAD, row, b"]}")


# The command runs under a small fresh interpreter: a child forked from this (large) test process
# would count the pages it shares with it before its exec in its own peak.
_MEASURE = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read()
_, status, usage = os.wait4(proc.pid, 0)
sys.stderr.buffer.write(err)
print(os.waitstatus_to_exitcode(status), usage.ru_maxrss * 1024)
"""


def _peak_rss_of(argv: list[str]) -> tuple[int, int, bytes]:
    """Exit code, peak resident memory (bytes) and stderr of a command."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *argv], capture_output=True, timeout=600, check=True)
    code, peak = out.stdout.split()
    return int(code), int(peak), out.stderr


@pytest.mark.parametrize(
    "craft", [_one_endless_stack, _many_different_frames], ids=["endless-stack", "different-frames"]
)
def test_merge_of_a_crafted_64_mib_file_stays_under_200_mb(tmp_path: Path, craft: Callable[[Path], Path]) -> None:
    # GIVEN a crafted stacks document of 64 MiB
    path = craft(tmp_path / "stacks.node-x.json")
    assert FILE_BYTES - (1 << 20) < path.stat().st_size <= FILE_BYTES
    # WHEN it is merged
    code, peak, err = _peak_rss_of([sys.executable, "-m", "dynprof", "stacks", "--merge", str(path), "--no-save"])
    path.unlink()
    # THEN the peak memory stays bounded, and the file is refused with a reason, no traceback
    assert peak < PEAK_RSS_BOUND, f"peak RSS {peak >> 20} MiB"
    assert b"Traceback" not in err and b"no stacks to merge" in err
    assert code == 1, err
