"""Flight-recorder analysis on recorded dumps, the dump loader, and variable detection."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from collectors import flight_recorder as fr

DATA = Path(__file__).parent / "data"


def _entry(
    seq: int, name: str = "nccl:all_reduce", state: str = "completed", sizes=None, pg: str = "0", frames=None
) -> dict:
    return {
        "pg_id": int(pg),
        "process_group": [pg, "default_pg"],
        "collective_seq_id": seq,
        "profiling_name": name,
        "state": state,
        "input_sizes": sizes or [[1024]],
        "input_dtypes": ["Float"],
        "is_p2p": False,
        "retired": state == "completed",
        "frames": frames or [],
    }


def _doc(entries: list[dict], status: dict | None = None, ranks: str = "[0, 1, 2, 3]") -> dict:
    dump = {
        "version": "2.4",
        "entries": entries,
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
    }
    if status is not None:
        dump["pg_status"] = status
    return {"dumps": {"nccl": dump}}


def test_recorded_gloo_job_where_rank1_never_enters_the_all_reduce():
    # GIVEN the dumps recorded from a 2-rank gloo job (torch 2.13) where rank 1 sleeps before
    # the all_reduce that rank 0 waits in
    per_rank = {r: json.loads((DATA / f"fr_gloo_rank{r}.json").read_text()) for r in (0, 1)}

    # WHEN analysed
    (pg,) = fr.analyze(per_rank)["process_groups"]

    # THEN rank 0 waits in collective #8 and rank 1 is missing from it
    assert pg["hung"] and pg["waiting"] == [0] and pg["missing"] == [1]
    assert pg["collective_seq"] == 8
    assert pg["collective"].startswith("#8 gloo:all_reduce [[1024]]")
    assert [(r["rank"], r["last_enqueued"], r["last_completed"]) for r in pg["per_rank"]] == [(0, 8, 7), (1, 7, 7)]
    assert "missing: rank 1" in pg["verdict"] and "gloo:barrier" in pg["missing_last"]["1"]
    assert "HUNG: rank 0 wait in #8 gloo:all_reduce" in fr.render_analysis({"process_groups": [pg]})


def test_entries_alone_give_the_sequence_numbers_and_the_callers_frame():
    frames = [
        {"name": "all_reduce", "filename": "/venv/lib/python3.12/site-packages/torch/distributed/c10d.py", "line": 10},
        {"name": "train_step", "filename": "/job/train.py", "line": 42},
    ]
    done = [_entry(s) for s in (1, 2, 3)]
    per_rank = {r: _doc([*done, _entry(4, state="started", frames=frames)]) for r in (0, 1, 2)}
    per_rank[3] = _doc(done)
    (pg,) = fr.analyze(per_rank)["process_groups"]
    assert pg["waiting"] == [0, 1, 2] and pg["missing"] == [3] and pg["hung"]
    assert pg["per_rank"][0]["last_started"] == 4 and pg["per_rank"][3]["last_enqueued"] == 3
    assert "from train_step (/job/train.py:42)" in pg["collective"]


def test_mismatched_collective_and_missing_dump_are_reported():
    per_rank = {
        0: _doc([_entry(1), _entry(2, state="scheduled")]),
        1: _doc([_entry(1), _entry(2, name="nccl:all_gather", state="scheduled")]),
    }
    (pg,) = fr.analyze(per_rank)["process_groups"]
    assert pg["mismatched"] and pg["mismatched"][0]["rank"] == 1
    assert pg["no_dump"] == [2, 3]
    assert pg["hung"]


def test_all_completed_is_not_a_hang():
    per_rank = {
        r: _doc(
            [_entry(1), _entry(2)],
            status={"0": {"last_enqueued_collective": 2, "last_started_collective": 2, "last_completed_collective": 2}},
            ranks="[0, 1]",
        )
        for r in (0, 1)
    }
    (pg,) = fr.analyze(per_rank)["process_groups"]
    assert not pg["hung"] and pg["verdict"] == "all ranks completed collective #2"


def test_dump_loader_reads_pickle_and_json_and_refuses_classes():
    doc = {"version": "2.4", "entries": [{"collective_seq_id": 1}]}
    assert fr.load_dump_bytes(pickle.dumps(doc, protocol=2)) == doc
    assert fr.load_dump_bytes(json.dumps(doc).encode()) == doc
    with pytest.raises(pickle.UnpicklingError):
        fr.load_dump_bytes(pickle.dumps({"x": Path("/")}))


def test_names_in_needs_the_whole_name():
    data = b"\0XTORCH_FR_BUFFER_SIZE\0TORCH_NCCL_DUMP_ON_TIMEOUT\0"
    assert fr.names_in(data, fr.KNOWN_VARS) == {"TORCH_NCCL_DUMP_ON_TIMEOUT"}


def test_environment_follows_what_this_torch_reads(tmp_path):
    det = fr.EnvDetection(
        torch_version="2.13", names={"TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}, detected=True
    )
    env = fr.recorder_environment(500, "/d/rank_", "/p/rank_", det)
    assert env == {"TORCH_FR_BUFFER_SIZE": "500", "TORCH_FR_DUMP_TEMP_FILE": "/d/rank_"}
    unknown = fr.recorder_environment(500, "/d/rank_", "/p/rank_", fr.EnvDetection(torch_version=None))
    assert set(unknown) == set(fr.KNOWN_VARS)


def test_detection_reads_the_installed_torch():
    _version, libs = fr.torch_libraries()
    if not libs:
        pytest.skip("torch is not installed here")
    det = fr.detect_environment()
    assert det.detected
    # Every torch with a flight recorder reads one of the buffer-size variables.
    assert det.names & set(fr.BUFFER_VARS), det
