"""One merge for every path: the same processes read here (`stacks --pid`), answered by a node
(`stacks --hosts`) and given as a file (`stacks --merge`) give the same groups, and each
answer is one stacks document."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import collectors.stacks.collect
import dynprof.cli.stacks
import dynprof.job.stacks
from collectors.stacks import Frame, ProcessStacks, ThreadStack, readers
from dynprof.cli import job, main
from dynprof.nodes import NodeAnswer

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
WAITING = [Frame("all_reduce", C10D, 2806), Frame("train_step", "/job/train.py", 40), Frame("main", "/job/train.py", 9)]
LOADING = [
    Frame("load_batch", "/job/data.py", 12),
    Frame("train_step", "/job/train.py", 35),
    Frame("main", "/job/train.py", 9),
]


@pytest.fixture
def four_processes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Four live processes whose stacks the reader gives: three wait in all_reduce, the last loads data."""
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    pids = [c.pid for c in children]

    def read(pid: int, **_: Any) -> ProcessStacks:
        frames = LOADING if pid == pids[-1] else WAITING
        return ProcessStacks(pid=pid, method="py-spy", threads=[ThreadStack(pid, main=True, frames=list(frames))])

    monkeypatch.setattr(readers, "capture_py_spy", read)
    monkeypatch.setattr(readers, "ptrace_refusal", lambda pid: None)
    yield pids
    for c in children:
        c.kill()
        c.wait()


def _groups(doc: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What a merge decides, apart from how members are labelled: who is together, on which stack."""
    return [
        (
            sorted(m["pid"] for m in g["members"]),
            g["size"],
            g["outlier"],
            [(f["function"], f["line"]) for f in g["frames"]],
            g["diverges_at"] and (g["diverges_at"]["function"], g["diverges_at"]["line"]),
        )
        for g in doc["groups"]
    ]


class OneNode:
    """A sidecar that answers with what `dynprof stacks --json` printed on its node."""

    max_in_flight = 4

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def action_all(self, nodes: Any, name: str, options: Any, timeout: Any = None) -> list[NodeAnswer]:
        return [NodeAnswer(n, True, host="h", exit_code=0, result=self.answer) for n in nodes]


def test_local_node_answers_and_files_are_grouped_by_one_merge(
    four_processes: list[int], monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    # GIVEN the merge spied on, and four processes, the last elsewhere
    calls: list[int] = []
    real = dynprof.cli.stacks.merge

    def spy(sources: Any, by_host: bool | None = None) -> Any:
        sources = list(sources)
        calls.append(len(sources))
        return real(sources, by_host)

    monkeypatch.setattr(dynprof.cli.stacks, "merge", spy)  # the files' path
    monkeypatch.setattr(dynprof.job.stacks, "merge", spy)  # the nodes' path
    monkeypatch.setattr(collectors.stacks.collect, "merge", spy)  # the kind's own, reading this node
    pid_list = ",".join(map(str, four_processes))

    # WHEN they are read here, answered by a node, and merged from a file
    assert main(["stacks", "--pid", pid_list, "--json", "--no-save"]) == 0
    local = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(job, "client_for", lambda args: OneNode(local))
    assert main(["stacks", "--job", "j", "--hosts", "node-a", "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)
    path = tmp_path / "stacks.node-a.json"
    path.write_text(json.dumps(local))
    assert main(["stacks", "--merge", str(path), "--json", "--no-save"]) == 0
    merged = json.loads(capsys.readouterr().out)

    # THEN each path went through the one merge, and all three found the same groups
    assert calls == [1, 1, 1]
    expected = [
        (sorted(four_processes[:3]), 3, False, [("all_reduce", 2806), ("train_step", 40), ("main", 9)], None),
        ([four_processes[3]], 1, True, [("load_batch", 12), ("train_step", 35), ("main", 9)], ("train_step", 35)),
    ]
    assert _groups(local) == _groups(nodes) == _groups(merged) == expected
    # and each answer is the same stacks document, the job-wide one inside its envelope
    for doc in (local, nodes, merged):
        assert (doc["schema"], doc["schema_version"]) == ("dynprof.stacks", 2)
        assert {"processes", "groups", "failures", "hosts", "truncated"} <= set(doc)
        assert sorted(p["pid"] for p in doc["processes"]) == sorted(four_processes)
        assert all(p["main_thread"]["frames"][-1]["function"] == "main" for p in doc["processes"])
    assert {"nodes", "per_node", "artifacts"} <= set(nodes)
    assert [m["host"] for m in nodes["groups"][1]["members"]] == ["node-a"]
    assert nodes["groups"][1]["odd"] == [f"pid {four_processes[3]} on node-a"]


def test_the_text_of_each_path_keeps_its_lines(
    four_processes: list[int], monkeypatch: Any, capsys: Any, tmp_path: Path
):
    # GIVEN the four processes' local document
    pid_list = ",".join(map(str, four_processes))
    assert main(["stacks", "--pid", pid_list, "--json", "--no-save"]) == 0
    local = json.loads(capsys.readouterr().out)
    # WHEN each path prints its text view
    assert main(["stacks", "--pid", pid_list, "--no-save"]) == 0
    here = capsys.readouterr().out
    monkeypatch.setattr(job, "client_for", lambda args: OneNode(local))
    assert main(["stacks", "--job", "j", "--hosts", "node-a"]) == 0
    over_nodes = capsys.readouterr().out
    path = tmp_path / "stacks.node-a.json"
    path.write_text(json.dumps(local))
    assert main(["stacks", "--merge", str(path), "--no-save"]) == 0
    from_file = capsys.readouterr().out
    # THEN the grouped view heads each, and each ends with its own count line
    for text in (here, over_nodes, from_file):
        assert text.startswith(
            "4 process(es), 2 group(s) by main-thread stack (read with py-spy; innermost frame first)"
        )
        assert "<- outlier" in text
    assert here.rstrip().splitlines()[-1].startswith("4 process(es) read in ")
    assert over_nodes.rstrip().splitlines()[-1] == "4 process(es) read on 1 of 1 node(s)"
    assert from_file.rstrip().splitlines()[-1] == "4 process(es) of 1 node(s) merged from 1 file(s)"
