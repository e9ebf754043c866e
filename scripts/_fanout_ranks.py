"""Light ranks for scripts/bench_fanout.py: processes with the dynprof agent, without torch.

One process imports the agent and everything its server thread loads, then forks every rank,
so that the ranks share those pages (copy-on-write): 512 of them fit in a few GiB. Each rank
takes its node's settings (run directory, artifact directory, host name), starts the agent,
prints ``READY <node> <rank> <pid>`` once the agent answers, and sleeps in a small loop whose
stack the merged views group (one rank, ``--odd-rank``, sleeps in another function).

Reads the plan as JSON on stdin: ``{"job": J, "world_size": W, "odd_rank": R, "ranks":
[{"rank": r, "local_rank": l, "node": n, "host": h, "run_dir": d, "artifact_dir": a}, ...]}``.
Every rank dies with this process (PR_SET_PDEATHSIG), and this one with its parent.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def preload() -> None:
    """What each rank's agent would import on its own, imported once before the forks."""
    import dynprof.agent
    from dynprof.agent import _agent

    for name in ("dynprof.agent._server", "dynprof.agent._core_handlers", *_agent.EXTENSIONS, "collectors.stacks"):
        try:
            importlib.import_module(name)
        except Exception:
            pass
    del dynprof


def wait_for_batch(seconds: float) -> None:
    time.sleep(seconds)


def load_shard(seconds: float) -> None:
    time.sleep(seconds)


def rank_main(spec: dict[str, object], job: str, world_size: int, odd_rank: int) -> None:
    os.environ.update(
        {
            "DYNPROF_RUN_DIR": str(spec["run_dir"]),
            "DYNPROF_ARTIFACT_DIR": str(spec["artifact_dir"]),
            "DYNPROF_HOST": str(spec["host"]),
            "DYNPROF_JOB_ID": job,
            "RANK": str(spec["rank"]),
            "LOCAL_RANK": str(spec["local_rank"]),
            "WORLD_SIZE": str(world_size),
        }
    )
    import dynprof.agent

    agent = dynprof.agent.start("api")
    if agent is None or not agent.wait_ready(30):
        os._exit(3)
    os.write(1, f"READY {spec['node']} {spec['rank']} {os.getpid()}\n".encode())
    wait = load_shard if spec["rank"] == odd_rank else wait_for_batch
    while True:
        wait(0.5)


def main() -> int:
    die_with_parent(signal.SIGTERM)
    plan = json.load(sys.stdin)
    preload()
    gc.freeze()  # the collector never touches the shared objects: fewer pages copied per rank
    children = []
    for spec in plan["ranks"]:
        pid = os.fork()
        if pid == 0:
            try:
                die_with_parent()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                rank_main(spec, plan["job"], plan["world_size"], plan["odd_rank"])
            finally:
                os._exit(1)
        children.append(pid)

    def stop(_sig: int, _frame: object) -> None:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in children:  # reaped here: none is left a zombie for init to find
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while children:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            break
        if pid in children:
            children.remove(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
