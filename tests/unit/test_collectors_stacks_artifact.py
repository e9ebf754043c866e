"""collectors/stacks/artifact.py: a stacks artifact written (a dump per process, the merged view)
and read back, its files untrusted; the text `dynprof show` prints of a stacks or hang artifact."""

from __future__ import annotations

import json
import os
import types
from pathlib import Path

import pytest

from collectors.stacks.artifact import (
    load_processes,
    process_file_stem,
    render_artifact,
    unique_file_stems,
    write_request_artifact,
)
from collectors.stacks.model import Frame, ProcessStacks, ThreadStack
from dynprof.errors import ArtifactError

WAIT = [Frame("all_reduce", "/x/site-packages/torch/distributed/c10d.py", 10), Frame("main", "/job/t.py", 5)]
LOAD = [Frame("next_batch", "/job/data.py", 30), Frame("main", "/job/t.py", 5)]


class DirectoryWriter:
    """The two methods of an artifact writer the module uses, writing into a directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write_json(self, name: str, obj) -> None:
        (self.path / name).write_text(json.dumps(obj))

    def write_text(self, name: str, text: str) -> None:
        (self.path / name).write_text(text)


def _process(pid: int, rank: int | None, frames: list[Frame], host: str | None = None) -> ProcessStacks:
    return ProcessStacks(
        pid=pid,
        method="py-spy",
        rank=rank,
        host=host,
        threads=[
            ThreadStack(pid, "MainThread", main=True, frames=frames),
            ThreadStack(pid + 1, "loader", frames=[Frame("wait", "/job/d.py", 1, locals={"n": "2"})]),
        ],
    )


def test_a_file_stem_names_the_rank_where_known_and_the_pid():
    assert process_file_stem(_process(10, 2, [])) == "rank2-pid10"
    assert process_file_stem(_process(10, None, [])) == "pid10"


def test_the_same_rank_and_pid_on_two_nodes_get_distinct_stems_with_a_safe_host_name():
    # GIVEN rank 0 pid 10 on two nodes, the second node's name holding a slash and a space
    procs = [_process(10, 0, [], host="node-a"), _process(10, 0, [], host="../node b"), _process(10, 0, [])]
    # WHEN stems are chosen
    stems = unique_file_stems(procs)
    # THEN all differ, and the added host is a plain file name
    assert len(set(stems)) == 3
    assert stems[0] == "rank0-pid10"
    assert stems[1] == "rank0-pid10-.._node_b-1"
    assert stems[2] == "rank0-pid10-2"
    assert all("/" not in s for s in stems)


def test_an_artifact_written_reads_back_as_every_process_with_every_thread(tmp_path):
    # GIVEN three ranks waiting and one loading data, with a failure
    procs = [_process(100 + r, r, WAIT) for r in range(3)] + [_process(200, 3, LOAD)]
    # WHEN written into an artifact directory
    summary = write_request_artifact(DirectoryWriter(tmp_path), procs, {"rank 4": "gone"})
    # THEN the summary counts them, every dump file is there, and they read back whole
    assert (summary["processes"], summary["failed"], summary["groups"]) == (4, 1, 2)
    assert summary["methods"] == ["py-spy"]
    assert summary["lines"][0].startswith("ranks 0-2: in all_reduce")
    assert {"merged.json", "merged.txt", "rank3-pid200.json", "rank3-pid200.txt"} <= set(os.listdir(tmp_path))
    back = load_processes(tmp_path)
    assert sorted((p.rank, p.pid, len(p.threads)) for p in back) == [(0, 100, 2), (1, 101, 2), (2, 102, 2), (3, 200, 2)]
    loader = next(p for p in back if p.rank == 3).threads[1]
    assert loader.frames[0].locals == {"n": "2"}, "a dump keeps its locals"


def test_a_directory_without_stacks_files_has_no_processes(tmp_path):
    assert load_processes(tmp_path) == []


def test_a_single_dump_artifact_is_read_from_stacks_json(tmp_path):
    (tmp_path / "stacks.json").write_text(json.dumps(_process(5, None, WAIT).to_json()))
    assert [p.pid for p in load_processes(tmp_path)] == [5]


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd"])
def test_a_merged_entry_naming_a_file_outside_the_artifact_is_refused(tmp_path, name):
    # GIVEN a merged.json whose process row names a file outside the directory
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT)], {})
    doc = json.loads((tmp_path / "merged.json").read_text())
    doc["processes"][0]["file"] = name
    (tmp_path / "merged.json").write_text(json.dumps(doc))
    # WHEN read back
    # THEN it is refused as not a plain name
    with pytest.raises(ArtifactError, match="not a plain name"):
        load_processes(tmp_path)


def test_a_merged_entry_without_a_file_name_is_refused(tmp_path):
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT)], {})
    doc = json.loads((tmp_path / "merged.json").read_text())
    del doc["processes"][0]["file"]
    (tmp_path / "merged.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="an entry without a file name"):
        load_processes(tmp_path)


def test_a_damaged_dump_is_named_in_the_error(tmp_path):
    # GIVEN an artifact whose one dump is not a process dump
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT)], {})
    (tmp_path / "rank0-pid1.json").write_text("[]")
    # WHEN read back
    # THEN the error names the file and says why
    with pytest.raises(ArtifactError, match=r"rank0-pid1\.json in .*: not a stack dump"):
        load_processes(tmp_path)


def test_a_dump_behind_a_link_is_not_followed(tmp_path):
    # GIVEN an artifact whose dump file is a link to a file elsewhere
    art = tmp_path / "a"
    art.mkdir()
    write_request_artifact(DirectoryWriter(art), [_process(1, 0, WAIT)], {})
    (tmp_path / "elsewhere.json").write_text((art / "rank0-pid1.json").read_text())
    (art / "rank0-pid1.json").unlink()
    (art / "rank0-pid1.json").symlink_to(tmp_path / "elsewhere.json")
    # WHEN read back
    # THEN it is refused
    with pytest.raises(ArtifactError):
        load_processes(art)


def test_show_renders_a_stacks_artifact_as_the_merged_view(tmp_path):
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT), _process(2, 1, LOAD)], {})
    artifact = types.SimpleNamespace(path=str(tmp_path), kind="stacks", manifest={})
    summary, text = render_artifact(artifact)
    assert summary["processes"] == 2 and len(summary["groups"]) == 2
    assert text.startswith("2 process(es), 2 group(s) by main-thread stack")


def test_show_renders_a_hang_artifact_with_the_stall_and_each_main_threads_headline(tmp_path):
    # GIVEN a hang artifact of one process, its manifest saying when it stalled
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT)], {})
    manifest = {"summary": {"step": 41, "stalled_for_s": 300, "timeout_s": 120, "dump": "faulthandler"}}
    artifact = types.SimpleNamespace(path=str(tmp_path), kind="hang", manifest=manifest)
    # WHEN rendered
    summary, text = render_artifact(artifact)
    # THEN the text opens with the stall, then the headline, then the dump; the summary keeps the figures
    assert text.startswith("no optimizer step for 300 s after step 41 (timeout 120 s)\n\n")
    assert "main thread in all_reduce (torch/distributed/c10d.py:10) <- main (/job/t.py:5)" in text
    assert "rank 0 (pid 1) read with py-spy" in text
    assert (summary["step"], summary["stalled_for_s"], summary["timeout_s"], summary["dump"]) == (
        41,
        300,
        120,
        "faulthandler",
    )


def test_a_hang_artifact_without_a_summary_shows_question_marks(tmp_path):
    write_request_artifact(DirectoryWriter(tmp_path), [_process(1, 0, WAIT)], {})
    artifact = types.SimpleNamespace(path=str(tmp_path), kind="hang", manifest={})
    _, text = render_artifact(artifact)
    assert text.startswith("no optimizer step for ? s after step ? (timeout ? s)")
