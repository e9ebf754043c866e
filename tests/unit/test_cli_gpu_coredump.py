"""`dynprof gpu-coredump`: reading a dump file (--read) and naming its kernels, the --yes it
takes before a destructive dump, its process-id checks, and the text of a dump."""

from __future__ import annotations

import json
import os

import pytest

from collectors import gpu_coredump as gc
from dynprof import errors
from dynprof.cli import main
from dynprof.cli.gpu_coredump import WHY_YES, render_dump, take
from tests.unit import _cudacore as cc


def _dump_file(tmp_path, data: bytes | None = None):
    path = tmp_path / "core.cuda.host.1"
    path.write_bytes(cc.dump() if data is None else data)
    return path


def test_read_names_the_running_kernels(tmp_path, capsys):
    assert main(["gpu-coredump", "--read", str(_dump_file(tmp_path))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2 kernels running on its GPU:"
    assert any("grid (1, 1, 1) block (1, 1, 1) on cuda:0, 2 warps resident, grid 7 active" in line for line in out)
    assert not any(line.startswith("dump kept in") for line in out)  # read only: nothing kept


def test_read_json_has_the_dump_and_no_artifact(tmp_path, capsys):
    assert main(["gpu-coredump", "--read", str(_dump_file(tmp_path)), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pid"] is None and doc["artifact"] is None
    assert [g["grid_id"] for g in doc["dump"]["grids"]] == [7, 8]


def test_a_file_that_is_no_dump_is_exit_1_with_why(tmp_path, capsys):
    assert main(["gpu-coredump", "--read", str(_dump_file(tmp_path, b""))]) == 1
    assert "empty" in capsys.readouterr().err


def test_a_dump_is_not_taken_without_yes(capsys):
    assert main(["gpu-coredump", "--pid", str(os.getpid())]) == 2
    err = capsys.readouterr().err
    assert "not taken" in err and "--yes" in err and WHY_YES.split(":")[0] in err


@pytest.mark.parametrize("pid", ["0", "-3", "abc", str(1 << 22)])
def test_a_bad_pid_is_refused_by_the_parser(pid):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-coredump", "--pid", pid, "--yes"])
    assert exc.value.code == 2


def test_pid_and_read_are_exclusive(tmp_path):
    with pytest.raises(SystemExit):
        main(["gpu-coredump", "--pid", "1", "--read", str(tmp_path / "x")])


@pytest.mark.parametrize(
    ("kind", "error"),
    [
        ("no-process", errors.ProcessNotFound),
        ("permission", errors.PermissionDenied),
        ("not-armed", errors.Unsupported),
        ("timeout", errors.Timeout),
        ("failed", errors.DynprofError),
    ],
)
def test_the_triggers_kinds_of_failure_become_exit_codes(monkeypatch, kind, error):
    def refuse(pid, timeout, progress=None):
        raise gc.TriggerError(f"process {pid}: {kind}", "Restart it.", kind=kind)

    monkeypatch.setattr(gc, "take", refuse)
    with pytest.raises(error, match=f"process 123: {kind}") as exc:
        take(123, 1.0)
    assert type(exc.value) is error and exc.value.help == "Restart it."


def test_a_dump_taken_but_unreadable_is_exit_1_and_says_where_it_is(monkeypatch):
    monkeypatch.setattr(
        gc, "take", lambda pid, timeout, progress=None: {"pid": pid, "artifact": "/s/a", "dump": None, "error": "bad"}
    )
    result = take(5, 1.0)
    assert result.exit_code == 1 and "/s/a" in result.messages[0] and "bad" in result.messages[0]
    assert render_dump(result.doc) == "bad"


def test_text_of_a_dump_without_running_kernels_and_with_notes():
    doc = {
        "pid": 42,
        "artifact": "/store/x",
        "dump": {"grids": [{"warps": 0, "status": "done"}], "notes": ["only one device"], "size_bytes": 10},
    }
    assert render_dump(doc).splitlines() == [
        "process 42: no kernel was running on its GPU when it was dumped",
        "  note: only one device",
        "dump kept in /store/x (10 bytes; cuda-gdb reads it too)",
    ]
