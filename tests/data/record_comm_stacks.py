"""Record the committed stack fixtures of tests/data/comm_stacks (CPU, torch.distributed gloo).

For each way below, starts a 2-rank gloo job on this machine where rank 1 never joins rank 0's
call (it sleeps), waits until rank 0 is in the call, and keeps the main thread of rank 0 as
``py-spy dump --native --json`` reads it, in tests/data/comm_stacks/<way>.json:

    all_gather_into_tensor  dist.all_gather_into_tensor
    reduce_scatter          dist.reduce_scatter (a list of inputs: gloo has no reduce_scatter_tensor)
    barrier                 dist.barrier
    monitored_barrier       dist.monitored_barrier (rank 1 never comes: rank 0 waits up to its timeout)
    recv                    dist.recv from rank 1, which never sends
    irecv_wait              dist.irecv(...).wait() in the program's own code (no torch.distributed frame)
    functional_wait         torch.distributed._functional_collectives.all_reduce(...).wait()
    c10d_op                 torch.ops._c10d_functional.all_reduce and wait_tensor called directly by the
                            program (no torch.distributed frame: torch's c10d code natively)

    PYTHONPATH=. python tests/data/record_comm_stacks.py [WAY...]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "comm_stacks"

PROGRAM = r"""
import datetime, os, sys, time
import torch
import torch.distributed as dist

way, rank, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
dist.barrier()  # both ranks are in the group
if rank == 1:
    time.sleep(600)
    sys.exit(0)
t = torch.ones(4)


def block():
    open(ready, "w").close()
    if way == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.empty(8), t)
    elif way == "reduce_scatter":
        dist.reduce_scatter(torch.empty(4), [torch.ones(4), torch.ones(4)])
    elif way == "barrier":
        dist.barrier()
    elif way == "monitored_barrier":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=600))
    elif way == "recv":
        dist.recv(t, src=1)
    elif way == "irecv_wait":
        work = dist.irecv(t, src=1)
        work.wait()
    elif way == "functional_wait":
        import torch.distributed._functional_collectives as funcol

        funcol.all_reduce(t, "sum", dist.group.WORLD).wait()
    elif way == "c10d_op":
        out = torch.ops._c10d_functional.all_reduce(t, "sum", dist.group.WORLD.group_name)
        torch.ops._c10d_functional.wait_tensor(out)


block()
"""

WAYS = (
    "all_gather_into_tensor",
    "reduce_scatter",
    "barrier",
    "monitored_barrier",
    "recv",
    "irecv_wait",
    "functional_wait",
    "c10d_op",
)


def record(way: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    tmp = Path(tempfile.mkdtemp(prefix="dp-comm-"))
    program = tmp / "comm_wait_program.py"
    program.write_text(PROGRAM)
    ready = tmp / "ready"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    procs = [
        subprocess.Popen([sys.executable, str(program), way, str(r), str(ready)], env=env, cwd=tmp) for r in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise SystemExit(f"{way}: rank 0 never reached its call")
            time.sleep(0.2)
        time.sleep(3.0)  # well inside the call
        out = subprocess.run(
            ["py-spy", "dump", "--native", "--json", "--pid", str(procs[0].pid)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        threads = json.loads(out)
        main = [t for t in threads if t.get("thread_name") == "MainThread" or t.get("os_thread_id") == procs[0].pid]
        OUT.mkdir(parents=True, exist_ok=True)
        text = json.dumps(main[:1], indent=0).replace(f"{tmp}/", "/job/")  # the program's files, in /job
        (OUT / f"{way}.json").write_text(text + "\n")
        print(f"{way}: {len(main[0]['frames'])} frames, innermost {main[0]['frames'][0]['name']}")
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


if __name__ == "__main__":
    for way in sys.argv[1:] or WAYS:
        record(way)
