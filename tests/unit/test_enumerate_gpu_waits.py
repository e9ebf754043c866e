"""scripts/enumerate_gpu_waits.py on a machine without CUDA: it says so and exits 0, and the
suite's list it hands the GPU tests is read back from the enumeration's file, bounded."""

from __future__ import annotations

import json

import pytest

from scripts import enumerate_gpu_waits as script


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    # GIVEN no CUDA device
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "ways.json"
    # WHEN the script runs
    rc = script.main(["--out", str(out)])
    # THEN it exits 0, says there is no CUDA and which candidates the suite takes, and writes nothing
    said = capsys.readouterr().out
    assert rc == 0
    assert said.startswith("no CUDA here (torch ") and "nothing written" in said
    assert f"the suite takes all {len(script.IDIOMS)} candidates: item, " in said
    assert not out.exists()


def test_the_candidates_cover_every_kind_of_wait_a_loop_makes():
    # GIVEN the candidate idioms
    names = [i.name for i in script.IDIOMS]
    families = {i.family for i in script.IDIOMS}
    # THEN at least 20 distinct ways, of every kind the suite is asked for
    assert len(names) == len(set(names)) and len(names) >= 20
    assert families >= {
        "scalar read",
        "python condition",
        "formatting",
        "data-dependent shape",
        "host copy",
        "explicit wait",
        "full launch queue",
        "NCCL host wait",
    }
    # AND a way torch does not report is in the suite only by a contract that makes it a wait
    assert all(i.contract for i in script.IDIOMS if i.family in ("explicit wait", "full launch queue"))


def test_the_suite_is_the_enumeration_written_on_the_gpu_machine(tmp_path):
    # GIVEN an enumeration's file naming two known ways, one unknown, and a malformed row
    path = tmp_path / "ways.json"
    cases = [{"name": "item", "ops": ["_local_scalar_dense"]}, {"name": "nonzero"}, {"name": "rm -rf"}, {"x": 1}]
    path.write_text(json.dumps({"cases": cases}))
    # WHEN the suite reads it
    suite = script.suite_cases(path)
    # THEN only the known ways, as written
    assert [c["name"] for c in suite] == ["item", "nonzero"]
    assert suite[0]["ops"] == ["_local_scalar_dense"]


def test_without_the_file_the_suite_takes_the_candidates_expected_to_wait(tmp_path):
    # GIVEN no enumeration's file (or an unreadable one)
    (tmp_path / "bad.json").write_text("{not json")
    for path in (tmp_path / "none.json", tmp_path / "bad.json"):
        # WHEN the suite reads it
        names = [c["name"] for c in script.suite_cases(path)]
        # THEN every candidate but those torch is expected not to report
        assert "item" in names and "launch-queue-full" in names and "nccl-wait" in names
        assert "d2h-non-blocking" not in names
