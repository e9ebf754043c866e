"""`dynprof stacks --merge`: the `stacks --json` answers of several nodes in one grouped view."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from collectors.stacks import Frame, ProcessStacks, Source, Stacks, ThreadStack, from_json, group_processes, merge
from dynprof.cli import main
from dynprof.errors import ArtifactError

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
WAITING = [
    Frame("all_reduce", C10D, 2806),
    Frame("train_step", "/job/train.py", 40),
    Frame("main", "/job/train.py", 90),
]
ELSEWHERE = [
    Frame("load_batch", "/job/data.py", 12),
    Frame("train_step", "/job/train.py", 35),
    Frame("main", "/job/train.py", 90),
]


def _proc(rank: int, frames: list[Frame], host: str | None) -> ProcessStacks:
    pid = 1000 + rank % 8  # pids repeat across nodes
    return ProcessStacks(
        pid=pid, method="py-spy", rank=rank, job="J", host=host, threads=[ThreadStack(pid, main=True, frames=frames)]
    )


def _answer(processes: list[ProcessStacks]) -> dict[str, Any]:
    """What one node's `dynprof stacks --job J --json` prints (its stacks document)."""
    return {**merge([Source(Stacks(processes))]).to_json(), "artifact": None, "elapsed_s": 0.2}


def _merged(answers: list[Any], hosts: list[str | None]) -> dict[str, Any]:
    """The merge of the answers, each named by its host where its processes do not say."""
    return merge([Source(from_json(a), host=h) for a, h in zip(answers, hosts)]).to_json()


def _node(host: str | None, ranks: range, odd: int | None = None) -> list[ProcessStacks]:
    return [_proc(r, ELSEWHERE if r == odd else WAITING, host) for r in ranks]


def test_merge_names_the_odd_rank_with_its_host() -> None:
    # GIVEN two nodes' answers, 4 ranks each, rank 6 (on node-b) somewhere else
    answers = [_answer(_node(None, range(4))), _answer(_node(None, range(4, 8), odd=6))]
    # WHEN merged (the answers do not name their host: the caller does)
    merged = _merged(answers, ["node-a", "node-b"])
    # THEN one group of 7 over both nodes, and the outlier named with host and rank
    big, odd = merged["groups"]
    assert big["ranks"] == [0, 1, 2, 3, 4, 5, 7]
    assert big["label"] == "ranks 0-3 on node-a, ranks 4-5,7 on node-b"
    assert odd["outlier"] and odd["odd"] == ["rank 6 on node-b"]
    assert (odd["diverges_at"]["function"], odd["diverges_at"]["line"]) == ("train_step", 35)
    assert merged["hosts"] == ["node-a", "node-b"] and merged["failures"] == {}
    # and the merge can be merged again with the same result
    again = _merged([merged], [None])
    assert [g["label"] for g in again["groups"]] == [g["label"] for g in merged["groups"]]


def test_many_nodes_are_counted_not_listed() -> None:
    answers = [_answer(_node(None, range(8 * i, 8 * i + 8), odd=37)) for i in range(8)]
    merged = _merged(answers, [f"n{i}" for i in range(8)])
    assert merged["groups"][0]["label"] == "ranks 0-36,38-63 on 8 nodes"
    assert merged["groups"][1]["odd"] == ["rank 37 on n4"]


def test_answers_with_hosts_and_main_threads_and_duplicates() -> None:
    # GIVEN answers whose rows carry host and main thread, one of them given twice
    rows = [
        {
            "pid": 7,
            "rank": 0,
            "host": "x",
            "method": "agent",
            "main_thread": {"tid": 7, "frames": [f.to_json() for f in WAITING]},
        },
        {
            "pid": 7,
            "rank": 1,
            "host": "y",
            "method": "py-spy",
            "main_thread": {"tid": 7, "frames": [f.to_json() for f in ELSEWHERE]},
        },
    ]
    answer = {
        "schema": "dynprof.stacks",
        "schema_version": 2,
        "processes": rows,
        "groups": [],
        "failures": {"rank 2 (pid 9)": "timed out"},
    }
    merged = _merged([answer, answer], ["x", "x"])
    # THEN each (host, pid) once; the failures of each node kept with the node named
    assert [(p["host"], p["rank"]) for p in merged["processes"]] == [("x", 0), ("y", 1)]
    assert merged["failures"] == {"rank 2 (pid 9) on x": "timed out"}


@pytest.mark.parametrize(
    "answer",
    [
        [],
        {"processes": "no"},
        {"processes": [1, "x", None, {"pid": "7"}, {"pid": True}]},
        {"processes": [{"pid": 3, "main_thread": {"frames": [{"function": "f" * 100_000, "line": "x"}, 5]}}]},
    ],
)
@pytest.mark.parametrize("schema", [{}, {"schema": "dynprof.stacks", "schema_version": 2}], ids=["bare", "v2"])
def test_hostile_answers_do_not_crash(answer: Any, schema: dict[str, Any]) -> None:
    try:
        merged = _merged([{**schema, **answer} if isinstance(answer, dict) else answer], ["h"])
    except ArtifactError as exc:
        assert "not a dynprof stacks document" in exc.message
        return
    for p in merged["processes"]:
        for f in p["main_thread"]["frames"]:
            assert len(f["function"]) <= 2000 and isinstance(f["line"], int)


# -- the command -----------------------------------------------------------------------------------
def _write(path: Path, answer: Any) -> str:
    path.write_text(json.dumps(answer))
    return str(path)


def test_merge_command(tmp_path: Path, capsys: Any) -> None:
    # GIVEN the files of the Slurm recipe: stacks.$(hostname).json on each node, plus bad ones
    a = _write(tmp_path / "stacks.node-a.json", _answer(_node(None, range(4))))
    b = _write(tmp_path / "stacks.node-b.json", _answer(_node(None, range(4, 8), odd=6)))
    garbage = tmp_path / "stacks.node-c.json"
    garbage.write_text("{not json")
    deep = _write(tmp_path / "stacks.node-d.json", {**_answer([]), "x": json.loads("[" * 100 + "]" * 100)})
    fifo = tmp_path / "stacks.node-e.json"
    os.mkfifo(fifo)
    missing = str(tmp_path / "stacks.node-f.json")
    directory = tmp_path / "stacks.node-g.json"
    directory.mkdir()
    # WHEN merged
    code = main(["stacks", "--merge", a, b, str(garbage), deep, str(fifo), missing, str(directory), "--no-save"])
    out = capsys.readouterr().out
    # THEN the grouped view names the odd rank and its node, and each bad file and why
    assert code == 1
    assert "8 process(es), 2 group(s) by main-thread stack" in out
    assert "rank 6 on node-b: in load_batch (/job/data.py:12)" in out
    assert f"FAILED file {garbage}: not valid JSON" in out
    assert f"FAILED file {deep}: JSON nested deeper than 16 levels: refused" in out
    assert f"FAILED file {fifo}: not a regular file" in out
    assert f"FAILED file {missing}: cannot open it: No such file or directory" in out
    assert f"FAILED file {directory}: not a regular file" in out
    assert "8 process(es) of 2 node(s) merged from 2 file(s)" in out


def test_merge_command_json_and_artifact(tmp_path: Path, capsys: Any) -> None:
    a = _write(tmp_path / "stacks.node-a.json", _answer(_node(None, range(2))))
    b = _write(tmp_path / "stacks.node-b.json", _answer(_node(None, range(2, 4), odd=3)))
    assert main(["stacks", "--merge", a, b, "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert [g["odd"] for g in merged["groups"]] == [[], ["rank 3 on node-b"]]
    assert merged["artifact"] and Path(merged["artifact"], "merged.txt").read_text().count("rank 3 on node-b") >= 1


def test_merge_command_refusals(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[]")
    assert main(["stacks", "--merge", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "no stacks to merge: none of the 1 file(s) could be read" in err
    assert main(["stacks", "--merge", str(bad), "--job", "J"]) == 2
    assert "--merge reads files" in capsys.readouterr().err
    assert main(["stacks", "--merge", str(bad), "--hosts", "a,b"]) == 2
    assert "--merge reads files" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["small", "large"])
def test_a_merge_of_only_deep_files_names_each_file_and_the_depth_limit(tmp_path: Path, capsys: Any, size: str) -> None:
    # GIVEN a file nested 100 000 levels deep (read at once, or streamed past 1 MiB) and one
    # that holds no process
    pad = [{"pid": i, "pad": "x" * 1000} for i in range(1500)] if size == "large" else []
    deep = tmp_path / "stacks.node-d.json"
    deep.write_text(
        json.dumps({**_answer([]), "processes": pad})[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    empty = _write(tmp_path / "stacks.node-e.json", _answer([]))
    # WHEN the deep file alone is merged, then with the empty one
    assert main(["stacks", "--merge", str(deep), "--no-save"]) == 1
    alone = capsys.readouterr().err
    assert main(["stacks", "--merge", str(deep), empty, "--no-save"]) == 1
    with_empty = capsys.readouterr().err
    # THEN each error names the file and the limit it broke, not only that nothing was read
    assert "no stacks to merge: none of the 1 file(s) could be read:" in alone
    assert "no process in the 1 file(s) read:" in with_empty
    for err in (alone, with_empty):
        assert f"  file {deep}: JSON nested deeper than 16 levels: refused" in err


def test_gil_and_fallback_lines_name_the_node_when_ranks_are_of_several_nodes() -> None:
    # GIVEN rank 6 of node-b holding the GIL, read through its agent after py-spy failed
    from collectors.stacks import render_merged

    procs = _node("node-a", range(4)) + _node("node-b", range(4, 8), odd=6)
    odd = procs[6]
    odd.threads[0].holds_gil = True
    odd.fallback_reason = "ptrace refused"
    # WHEN rendered as one view
    text = render_merged(procs, group_processes(procs, by_host=True))
    # THEN both lines say which node the rank is on
    assert "main thread holds the GIL in: rank 6 on node-b" in text
    assert "rank 6 on node-b: read with py-spy because ptrace refused" in text
