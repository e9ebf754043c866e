"""scripts/enumerate_gpu_waits.py on a machine without CUDA: it says so and exits 0, and the
suite's list it hands the GPU tests is read back from the enumeration's file, bounded."""

from __future__ import annotations

import json
from types import SimpleNamespace

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


def test_the_recorder_names_the_operator_that_raises_at_its_sync_and_runs_it_again():
    # GIVEN the recorder, under torch's "error" sync mode (simulated: an operator that raises
    # torch's error at its synchronize while the check is on, and another that does not)
    pytest.importorskip("torch")
    modes: list[str] = ["error"]

    class Op:
        def __init__(self, name: str, syncs: bool) -> None:
            self.overloadpacket = SimpleNamespace(__name__=name)
            self.syncs = syncs
            self.calls = 0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            if self.syncs and modes[-1] == "error":
                raise RuntimeError("called a synchronizing CUDA operation")
            return 42

    recorder = script._recorder(modes.append)
    item, add = Op("_local_scalar_dense", True), Op("add", False)
    # WHEN each is dispatched through it
    got = [recorder.__torch_dispatch__(op, ()) for op in (add, item, item)]
    # THEN the one that synchronizes is named once, each still returns its result (run again with
    # the check off, then back on), and the other is run once and not named
    assert got == [42, 42, 42]
    assert recorder.ops == ["_local_scalar_dense"]
    assert add.calls == 1 and item.calls == 4
    assert modes == ["error", "default", "error", "default", "error"]


def test_the_recorder_lets_other_errors_through():
    pytest.importorskip("torch")

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    recorder = script._recorder(lambda mode: None)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        recorder.__torch_dispatch__(broken, ())
    assert recorder.ops == []
