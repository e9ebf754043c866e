"""What the store's unit tests share (tests/unit/test_store*.py): stores and artifacts made on
disk for them, and the other user they play."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import time
from pathlib import Path

import pytest

from dynprof.store import MANIFEST, ArtifactStore, safe_segment

STORE_MARKER = ".dynprof-store"  # the name is part of the store's format
OTHER_UID = 4242
SECRET = "dynprof-secret-" + hashlib.sha256(b"outside the store").hexdigest()[:16]
HOUR_AGO = time.time() - 2 * 3600

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (os.chown)")


def host() -> str:
    return safe_segment(socket.gethostname())


def old_tmp_dir(parent: Path, name: str = ".x.123@456.tmp") -> Path:
    """A directory shaped like a stale temporary, an hour and more old."""
    d = parent / name
    d.mkdir(parents=True)
    (d / "data").write_text("someone's data\n")
    os.utime(d, (HOUR_AGO, HOUR_AGO))
    return d


def a_capture(store: ArtifactStore, job: str = "j") -> Path:
    w = store.create("trace", job=job, rank=0)
    w.write_text("notes.txt", "hello")
    return w.finish().path


def outside_artifact(where: Path) -> Path:
    """A directory outside the store that looks like a finished artifact and holds a secret."""
    where.mkdir(parents=True, exist_ok=True)
    data = (SECRET + "\n").encode()
    (where / "secret.txt").write_bytes(data)
    manifest = {
        "schema": "dynprof.artifact",
        "schema_version": 1,
        "kind": "trace",
        "status": "complete",
        "created_at": "2026-01-01T00:00:00.000Z",
        "files": [{"name": "secret.txt", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
    }
    (where / MANIFEST).write_text(json.dumps(manifest))
    return where


def mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def tmp_dirs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp") if p.is_dir()]
