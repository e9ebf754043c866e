"""`dynprof show ARTIFACT`: one artifact's manifest, files and contents, as text and as --json;
`--verify` checks each file against its recorded size and sha256."""

from __future__ import annotations

import json

from dynprof.cli import main
from dynprof.store import ArtifactStore


def _artifact(**options: object):
    w = ArtifactStore().create("trace", job="job-1", rank=3, options=options or None)
    w.write_text("notes.txt", "hello")
    return w.finish("complete")


def test_text_names_kind_status_job_rank_and_each_file(capsys):
    art = _artifact(steps=2, quiet=False)
    assert main(["show", str(art.path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trace artifact  {art.path}")
    assert "status   complete" in out
    assert "job      job-1" in out and "rank 3" in out
    assert "options  steps=2" in out and "quiet" not in out  # options at their defaults are left out
    file_line = next(line for line in out.splitlines() if line.startswith("  file     notes.txt  "))
    assert "sha256 " in file_line and file_line.endswith("…")
    assert "verify" not in out


def test_json_has_path_manifest_and_no_verify_unless_asked(capsys):
    art = _artifact()
    assert main(["show", art.id, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == str(art.path)
    assert doc["manifest"]["kind"] == "trace" and doc["manifest"]["job"] == "job-1"
    assert "verify" not in doc


def test_verify_ok_and_a_changed_file_exits_1(capsys):
    art = _artifact()
    assert main(["show", art.id, "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verify"] == "ok"
    (art.path / "notes.txt").write_text("changed!")
    assert main(["show", art.id, "--verify"]) == 1
    out = capsys.readouterr().out
    assert "verify   " in out and "notes.txt" in out.split("verify   ", 1)[1]
    assert main(["show", art.id, "--verify", "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["verify"]
    assert isinstance(problems, list) and problems


def test_control_characters_of_a_manifest_do_not_reach_the_terminal(capsys):
    w = ArtifactStore().create("trace", job="j\x1b[31mred", rank=0)
    art = w.finish("complete")
    assert main(["show", art.id]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "red" in out


def test_a_failed_capture_shows_its_error(capsys):
    w = ArtifactStore().create("trace", job="j", rank=0)
    art = w.finish("failed", error="the agent went away")
    assert main(["show", art.id]) == 0
    assert "status   failed  (the agent went away)" in capsys.readouterr().out


def test_an_unknown_artifact_is_exit_1(capsys):
    assert main(["show", "nope-nope"]) == 1
    assert "no artifact 'nope-nope'" in capsys.readouterr().err
