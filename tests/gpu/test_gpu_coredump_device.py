"""Naming the kernel a hung rank's GPU runs: two ranks under `dynprof run --gpu-coredump` share
one GPU, rank 1 blocks in ``.item()`` behind an endless kernel (``torch.cuda._sleep``), and
`dynprof watch --gpu-coredump` dumps its GPU through the driver's pipe and names the kernel in
the verdict. Where cuda-gdb is on PATH, it reads the same dump and must name the same kernel.

Run on a GPU machine: ``pytest -m gpu tests/gpu/test_gpu_coredump_device.py -s``; ``DYNPROF_GPU_KEEP``
(a folder) keeps the dump, gzipped.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dynprof.identity import detect
from tests._ports import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.ptrace]
PROGRAM = "tests/gpu/programs/gpu_fault_program.py"
RUNS = range(int(os.environ.get("DYNPROF_GPU_RUNS", "1")))


def _free_port() -> str:
    return str(free_port())


@pytest.mark.parametrize("run", RUNS)
def test_the_watch_names_the_kernel_a_hung_rank_waits_behind(spawn, cli, run, dynprof_dirs):
    # GIVEN two ranks armed for the GPU core dump, rank 1 blocked behind an endless kernel
    job = f"gpudump{run}"
    port = _free_port()
    targets = []
    for rank in range(2):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env["DYNPROF_JOB_ID"] = job
        args = ["-m", "dynprof", "run", "-q", "--gpu-coredump", "--", sys.executable, PROGRAM, "--fault", "item"]
        targets.append(spawn([*args, "--at-step", "5"], under_run=False, env=env))
    pids = [t.ready_pids(timeout=240)[0] for t in targets]
    time.sleep(4.0)
    # WHEN the watch looks once, with --gpu-coredump
    t0 = time.monotonic()
    out = cli(
        "watch",
        "--job",
        job,
        "--once",
        "--json",
        "--stall-after",
        "3",
        "--look-interval",
        "1",
        "--gpu-coredump",
        timeout=300,
    )
    took = time.monotonic() - t0
    verdicts = [json.loads(line)["verdict"] for line in out.stdout.splitlines() if '"verdict"' in line]
    keep = os.environ.get("DYNPROF_GPU_KEEP")
    dumps = glob.glob(str(dynprof_dirs["artifacts"] / "**" / "gpucore.nvcudmp"), recursive=True)
    if keep:
        os.makedirs(keep, exist_ok=True)
        for n, path in enumerate(dumps):  # an H200's dump is ~87 MB, mostly zeros: kept gzipped
            with open(path, "rb") as src, gzip.open(os.path.join(keep, f"{job}-{n}.nvcudmp.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        with open(os.path.join(keep, f"{job}-watch.txt"), "w") as f:
            f.write(out.stdout + "\n--- stderr\n" + out.stderr)
    # THEN one hang, rank 1, and its GPU evidence names the endless kernel with its launch
    assert out.returncode == 20 and len(verdicts) == 1, out.stderr
    v = verdicts[0]
    assert [(c["rank"], c["host"]) for c in v["culprits"]] == [(1, detect().host)]
    (gpu,) = [g for g in v["evidence"]["gpu"] if g["rank"] == 1]
    print(f"\nVERDICT-ROW gpu-coredump run={run} watch_s={took:.1f} dump_s={(gpu.get('coredump') or {}).get('dump_s')}")
    print(gpu["kernel"])
    assert gpu["kernel"].startswith("running "), gpu
    assert "spin_kernel" in gpu["kernel"] and "<<<(1,1,1),(1,1,1)>>>" in gpu["kernel"], gpu["kernel"]
    assert "its GPU ran " in v["conclusion"] and "spin_kernel" in v["conclusion"], v["conclusion"]
    (dump,) = dumps
    assert gpu["coredump"]["artifact"] == os.path.dirname(dump)
    # AND only rank 1 was dumped (rank 0 waits in gloo, its GPU work finished)
    assert pids[1] != pids[0]
    # AND `dynprof gpu-coredump --read` names it the same way
    read = cli("gpu-coredump", "--read", dump, "--json")
    assert read.returncode == 0, read.stderr
    running = json.loads(read.stdout)["dump"]["running"]
    assert any("spin_kernel" in r for r in running), running
    # AND cuda-gdb, where it is here, reads the same kernel from the same dump
    gdb = shutil.which("cuda-gdb")
    if gdb:
        said = subprocess.run(
            [gdb, "-batch", "-ex", f"target cudacore {dump}", "-ex", "info cuda kernels"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        print(said.stdout[-2000:])
        assert "spin_kernel" in said.stdout, said.stdout + said.stderr
