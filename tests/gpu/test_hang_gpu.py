"""A hung 2-rank NCCL job on two GPUs: `dynprof nccl` names the missing rank, `dynprof stacks`
shows the NCCL wait. Run on the device machine: pytest -m gpu tests/gpu/test_hang_gpu.py -s"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from collectors.flight_recorder import dump_through_pipe, load_dump_bytes
from tests._ports import free_port as _free_port
from tests.support.ranks import rank_env

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.ptrace]
HANG = "tests/integration/programs/hang_program.py"


@pytest.fixture
def nccl_job(spawn):
    """Rank 0 enters an all_reduce and synchronises; rank 1 skips the collective and sleeps."""
    port = str(_free_port())
    targets = []
    for rank in (0, 1):
        env = rank_env(rank, 2, port, LOCAL_RANK=str(rank), DYNPROF_JOB_ID="ncclhang", NCCL_NVLS_ENABLE="0")
        targets.append(
            spawn(
                [
                    "-m",
                    "dynprof",
                    "run",
                    "-q",
                    "--flight-recorder",
                    "256",
                    "--",
                    sys.executable,
                    HANG,
                    "--backend",
                    "nccl",
                    "--hold",
                    "skip",
                    "--seconds",
                    "300",
                ],
                under_run=False,
                env=env,
            )
        )
    pids = [t.ready_pids(timeout=180)[0] for t in targets]
    time.sleep(2.0)  # rank 0 enqueues the all_reduce and blocks in the synchronize
    return pids


def test_nccl_names_missing_rank_and_stacks_show_the_wait(nccl_job, cli):
    # WHEN every rank's flight recorder is collected
    result = cli("nccl", "--job", "ncclhang")
    print(result.stdout, result.stderr)
    assert result.returncode == 0, result.stderr
    assert "HUNG: rank 0 wait in #" in result.stdout and "nccl:all_reduce" in result.stdout
    assert "missing: rank 1" in result.stdout
    as_json = json.loads(cli("nccl", "--job", "ncclhang", "--json").stdout)
    hung = [pg for pg in as_json["analysis"]["process_groups"] if pg["hung"]]
    assert hung and hung[0]["missing"] == [1] and hung[0]["waiting"] == [0]

    # AND the stacks with native frames show rank 0 waiting on the GPU and rank 1 elsewhere
    t0 = time.monotonic()
    stacks = cli("stacks", "--job", "ncclhang", "--native", "--json")
    elapsed = time.monotonic() - t0
    assert stacks.returncode == 0, stacks.stderr
    out = json.loads(stacks.stdout)
    groups = {tuple(g["ranks"]): g for g in out["groups"]}
    print(cli("stacks", "--job", "ncclhang", "--native").stdout)
    print(f"stacks --native of 2 NCCL ranks: {elapsed:.2f} s (CLI wall time)")
    assert set(groups) == {(0,), (1,)}
    rank0 = groups[(0,)]
    names = [f["function"] for f in rank0["frames"]]
    assert any("synchronize" in n.lower() for n in names), names
    native = [f for f in rank0["frames"] if f["native"]]
    assert any(("cuda" in (f["library"] or "").lower()) for f in native), [f["library"] for f in native]
    assert groups[(1,)]["headline"].startswith("in wait_for_data (")


def test_dump_pipe_answers_without_the_agent(nccl_job):
    # torch's own pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE), the fallback that needs no Python
    raw, where = dump_through_pipe(nccl_job[0], 0, timeout=30)
    doc = load_dump_bytes(raw)
    print(f"pipe dump of rank 0: {len(raw)} bytes at {where}, {len(doc.get('entries', []))} entries")
    assert any(e.get("profiling_name") == "nccl:all_reduce" for e in doc.get("entries", []))
    assert os.path.exists(where)
    assert Path(where).stat().st_size == len(raw)
