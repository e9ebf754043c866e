"""dynprof's JSON outputs are strict JSON (no NaN or Infinity), and a failed registry write leaves
nothing half-written behind."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from dynprof import jsontext, registry
from dynprof.registry import AgentRecord
from dynprof.store import ArtifactStore
from tests.support.records import agent_record


def _strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null_at_any_depth():
    # GIVEN values a crafted trace or a failed measurement can hold
    obj = {"a": float("nan"), "b": [1.5, float("inf"), {"c": -float("inf")}], "d": (float("nan"),), "e": "NaN"}

    # WHEN they are written
    text = jsontext.dumps(obj, indent=2)

    # THEN a strict reader takes it, with null where the number was not finite
    assert _strict(text) == {"a": None, "b": [1.5, None, {"c": None}], "d": [None], "e": "NaN"}


def test_a_manifest_and_a_json_file_of_an_artifact_are_strict_json(tmp_path):
    # GIVEN an artifact whose summary and one of its files hold non-finite figures
    store = ArtifactStore(tmp_path / "store")
    writer = store.create("healthcheck", job="j", host="h", rank=None, pid=1, options={})
    writer.write_json("report.json", {"bandwidth_gbps": float("nan")})

    # WHEN it is finished
    art = writer.finish("complete", summary={"tflops": float("inf")})

    # THEN both files are strict JSON
    assert _strict((art.path / "manifest.json").read_text())["summary"] == {"tflops": None}  # type: ignore[index]
    assert _strict((art.path / "report.json").read_text()) == {"bandwidth_gbps": None}


def _record(pid: int) -> AgentRecord:
    return agent_record(pid, job_id="j")


def test_a_registry_write_on_a_full_run_directory_leaves_no_temporary_file(tmp_path, monkeypatch):
    # GIVEN a run directory whose filesystem is full
    def full(self: Path, *args: object, **kwargs: object) -> int:
        with open(self, "w") as fh:
            fh.write("")  # the file is created, its content is not
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)

    # WHEN the agent writes its record
    with pytest.raises(OSError):
        registry.write_record(_record(4242), directory=tmp_path)

    # THEN neither the record nor a 0-byte temporary is left
    assert sorted(p.name for p in tmp_path.iterdir()) == []
