"""The watch on a CUDA job: one rank blocked in ``torch.cuda.synchronize`` behind a kernel that
spins for minutes, beside CPU ranks that wait for it in an all_reduce. The verdict names that
rank, on this node, with its native frame. Run on a GPU machine: pytest -m gpu tests/gpu/test_watch_gpu.py -s
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from dynprof.identity import detect
from tests._ports import free_port as _free_port

pytestmark = [pytest.mark.gpu, pytest.mark.ptrace]
PROGRAM = "tests/integration/programs/cuda_wait_program.py"


def test_the_watch_names_the_rank_in_a_cuda_wait_with_its_native_frame(spawn, cli):
    # GIVEN a 3-rank gloo job: rank 1 trains on the GPU and stops in a CUDA synchronize behind a
    # kernel that spins for minutes; ranks 0 and 2 train on the CPU and wait for it in all_reduce
    port = str(_free_port())
    targets = []
    for rank in range(3):
        env = {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["DYNPROF_JOB_ID"] = "cudawait"
        args = ["-m", "dynprof", "run", "-q", "--", sys.executable, PROGRAM, "--cuda-rank", "1"]
        targets.append(spawn(args, under_run=False, env=env))
    for t in targets:
        t.ready_pids(timeout=180)
    time.sleep(4.0)  # past the stall time below: every rank's last step is older than 3 s

    # WHEN the watch checks once, on this node's agents, with the quick healthcheck of the node
    started = time.monotonic()
    out = cli(
        "watch", "--job", "cudawait", "--once", "--json", "--stall-after", "3", "--look-interval", "1", timeout=300
    )
    took = time.monotonic() - started
    print(out.stdout, out.stderr, f"watch --once took {took:.1f} s", sep="\n")

    # THEN one hang verdict naming rank 1 on this host, with the CUDA wait's native frame
    assert out.returncode == 20, out.stderr
    (event,) = [json.loads(line) for line in out.stdout.splitlines()]
    verdict = event["verdict"]
    host = detect().host
    assert verdict["kind"] == "hang"
    assert [(c["rank"], c["host"]) for c in verdict["culprits"]] == [(1, host)]
    where = verdict["culprits"][0]["where"]
    assert where.startswith("wait_for_kernel (") and "[native: " in where and "Synchronize" in where
    assert "rank 1 on" in verdict["conclusion"] and "all_reduce" in verdict["conclusion"]
    # and the node's quick healthcheck, with its GPU, is in the evidence
    health = verdict["evidence"]["healthcheck"][host]
    print(json.dumps(health)[:2000])
    assert health
