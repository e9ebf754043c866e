"""Job-wide reach on real GPUs: a 2-rank NCCL job, one "node" per GPU, each node with its own
sidecar (`dynprof serve`), run directory and artifact store; the CLI acts from a third place
with no agents. A job-wide CUDA trace starts at the same step on both ranks; the stacks and
flight recorders of a hang are merged across the nodes.

Run on the device machine: ``pytest -m gpu tests/gpu/test_many_nodes_gpu.py -s`` (the NCCL job
needs 2 GPUs; on one, two ranks share it, gloo between them).
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import pytest

from tests.support.nodes import dynprof, split_job

HANG = "tests/integration/programs/hang_program.py"
STRAGGLER = "tests/integration/programs/straggler_program.py"

pytestmark = [pytest.mark.gpu, pytest.mark.ptrace]


def nccl_job(spawn, program: str, placement: list, job: str, args: list[str], run_args: tuple[str, ...] = ()):
    """Rank i on placement[i]'s node and on GPU i (LOCAL_RANK), NCCL between them."""
    targets = split_job(
        spawn,
        program,
        placement,
        job,
        args,
        run_args,
        rank_env=lambda r: {"LOCAL_RANK": str(r), "NCCL_NVLS_ENABLE": "0"},
    )
    for t in targets:
        t.ready_pids(timeout=180)
    return targets


@pytest.mark.multi_gpu
def test_job_wide_cuda_trace_starts_at_the_same_step_on_both_nodes(sim_nodes, spawn, tmp_path):
    # GIVEN a 2-rank NCCL training job, rank 0 (GPU 0) on node A and rank 1 (GPU 1) on node B
    a, b = sim_nodes["a"], sim_nodes["b"]
    nccl_job(spawn, STRAGGLER, [a, b], "gpu-fan", ["--device", "cuda", "--base-load-ms", "5", "--max-seconds", "120"])

    # WHEN a 3-step trace of every rank is started from here, through both sidecars
    fetched = tmp_path / "fetched"
    t0 = time.monotonic()
    out = dynprof(
        "start", "--job", "gpu-fan", "--hosts", sim_nodes["hosts"], "--steps", "3", "--json",
        "--fetch", str(fetched), token=sim_nodes["token"], timeout=180,
    )  # fmt: skip
    took = time.monotonic() - t0

    # THEN both ranks were traced from the one chosen step, with the GPUs' kernels
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    at = doc["at_step"]
    print(f"\njob-wide trace over 2 nodes: at step {at}, {took:.2f} s from the command to both traces fetched")
    assert [(r["rank"], r["start_step"], r["status"]) for r in doc["results"]] == [
        (0, at, "complete"),
        (1, at, "complete"),
    ], doc["results"]
    for f in doc["fetched"]:
        manifest = json.loads((Path(f["path"]) / "manifest.json").read_text())
        assert manifest["summary"]["start_step"] == at
        trace = json.loads(gzip.decompress((Path(f["path"]) / "trace.json.gz").read_bytes()))
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        nccl = [e for e in kernels if "nccl" in e.get("name", "").lower()]
        print(f"rank {manifest['rank']} on {manifest['host']}: {len(kernels)} kernels, {len(nccl)} NCCL kernels")
        assert kernels and nccl


def test_job_wide_cuda_trace_over_ranks_sharing_one_gpu(sim_nodes, spawn, tmp_path):
    """The job-wide start (the command's collect_job, through both sidecars) on a one-GPU
    machine: two ranks share cuda:0, gloo between them."""
    a, b = sim_nodes["a"], sim_nodes["b"]
    targets = split_job(
        spawn, STRAGGLER, [a, b], "gpu-shared", ["--device", "cuda-shared", "--base-load-ms", "5", "--max-seconds", "120"]
    )  # fmt: skip
    for t in targets:
        t.ready_pids(timeout=180)
    fetched = tmp_path / "fetched"
    out = dynprof(
        "start", "--job", "gpu-shared", "--hosts", sim_nodes["hosts"], "--steps", "3", "--json",
        "--fetch", str(fetched), token=sim_nodes["token"], timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    at = doc["at_step"]
    assert [(r["rank"], r["start_step"], r["status"]) for r in doc["results"]] == [
        (0, at, "complete"),
        (1, at, "complete"),
    ], doc["results"]
    assert len(doc["fetched"]) == 2 and not any(f["error"] for f in doc["fetched"]), doc["fetched"]
    for f in doc["fetched"]:
        manifest = json.loads((Path(f["path"]) / "manifest.json").read_text())
        assert manifest["summary"]["start_step"] == at
        trace = json.loads(gzip.decompress((Path(f["path"]) / "trace.json.gz").read_bytes()))
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        print(f"\nrank {manifest['rank']} on {manifest['host']}: {len(kernels)} kernels from step {at}")
        assert kernels


@pytest.mark.multi_gpu
def test_hang_merged_across_nodes_names_where_each_rank_waits(sim_nodes, spawn):
    # GIVEN a 2-rank NCCL job where rank 0 (node A) waits in an all_reduce that rank 1 (node B)
    # never enters, with the flight recorder on
    a, b = sim_nodes["a"], sim_nodes["b"]
    nccl_job(
        spawn, HANG, [a, b], "gpu-hang", ["--backend", "nccl", "--hold", "skip", "--seconds", "300"],
        ("--flight-recorder", "256"),
    )  # fmt: skip
    time.sleep(2.0)  # rank 0 enqueues the all_reduce and blocks in the synchronize

    # WHEN the stacks of every rank are asked for through both sidecars
    t0 = time.monotonic()
    out = dynprof("stacks", "--job", "gpu-hang", "--hosts", sim_nodes["hosts"], "--json", token=sim_nodes["token"])
    took = time.monotonic() - t0

    # THEN both ranks are read, each with its node, in two groups: rank 0 in the collective wait
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    print(f"\nmerged stacks of 2 NCCL ranks on 2 nodes: {took:.2f} s")
    print(
        dynprof(
            "stacks", "--job", "gpu-hang", "--hosts", sim_nodes["hosts"], "--no-save", token=sim_nodes["token"]
        ).stdout
    )
    assert [(p["rank"], p["host"]) for p in doc["processes"]] == [(0, "127.0.0.1"), (1, "localhost")]
    groups = {tuple(g["ranks"]): g for g in doc["groups"]}
    assert set(groups) == {(0,), (1,)}
    assert "collective_wait" in groups[(0,)]["headline"] or "synchronize" in groups[(0,)]["headline"]
    assert "wait_for_data" in groups[(1,)]["headline"]

    # AND the flight recorders of both nodes, analysed together, name the missing rank
    nccl = dynprof("nccl", "--job", "gpu-hang", "--hosts", sim_nodes["hosts"], "--json", token=sim_nodes["token"])
    assert nccl.returncode == 0, nccl.stderr
    analysis = json.loads(nccl.stdout)["analysis"]
    hung = [pg for pg in analysis["process_groups"] if pg["hung"]]
    assert hung and hung[0]["waiting"] == [0] and hung[0]["missing"] == [1], analysis
    print(dynprof("nccl", "--job", "gpu-hang", "--hosts", sim_nodes["hosts"], token=sim_nodes["token"]).stdout)
