"""The CLI surface, in-process: arguments, JSON output, errors and exit codes."""

from __future__ import annotations

import json

import pytest

from dynprof.cli import main
from dynprof.store import ArtifactStore


def test_ls_json_on_an_empty_store(capsys, dynprof_dirs):
    assert main(["ls", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"root": str(dynprof_dirs["artifacts"]), "artifacts": [], "writing": [], "stale": [], "bad": []}


def test_ls_and_show_an_artifact(capsys):
    w = ArtifactStore().create("trace", job="j", rank=0)
    w.write_text("x.txt", "data")
    art = w.finish("partial")
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert art.id in out and "partial" in out
    assert main(["show", art.path.name, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "status   partial" in out and "verify   ok" in out and "x.txt" in out


def test_show_unknown_artifact_is_a_clear_error(capsys):
    assert main(["show", "does-not-exist"]) == 1
    err = capsys.readouterr().err
    assert "no artifact 'does-not-exist'" in err and "dynprof ls" in err


def test_json_errors_are_machine_readable(capsys):
    assert main(["show", "does-not-exist", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"]["type"] == "ArtifactError" and out["error"]["exit_code"] == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["start", "--pid", "abc", "--steps", "2"],
        ["start", "--pid", "1", "--steps", "2", "--duration", "1"],
        ["start", "--pid", "1", "--steps", "0"],
        ["start", "--steps", "2"],
        ["start", "--pid", "1", "--activities", "tpu"],
        ["start", "--pid", "1", "--duration", "inf"],
        ["start", "--pid", "1", "--duration", "nan"],
        ["start", "--pid", "1", "--duration", "-1"],
        ["start", "--pid", "1", "--max-duration", "inf"],
        ["start", "--pid", "1", "--max-duration", "1e12"],
        ["start", "--pid", "1", "--steps", "4294967296"],
        ["start", "--pid", "1", "--at-step", str(2**64)],
        ["start", "--pid", "1", "--at-step", "2**64"],
        ["start", "--pid", "99999999999", "--steps", "2"],
        ["serve", "--port", "99999"],
        ["serve", "--port", "-1"],
        ["serve", "--port", "0"],
        ["ps", "--timeout", "nan"],
        ["stop", "--all", "--timeout", "inf"],
        ["ls", "--limit", "-3"],
    ],
    ids=[
        "bad-pid",
        "two-bounds",
        "zero-steps",
        "no-target",
        "bad-activity",
        "duration-inf",
        "duration-nan",
        "duration-negative",
        "max-duration-inf",
        "max-duration-huge",
        "steps-over-uint32",
        "at-step-over-uint64",
        "at-step-expression",
        "pid-too-big",
        "port-too-big",
        "port-negative",
        "port-zero",
        "ps-timeout-nan",
        "stop-timeout-inf",
        "ls-limit-negative",
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_ps_with_no_agents(capsys):
    assert main(["ps"]) == 0
    out = capsys.readouterr().out
    assert "no dynprof agents on this node" in out and "dynprof run" in out


def test_start_all_with_no_agents_says_how_to_enable_one(capsys):
    assert main(["start", "--all", "--steps", "1"]) == 5
    err = capsys.readouterr().err
    assert "no dynprof agent is running" in err and "DYNPROF=1" in err


def test_cli_reference_is_current():
    # docs/cli.md is generated from the parser (python scripts/gen_cli_reference.py).
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, str(root / "scripts" / "gen_cli_reference.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
