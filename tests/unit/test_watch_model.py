"""The watch's documents read back from untrusted input: bounded, typed, never a traceback."""

from __future__ import annotations

import pytest

from dynprof.errors import ArtifactError
from dynprof.watch.model import MAX_RANKS_PER_NODE, Culprit, NodeProgress, RankProgress, Verdict


def test_progress_round_trip_and_hostile_rows():
    # GIVEN a progress document with one good row and rows of the wrong types
    good = RankProgress(job="j", rank=3, world_size=8, pid=42, host="n1", step=7, last_step_age_s=1.5)
    doc = NodeProgress(host="n1", time=1.0, poll_every_s=2.0, ranks=[good]).to_json()
    doc["ranks"] += [
        "x",
        {"pid": "1", "job": "j"},
        {"pid": 5, "job": "j", "step": float("nan"), "last_step_age_s": float("inf"), "agent": "pwned", "rank": True},
    ]
    # WHEN it is read back
    back = NodeProgress.from_json(doc)
    # THEN the good row is intact, the bad ones are dropped or cleaned
    assert back.ranks[0] == good
    odd = back.ranks[1]
    assert (odd.pid, odd.step, odd.last_step_age_s, odd.agent, odd.rank) == (5, 0, None, "error", None)
    assert back.truncated == 2


def test_progress_bounds_rows_and_refuses_other_documents():
    rows = [{"pid": i, "job": "j"} for i in range(MAX_RANKS_PER_NODE + 10)]
    doc = {"schema": "dynprof.progress", "schema_version": 1, "ranks": rows}
    back = NodeProgress.from_json(doc)
    assert len(back.ranks) == MAX_RANKS_PER_NODE and back.truncated == 10
    with pytest.raises(ArtifactError, match="version 2 is not read"):
        NodeProgress.from_json({**doc, "schema_version": 2})
    with pytest.raises(ArtifactError, match="not a progress document"):
        NodeProgress.from_json([1, 2])


def test_verdict_round_trip_and_unknown_kind():
    v = Verdict(
        kind="hang",
        job="j",
        conclusion="rank 3 on n1 is in load (data.py:8)",
        detected_at=1.0,
        decided_at=2.0,
        culprits=[Culprit(rank=3, host="n1", where="load (data.py:8)", why="not in all_reduce")],
        evidence={"stacks": {"groups": []}, "junk": "dropped"},
    )
    back = Verdict.from_json(v.to_json())
    assert back.culprits == v.culprits and back.conclusion == v.conclusion
    assert "junk" not in back.evidence and "stacks" in back.evidence
    with pytest.raises(ArtifactError, match="unknown kind"):
        Verdict.from_json({**v.to_json(), "kind": "boom"})


def test_a_ranks_gpu_step_and_gpu_reading_round_trip_and_are_bounded():
    # GIVEN a row with the GPU's side of its step and its device's NVML reading
    from dynprof.watch.model import GpuReading, GpuStep

    good = RankProgress(
        job="j",
        rank=1,
        world_size=2,
        pid=42,
        host="n1",
        gpu_step=GpuStep(step=199, done=False, age_s=40.5, device=0, device_uuid="GPU-abc", coredump_armed=True),
        gpu=GpuReading(
            index=1, utilization_pct=100, used_bytes=44 << 30, total_bytes=141 << 30, process_bytes=40 << 30
        ),
    )
    doc = NodeProgress(host="n1", time=1.0, poll_every_s=2.0, ranks=[good]).to_json()
    # THEN it reads back as it was
    assert NodeProgress.from_json(doc).ranks[0] == good
    # WHEN the fields are hostile: wrong types, out of range, overlong
    row = dict(doc["ranks"][0])
    hostile = [
        ({"step": -1, "done": False, "age_s": 1.0}, None),
        ({"step": 5, "done": "no", "age_s": 1.0}, None),
        ({"step": 5, "done": True, "age_s": float("nan")}, None),
        ({"step": 5, "done": True, "age_s": -3.0}, None),
        ({"step": True, "done": True, "age_s": 1.0}, None),
        ("junk", None),
        (
            {"step": 5, "done": True, "age_s": 2.0, "device": -4, "device_uuid": "G" * 5000, "coredump_armed": "yes"},
            GpuStep(step=5, done=True, age_s=2.0, device=None, device_uuid="G" * 100),
        ),
    ]
    for given, expected in hostile:
        back = NodeProgress.from_json({**doc, "ranks": [{**row, "gpu_step": given}]}).ranks[0]
        # THEN a step that is not one is dropped, and its parts are cut to their bounds
        assert back.gpu_step == expected, given
    gpu = {
        "index": 1 << 40,
        "utilization_pct": 101,
        "used_bytes": -1,
        "total_bytes": 1 << 61,
        "process_bytes": "40",
        "note": "n" * 5000,
    }
    back = NodeProgress.from_json({**doc, "ranks": [{**row, "gpu": gpu}]}).ranks[0]
    assert back.gpu == GpuReading(note="n" * 300)
    assert NodeProgress.from_json({**doc, "ranks": [{**row, "gpu": [1]}]}).ranks[0].gpu is None
