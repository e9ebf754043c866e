"""The no-sidecar path over many nodes: `dynprof stacks --job J --json` on each node, then
`dynprof stacks --merge` of the files, on a real 2-rank gloo job split over two simulated nodes."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests._ports import free_port
from tests.support.ranks import rank_env

pytest.importorskip("torch")

HANG = "tests/integration/programs/hang_program.py"


def test_stacks_of_each_node_merged(spawn: Any, cli: Any, tmp_path: Path) -> None:
    # GIVEN a 2-rank gloo job, one rank per "node": rank 0 waits in all_reduce, rank 1 sleeps elsewhere
    run_dirs = [Path(tempfile.mkdtemp(prefix="dpm-", dir="/tmp")) for _ in range(2)]
    targets: list[Any] = []
    try:
        port = str(free_port())
        for rank in (0, 1):
            env = rank_env(
                rank, 2, port, DYNPROF_JOB_ID="mrg", DYNPROF_RUN_DIR=str(run_dirs[rank]), DYNPROF_HOST=f"node-{rank}"
            )
            args = ["-m", "dynprof", "run", "-q", "--", sys.executable, HANG, "--hold", "sleep", "--seconds", "90"]
            targets.append(spawn(args, under_run=False, env=env))
        for t in targets:
            t.ready_pids(timeout=90)
        # WHEN each node writes its own stacks (as `srun --ntasks-per-node=1` would) and they are merged
        files = []
        for rank in (0, 1):
            out = cli("stacks", "--job", "mrg", "--json", "--no-save", env={"DYNPROF_RUN_DIR": str(run_dirs[rank])})
            assert out.returncode == 0, out.stderr
            path = tmp_path / f"stacks.node-{rank}.json"
            path.write_text(out.stdout)
            files.append(str(path))
        text = cli("stacks", "--merge", *files, "--no-save")
        data = cli("stacks", "--merge", *files, "--no-save", "--json")
        # THEN both ranks are in one view, each named with its node and where it waits
        assert text.returncode == 0, text.stderr
        assert "2 process(es), 2 group(s)" in text.stdout
        assert "rank 0 on node-0: in all_reduce (torch/distributed/distributed_c10d.py:" in text.stdout
        assert "rank 1 on node-1: in wait_for_data (" in text.stdout
        merged = json.loads(data.stdout)
        assert sorted((p["rank"], p["host"]) for p in merged["processes"]) == [(0, "node-0"), (1, "node-1")]
        assert merged["hosts"] == ["node-0", "node-1"]
    finally:
        for t in targets:
            t.stop()  # before their run directories go
        for d in run_dirs:
            shutil.rmtree(d, ignore_errors=True)
