"""The job's judgement (collectors/trace_analysis/job.py): ranks combined, the straggler rule on
recorded traces (tests/unit/data/traces, tests/data/gpu_traces) and on small synthetic GPU
traces, and two analyses compared."""

from __future__ import annotations

import pytest

from collectors.trace_analysis.artifact import SCHEMA, SCHEMA_VERSION
from collectors.trace_analysis.job import (
    category_means,
    combine,
    compare,
    detect_straggler,
    short_collective,
    short_function,
)
from collectors.trace_analysis.rank import RankInput, analyze_ranks
from tests.unit._trace_analysis_cases import analyze, assert_categories_add_up, gpu_case, gpu_trace


# -- CPU (gloo) traces --------------------------------------------------------------------------
def test_slow_data_loading_rank_is_named_the_straggler():
    # GIVEN a 2-rank gloo job where rank 1 sleeps 60 ms per step in load_batch
    # WHEN its job-wide trace is analysed
    analysis = analyze("slow1")

    # THEN rank 1 is the straggler, its time is outside operators and the others wait in allreduce
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1, analysis["straggler_check"]
    assert "outside operators" in s["reason"] and "allreduce" in s["reason"], s["reason"]
    assert s["excess_ms"] > 40
    r0, r1 = analysis["ranks"]
    assert r1["cpu"]["outside_ops"] > 50 and r0["cpu"]["outside_ops"] < 20
    assert r0["cpu"]["collective_wait"] > 40, r0
    assert "noise threshold" in analysis["straggler_check"]
    assert_categories_add_up(analysis)


def test_with_stack_traces_name_the_slow_function():
    analysis = analyze("slow1_stack")
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1
    assert "load_batch (straggler_program.py:" in s["reason"], s["reason"]
    assert_categories_add_up(analysis)


def test_even_job_has_no_straggler():
    analysis = analyze("even")
    assert analysis["straggler"] is None
    assert analysis["straggler_check"].startswith("no straggler")
    assert "noise threshold" in analysis["straggler_check"]
    assert_categories_add_up(analysis)


def test_top_ops_hold_the_gloo_collective_and_real_operators():
    analysis = analyze("slow1")
    names = [r["name"] for r in analysis["top_ops"]]
    assert "gloo:all_reduce" in names
    assert "aten::addmm" in names or "aten::mm" in names
    assert analysis["top_kernels"] == []
    assert all(r["gpu"] is None for r in analysis["ranks"])


# -- synthetic GPU traces (Kineto's schema: kernel / gpu_memcpy on device pids) --------------------
def test_gpu_straggler_with_extra_compute_is_named_with_its_kernel(tmp_path):
    # GIVEN two GPU ranks: rank 1's compute kernel runs 3 ms longer (1-8 ms), and rank 0's
    # all-reduce, launched after its own 4 ms of compute, waits for it (5-9 ms)
    p0 = gpu_trace(tmp_path / "r0.json.gz", rank=0, compute_us=4000, comm_start=5000, comm_us=4000)
    p1 = gpu_trace(tmp_path / "r1.json.gz", rank=1, compute_us=7000, comm_start=8000, comm_us=1000)

    # WHEN the two are analysed together (in two processes)
    analysis = combine(analyze_ranks([RankInput(str(p0)), RankInput(str(p1))], workers=2))

    # THEN rank 1 is named, with its GPU compute and kernel, and rank 0's AllReduce wait
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1, analysis["straggler_check"]
    assert "GPU compute 7.5 vs 4.5 ms" in s["reason"] and "ampere_sgemm_128x64_tn" in s["reason"], s["reason"]
    assert "wait 4.0 ms/step in AllReduce (nccl)" in s["reason"], s["reason"]
    assert analysis["top_kernels"][0]["name"] == "ampere_sgemm_128x64_tn"
    assert_categories_add_up(analysis)
    # and the page draws a GPU bar per rank and the GPU lanes of the timeline
    from collectors.trace_analysis.html import analysis_html

    page = analysis_html(analysis)
    assert page.count("class='seg compute'") == 2 and page.count(">rank 1 GPU<") == 1
    assert "class='lane gpu_comm'" in page and "class='lane gpu_compute'" in page


def _pair(tmp_path, devices, grid1=(64, 1, 1), bytes1=1 << 20):
    """Rank 1's compute kernel runs 3 ms longer than rank 0's (as in the test above), with the
    kernels' launch sizes and the copies' bytes said; ``devices``: each rank's GPU UUID."""
    p0 = gpu_trace(tmp_path / "r0.json.gz", 0, 4000, 5000, 4000, grid=[64, 1, 1], copy_bytes=1 << 20)
    p1 = gpu_trace(tmp_path / "r1.json.gz", 1, 7000, 8000, 1000, grid=list(grid1), copy_bytes=bytes1)
    items = [RankInput(str(p), device=d) for p, d in zip((p0, p1), devices)]
    return combine(analyze_ranks(items, workers=1))


def test_ranks_sharing_one_gpu_that_do_the_same_work_are_not_stragglers(tmp_path):
    # GIVEN two ranks on one GPU (one UUID) whose kernels and copies are the same in number,
    # launch size and bytes, rank 1's kernel slower (it lost its turns on the shared GPU)
    analysis = _pair(tmp_path, ["GPU-1111", "GPU-1111"])
    # THEN no straggler is named, and the check says why, with the work they both do
    assert analysis["straggler"] is None, analysis["straggler"]
    check = analysis["straggler_check"]
    assert check.startswith("no straggler: rank 1 works 3.0 ms/step more"), check
    assert "shares one GPU (GPU-1111) with rank 0" in check and "same GPU work per step (3 kernels" in check, check
    assert "1 copy of 1.0 MiB" in check, check
    assert [r["device"] for r in analysis["ranks"]] == ["GPU-1111", "GPU-1111"]


@pytest.mark.parametrize(
    "devices,grid1,bytes1",
    [
        (["GPU-1111", "GPU-2222"], (64, 1, 1), 1 << 20),  # their own GPUs: the time is the rank's
        ([None, None], (64, 1, 1), 1 << 20),  # no GPU said: judged on time, as before
        (["GPU-1111", "GPU-1111"], (96, 1, 1), 1 << 20),  # one GPU, bigger kernels on rank 1
        (["GPU-1111", "GPU-1111"], (64, 1, 1), 8 << 20),  # one GPU, more bytes copied by rank 1
    ],
    ids=["two-gpus", "unknown-gpus", "bigger-kernels", "more-bytes"],
)
def test_a_rank_that_does_more_gpu_work_is_named_on_a_shared_gpu_too(tmp_path, devices, grid1, bytes1):
    analysis = _pair(tmp_path, devices, grid1, bytes1)
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1 and s["cause"] == "GPU compute", analysis["straggler_check"]


# -- GPU traces of a 2-rank gloo job sharing one H200 (gradients all-reduced on the CPU), as
# `dynprof start --job J --steps 6` wrote them (tests/gpu/programs/gpu_fault_program.py)
@pytest.mark.parametrize("case,rank,cause", [("gpu-compute", 1, "GPU compute"), ("data-loading", 1, "data loading")])
def test_recorded_stragglers_on_one_shared_h200_are_named_when_the_gpu_is_known_to_be_shared(case, rank, cause):
    # GIVEN the recorded pairs (two ranks on one H200), each rank's GPU said to be that one
    result = gpu_case(case, device="GPU-5e0c7f2a")
    # THEN the straggler that does more work (60 matmuls more, or a slower loader) is named still
    s = result["straggler"]
    assert s is not None and (s["rank"], s["cause"]) == (rank, cause), result["straggler_check"]


def test_a_gpu_compute_straggler_behind_gloo_collectives_is_named_with_its_kernels():
    # GIVEN rank 1 running 60 extra 2048x2048 matmuls per step, rank 0 waiting for it in gloo
    result = gpu_case("gpu-compute")
    # THEN rank 1 is the straggler, for GPU compute, with the matmul kernel that holds it
    s = result["straggler"]
    assert s is not None and s["rank"] == 1, result["straggler_check"]
    assert s["cause"] == "GPU compute" and "sgemm" in s["reason"], s["reason"]
    # and the waiting on the CPU side counts as waiting on a GPU trace
    waits = {r["rank"]: r["collective_ms"] for r in result["ranks"]}
    assert waits[0] > waits[1] > 0, waits


def test_a_data_loading_straggler_on_a_gpu_trace_is_named_as_data_loading():
    result = gpu_case("data-loading")
    s = result["straggler"]
    assert s is not None and s["rank"] == 1, result["straggler_check"]
    assert s["cause"] == "data loading" and "DataLoader" in s["reason"], s["reason"]


def test_an_even_gpu_job_has_no_straggler():
    result = gpu_case("none")
    assert result["straggler"] is None and result["straggler_check"].startswith("no straggler"), result


# -- combine, the straggler rule, names ---------------------------------------------------------
def test_combine_keeps_the_steps_every_rank_traced_and_lists_the_ranks_not_analysed(tmp_path):
    # GIVEN rank 0's figures, rank 1's without its first step, and a rank that could not be read
    ranks = analyze_ranks([RankInput(str(gpu_trace(tmp_path / f"r{i}.json.gz", rank=i))) for i in (1, 0)], workers=1)
    ranks[0]["steps"] = ranks[0]["steps"][1:]
    error = {"error": "r2.json.gz: truncated", "path": "r2.json.gz", "rank": 2}

    # WHEN they are combined
    analysis = combine([*ranks, error])

    # THEN the analysis holds the common steps, the ranks in order, the one not analysed
    assert (analysis["schema"], analysis["schema_version"]) == (SCHEMA, SCHEMA_VERSION)
    assert analysis["common_steps"] == [6, 7]
    assert [r["rank"] for r in analysis["ranks"]] == [0, 1] and all(r["steps"] == 2 for r in analysis["ranks"])
    assert [len(s["ranks"]) for s in analysis["steps"]] == [2, 2]
    assert analysis["errors"] == [{"rank": 2, "path": "r2.json.gz", "error": "r2.json.gz: truncated"}]
    assert [s["rank"] for s in analysis["sources"]] == [0, 1]
    assert analysis["timeline"]["step"] in (6, 7) and len(analysis["timeline"]["ranks"]) == 2


def test_one_rank_is_never_a_straggler():
    assert detect_straggler([], [{"rank": 0}], 1, []) == (None, "one rank only: no straggler check")


def test_function_and_collective_names_are_shortened():
    assert short_function("/src/train/data.py(20): load_batch") == "load_batch (data.py:20)"
    assert short_function("aten::mm") == "aten::mm"
    assert short_collective("c10d::allreduce_") == "allreduce"
    assert short_collective("gloo:all_reduce") == "all_reduce"
    assert short_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "AllReduce (nccl)"
    assert short_collective("ncclKernel_AllGather_RING_LL_Sum_int8_t") == "AllGather (nccl)"
    assert short_collective("my_collective") == "my_collective"


def test_category_means_are_over_ranks_and_gpu_ones_over_gpu_ranks():
    cpu = {"ops": 1.0, "collective": 2.0, "collective_wait": 3.0, "outside_ops": 4.0}
    gpu = {"compute": 5.0, "comm_overlap": 0.0, "comm": 1.0, "memcpy": 0.0, "idle": 4.0}
    analysis = {
        "ranks": [
            {"step_ms": 10.0, "cpu": cpu, "gpu": gpu},
            {"step_ms": 20.0, "cpu": {k: 2 * v for k, v in cpu.items()}, "gpu": None},
        ]
    }
    means = category_means(analysis)
    assert means["step_ms"] == 15.0 and means["cpu.ops"] == 1.5 and means["cpu.outside_ops"] == 6.0
    assert means["gpu.compute"] == 5.0 and means["gpu.idle"] == 4.0
    assert "gpu.compute" not in category_means({"ranks": [{"step_ms": 1.0, "cpu": cpu, "gpu": None}]})


def test_compare_gives_each_category_s_change_and_what_moved_most():
    # GIVEN the slow job and the even one
    a, b = analyze("slow1"), analyze("even")

    # WHEN they are compared, with the two most moved operators
    result = compare(a, b, top=2)

    # THEN each category has its delta B - A, the operators are those that moved most
    assert result["schema"] == SCHEMA + ".compare" and result["schema_version"] == SCHEMA_VERSION
    cats = {c["category"]: c for c in result["categories"]}
    step = cats["step_ms"]
    assert step["delta_ms"] == pytest.approx(step["b_ms"] - step["a_ms"], abs=0.002) and step["delta_ms"] < -20
    assert step["delta_pct"] == pytest.approx(100 * step["delta_ms"] / step["a_ms"], abs=0.1)
    assert "gpu.compute" not in cats  # CPU-only traces
    assert len(result["ops"]) == 2 and result["kernels"] == []
    assert abs(result["ops"][0]["delta_ms"]) >= abs(result["ops"][1]["delta_ms"])
    assert result["straggler"]["a"]["rank"] == 1 and result["straggler"]["b"] is None


def test_compare_orders_operators_that_moved_equally_by_name():
    # GIVEN two analyses whose operators moved by the same amount, listed in different orders
    def side(rows):
        return {"ranks": [], "top_ops": [{"name": n, "ms_per_step_per_rank": v} for n, v in rows], "top_kernels": []}

    a = side([("zeta", 1.0), ("alpha", 1.0), ("mid", 1.0), ("big", 1.0)])
    b = side([("mid", 3.0), ("big", 5.0), ("alpha", 3.0), ("zeta", 3.0)])

    # WHEN they are compared
    ops = compare(a, b)["ops"]

    # THEN the largest move comes first, and equal moves follow by name, not by set order
    assert [o["name"] for o in ops] == ["big", "alpha", "mid", "zeta"]


# -- the cause class: one computation from what the trace measures --------------------------------
# Per-rank summaries (what collectors.trace_analysis.rank reduces a trace to), synthetic: each
# rank's step is its CPU work plus its wait in the collective, the straggler's extra work made up
# of the figures a case names; the others wait for it.
BASE = {
    "compute": 10.0,  # GPU compute kernels, ms/step
    "kernels": 23,  # kernels per step
    "launch": 0.5,  # CPU time in cudaLaunchKernel, ms/step
    "copy_call": 0.5,  # CPU time in cudaMemcpyAsync, ms/step
    "memcpy": 0.5,  # GPU time copying, ms/step
    "bytes": 1 << 20,  # bytes copied per step
    "outside": 6.0,  # CPU time outside operators, ms/step
    "cpu_other": 8.0,  # CPU operators' own time, ms/step
}
STEPS = 6


def _summary(rank: int, wait: float, noise: float = 0.0, has_gpu: bool = True, **figures) -> dict:
    import random

    f = {**BASE, **figures}
    jitter = random.Random(rank)
    steps = []
    for n in range(STEPS):
        extra = jitter.uniform(-noise, noise)
        ops = f["cpu_other"] + f["launch"] + f["copy_call"] + f.get("loader", 0.0)
        outside = f["outside"] + extra
        step = ops + outside + wait
        gpu = None
        if has_gpu:
            busy = min(step, f["compute"] + f["memcpy"])
            gpu = {
                "compute": f["compute"],
                "comm_overlap": 0.0,
                "comm": 0.0,
                "memcpy": f["memcpy"],
                "idle": step - busy,
            }
        cpu = {"ops": ops, "collective": wait, "collective_wait": 0.0, "outside_ops": outside}
        steps.append(
            {"step": 10 + n, "step_ms": step, "cpu": cpu, "gpu": gpu, "work_ms": ops + outside, "collective_ms": wait}
        )
    ops_table = {
        "aten::addmm": (STEPS, f["cpu_other"] * STEPS, f["cpu_other"] * STEPS),
        "cudaLaunchKernel": (f["kernels"] * STEPS, f["launch"] * STEPS, f["launch"] * STEPS),
        "cudaMemcpyAsync": (STEPS, f["copy_call"] * STEPS, f["copy_call"] * STEPS),
    }
    if f.get("loader"):
        name = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"
        ops_table[name] = (STEPS, f["loader"] * STEPS, f["loader"] * STEPS)
    python = {}
    if f.get("function"):
        python[f["function"]] = (f["outside"] * STEPS, f["outside"], 1)
    python["train.py(9): main"] = (BASE["outside"] * STEPS, 1000.0, 1)
    return {
        "rank": rank,
        "host": "n",
        "artifact": f"a{rank}",
        "backend": "gloo",
        "events": 100,
        "has_gpu": has_gpu,
        "steps": steps,
        "kernels": {"void gemm_kernel<float>": (f["kernels"] * STEPS, f["compute"] * STEPS)} if has_gpu else {},
        "ops": ops_table,
        "python_outside": python,
        "copies": {"count": STEPS, "bytes": f["bytes"] * STEPS},
        "kernel_threads": f["kernels"] * STEPS * 128,
        "device": None,
        "timeline": {},
        "collectives": {"c10d::allreduce_": wait * STEPS},
    }


def _job(straggler: dict, noise: float = 0.0, has_gpu: bool = True, ranks: int = 4) -> dict:
    """A job of ``ranks`` ranks whose rank 1 has ``straggler``'s figures; the others wait for it."""
    mine = _summary(1, 2.0, has_gpu=has_gpu, **straggler)
    work = mine["steps"][0]["work_ms"]
    summaries = []
    for r in range(ranks):
        if r == 1:
            summaries.append(mine)
            continue
        base = _summary(r, 0.0, noise, has_gpu)
        wait = max(2.0, work + 2.0 - base["steps"][0]["work_ms"])
        summaries.append(_summary(r, wait, noise, has_gpu))
    return combine(summaries)


STRAGGLER_CASES = {
    # its own kernels 25 ms longer; its .item() copy waits 20 ms for them (no more bytes): GPU compute
    "gpu-compute-behind-a-waiting-copy": ({"compute": 35.0, "copy_call": 20.5}, "GPU compute"),
    # 503 kernels a step against 23, 6 ms more in launches, their GPU time 1.5 ms: host launch
    "launch-bound": ({"kernels": 503, "launch": 6.5, "compute": 11.5}, "host launch"),
    # 256 MiB more copied in from pageable memory: the copy call and the GPU copy both longer
    "h2d-input": ({"bytes": 257 << 20, "copy_call": 22.0, "memcpy": 18.0}, "host-to-device copy"),
    # a slower DataLoader (its annotation is an operator)
    "data-loading": ({"loader": 15.0}, "data loading"),
    # Python outside operators, in a function of the program's
    "input-pipeline": ({"outside": 20.0, "function": "augment.py(40): random_crop"}, "input pipeline"),
    # CPU operators of its own (a CPU-only trace)
    "cpu-operators": ({"cpu_other": 25.0}, "CPU operators"),
    # mixes: more compute, and launches that take longer for as many kernels (a full queue): compute
    "compute-with-launches-behind-a-full-queue": ({"compute": 30.0, "launch": 10.5}, "GPU compute"),
    # launch-bound with a slower loader beside it: the larger, launching
    "launch-bound-and-a-slower-loader": ({"kernels": 600, "launch": 12.0, "loader": 5.0}, "host launch"),
    # a larger copy in and a little more compute: copying
    "h2d-and-a-little-compute": (
        {"bytes": 129 << 20, "copy_call": 14.0, "memcpy": 12.0, "compute": 13.0},
        "host-to-device copy",
    ),
}


@pytest.mark.parametrize("case", sorted(STRAGGLER_CASES))
def test_a_stragglers_cause_is_what_its_trace_measures(case):
    # GIVEN a job whose rank 1 does extra work of one kind (or a mix), the others waiting for it
    figures, cause = STRAGGLER_CASES[case]
    has_gpu = case != "cpu-operators"
    # WHEN the job's traces are analysed
    analysis = _job(figures, has_gpu=has_gpu)
    # THEN rank 1 is the straggler, with its cause, and the reason's words say the same class
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1, analysis["straggler_check"]
    assert s["cause"] == cause, (s["cause"], s["cause_ms"], s["reason"])
    assert f"({cause}" in s["reason"], s["reason"]
    if case == "gpu-compute-behind-a-waiting-copy":
        # the copy that waits is measured as waiting, not as copying
        assert s["cause_ms"]["host-to-device copy"] == 0.0 and s["waiting_ms"] == pytest.approx(20.0)
        assert "20.0 ms/step more in launches and copies that wait for its own kernels" in s["reason"]
    if case == "launch-bound":
        assert "503 kernels/step vs 23" in s["reason"], s["reason"]


@pytest.mark.parametrize("noise", [0.0, 1.5])
def test_an_even_job_and_one_whose_ranks_differ_by_noise_name_no_straggler(noise):
    # GIVEN four ranks doing the same work, exactly or up to 1.5 ms of noise a step each
    analysis = _job({}, noise=noise)
    # THEN no straggler
    assert analysis["straggler"] is None, analysis["straggler"]
    assert analysis["straggler_check"].startswith("no straggler"), analysis["straggler_check"]
