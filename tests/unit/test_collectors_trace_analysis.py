"""`dynprof analyze` on recorded traces (tests/unit/data/traces, recorded by
tests/data/record_gloo_traces.py) and on small synthetic GPU traces built here."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from collectors import trace_analysis as ta
from collectors.torch_trace import read_trace
from dynprof.cli import main
from dynprof.store import ArtifactStore

TRACES = Path(__file__).parent / "data" / "traces"


def _trace_files(name: str) -> list[Path]:
    return sorted((TRACES / name).glob("*/*/rank*/trace/*/trace.json.gz"))


def _analyze(name: str) -> dict:
    files = _trace_files(name)
    assert len(files) == 2, files
    return ta.combine(ta.analyze_ranks([ta.RankInput(str(f)) for f in files], workers=1))


def _assert_categories_add_up(analysis: dict) -> None:
    for step in analysis["steps"]:
        for r in step["ranks"]:
            cpu = sum(r["cpu"].values())
            assert cpu == pytest.approx(r["step_ms"], rel=1e-3, abs=0.01), (step["step"], r)
            if r["gpu"] is not None:
                assert sum(r["gpu"].values()) == pytest.approx(r["step_ms"], rel=1e-3, abs=0.01), r


@pytest.fixture
def store_with(dynprof_dirs):
    """Copy recorded fixture artifacts into the test's store; returns the store."""

    def _copy(*names: str) -> ArtifactStore:
        root = dynprof_dirs["artifacts"]
        for name in names:
            shutil.copytree(TRACES / name, root, dirs_exist_ok=True)
        return ArtifactStore(root)

    return _copy


# -- the streaming reader -----------------------------------------------------------------------
def test_streaming_reader_yields_the_same_events_as_json_load(monkeypatch):
    # GIVEN a real trace, and a reader whose chunks are tiny (events straddle every boundary)
    path = _trace_files("slow1")[0]
    expected = read_trace(path)
    monkeypatch.setattr(ta, "_CHUNK", 97)

    # WHEN it is read as a stream
    header: dict = {}
    events = list(ta.iter_trace(path, header))

    # THEN every event and the header keys come back unchanged
    assert events == expected["traceEvents"]
    assert header["distributedInfo"] == expected["distributedInfo"]
    assert header["schemaVersion"] == expected["schemaVersion"]


def test_reader_refuses_a_trace_larger_than_the_limit():
    path = _trace_files("slow1")[0]
    with pytest.raises(ta.TraceError, match="more than 1000 bytes once decompressed"):
        list(ta.iter_trace(path, max_bytes=1000))


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"traceEvents": [{"ph": "X", "ts": 1', "not valid JSON|truncated"),
        (b"[1, 2, 3]", "no JSON object"),
        (b'{"traceEvents": 5}', "not a list"),
        (b'{"traceEvents": [' + b"[" * 100000 + b"]" * 100000 + b"]}", "nested too deeply|not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8|no JSON object"),
    ],
    ids=["truncated", "array", "events-not-list", "deep", "binary"],
)
def test_reader_rejects_bad_input_with_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(content))
    with pytest.raises(ta.TraceError, match=message):
        list(ta.iter_trace(path))


def test_a_file_that_is_not_gzip_is_a_trace_error(tmp_path):
    path = tmp_path / "trace.json.gz"
    path.write_bytes(b"plain text, not gzip")
    with pytest.raises(ta.TraceError, match="cannot read"):
        list(ta.iter_trace(path))


def test_a_trace_that_is_a_symbolic_link_is_refused(tmp_path):
    real = _trace_files("slow1")[0]
    link = tmp_path / "trace.json.gz"
    link.symlink_to(real)
    with pytest.raises(ta.TraceError, match="symbolic link"):
        list(ta.iter_trace(link))


# -- CPU (gloo) traces --------------------------------------------------------------------------
def test_slow_data_loading_rank_is_named_the_straggler():
    # GIVEN a 2-rank gloo job where rank 1 sleeps 60 ms per step in load_batch
    # WHEN its job-wide trace is analysed
    analysis = _analyze("slow1")

    # THEN rank 1 is the straggler, its time is outside operators and the others wait in allreduce
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1, analysis["straggler_check"]
    assert "outside operators" in s["reason"] and "allreduce" in s["reason"], s["reason"]
    assert s["excess_ms"] > 40
    r0, r1 = analysis["ranks"]
    assert r1["cpu"]["outside_ops"] > 50 and r0["cpu"]["outside_ops"] < 20
    assert r0["cpu"]["collective_wait"] > 40, r0
    assert "noise threshold" in analysis["straggler_check"]
    _assert_categories_add_up(analysis)


def test_with_stack_traces_name_the_slow_function():
    analysis = _analyze("slow1_stack")
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1
    assert "load_batch (straggler_program.py:" in s["reason"], s["reason"]
    _assert_categories_add_up(analysis)


def test_even_job_has_no_straggler():
    analysis = _analyze("even")
    assert analysis["straggler"] is None
    assert analysis["straggler_check"].startswith("no straggler")
    assert "noise threshold" in analysis["straggler_check"]
    _assert_categories_add_up(analysis)


def test_top_ops_hold_the_gloo_collective_and_real_operators():
    analysis = _analyze("slow1")
    names = [r["name"] for r in analysis["top_ops"]]
    assert "gloo:all_reduce" in names
    assert "aten::addmm" in names or "aten::mm" in names
    assert analysis["top_kernels"] == []
    assert all(r["gpu"] is None for r in analysis["ranks"])


# -- synthetic GPU traces (Kineto's schema: kernel / gpu_memcpy on device pids) --------------------
def _gpu_trace(
    path: Path,
    rank: int,
    compute_us: float = 4000,
    comm_start: float = 4000,
    comm_us: float = 3000,
    grid: list[int] | None = None,
    copy_bytes: int | None = None,
) -> Path:
    """A synthetic trace (not recorded), in Kineto's schema: per 10 ms step, a compute kernel from
    1 ms, an NCCL all-reduce on another stream, a memcpy at 6.5-8 ms and a kernel on a third
    stream at 9-9.5 ms; CPU ops on the main thread; the GPU copies of ProfilerStep spans."""
    events: list[dict] = []

    def x(cat: str, name: str, pid: int, tid: int, ts: float, dur: float) -> None:
        e = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur}
        if grid is not None and cat == "kernel":
            e["args"] = {"grid": grid, "block": [128, 1, 1], "device": 0}
        if copy_bytes is not None and cat == "gpu_memcpy":
            e["args"] = {"bytes": copy_bytes, "device": 0}
        events.append(e)

    for k in range(3):
        t = 1_000_000.0 + k * 10_000
        x("user_annotation", f"ProfilerStep#{k + 5}", 7, 7, t, 10_000)
        x("cpu_op", "aten::mm", 7, 7, t + 100, 800)
        x("cuda_runtime", "cudaLaunchKernel", 7, 7, t + 200, 20)
        x("cpu_op", "record_param_comms", 7, 7, t + 1000, 50)
        x("gpu_user_annotation", f"ProfilerStep#{k + 5}", 0, 7, t + 900, 9000)
        x("kernel", "ampere_sgemm_128x64_tn", 0, 7, t + 1000, compute_us)
        x("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 20, t + comm_start, comm_us)
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 21, t + 6500, 1500)
        x("kernel", "elementwise_kernel", 0, 22, t + 9000, 500)
    doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}}
    doc["traceEvents"] = events
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_gpu_breakdown_is_exact_on_a_known_timeline(tmp_path):
    # GIVEN a synthetic GPU trace whose step timeline is known to the microsecond
    path = _gpu_trace(tmp_path / "r0.json.gz", rank=0)

    # WHEN it is analysed
    (r,) = [ta.analyze_rank(ta.RankInput(str(path)))]

    # THEN the GPU categories are the known intervals and add up to the 10 ms step
    g = r["steps"][0]["gpu"]
    assert g["compute"] == pytest.approx(3.5)  # 1-4 ms and the second stream's 9-9.5 ms
    assert g["comm_overlap"] == pytest.approx(1.0)  # 4-5 ms
    assert g["comm"] == pytest.approx(2.0)  # 5-7 ms
    assert g["memcpy"] == pytest.approx(1.0)  # 7-8 ms (6.5-7 is under the NCCL kernel)
    assert g["idle"] == pytest.approx(2.5)
    assert sum(g.values()) == pytest.approx(r["steps"][0]["step_ms"]) == pytest.approx(10.0)
    assert r["steps"][0]["cpu"]["collective"] == pytest.approx(0.05)
    assert [s["step"] for s in r["steps"]] == [5, 6, 7]  # the GPU copies of ProfilerStep are not steps
    assert r["kernels"]["ncclDevKernel_AllReduce_Sum_f32_RING_LL"][0] == 3


def test_gpu_straggler_with_extra_compute_is_named_with_its_kernel(tmp_path):
    # GIVEN two GPU ranks: rank 1's compute kernel runs 3 ms longer (1-8 ms), and rank 0's
    # all-reduce, launched after its own 4 ms of compute, waits for it (5-9 ms)
    p0 = _gpu_trace(tmp_path / "r0.json.gz", rank=0, compute_us=4000, comm_start=5000, comm_us=4000)
    p1 = _gpu_trace(tmp_path / "r1.json.gz", rank=1, compute_us=7000, comm_start=8000, comm_us=1000)

    # WHEN the two are analysed together (in two processes)
    analysis = ta.combine(ta.analyze_ranks([ta.RankInput(str(p0)), ta.RankInput(str(p1))], workers=2))

    # THEN rank 1 is named, with its GPU compute and kernel, and rank 0's AllReduce wait
    s = analysis["straggler"]
    assert s is not None and s["rank"] == 1, analysis["straggler_check"]
    assert "GPU compute 7.5 vs 4.5 ms" in s["reason"] and "ampere_sgemm_128x64_tn" in s["reason"], s["reason"]
    assert "wait 4.0 ms/step in AllReduce (nccl)" in s["reason"], s["reason"]
    assert analysis["top_kernels"][0]["name"] == "ampere_sgemm_128x64_tn"
    _assert_categories_add_up(analysis)
    # and the page draws a GPU bar per rank and the GPU lanes of the timeline
    from collectors._analysis_html import analysis_html

    page = analysis_html(analysis)
    assert page.count("class='seg compute'") == 2 and page.count(">rank 1 GPU<") == 1
    assert "class='lane gpu_comm'" in page and "class='lane gpu_compute'" in page


def _pair(tmp_path, devices, grid1=(64, 1, 1), bytes1=1 << 20):
    """Rank 1's compute kernel runs 3 ms longer than rank 0's (as in the test above), with the
    kernels' launch sizes and the copies' bytes said; ``devices``: each rank's GPU UUID."""
    p0 = _gpu_trace(tmp_path / "r0.json.gz", 0, 4000, 5000, 4000, grid=[64, 1, 1], copy_bytes=1 << 20)
    p1 = _gpu_trace(tmp_path / "r1.json.gz", 1, 7000, 8000, 1000, grid=list(grid1), copy_bytes=bytes1)
    items = [ta.RankInput(str(p), device=d) for p, d in zip((p0, p1), devices)]
    return ta.combine(ta.analyze_ranks(items, workers=1))


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


@pytest.mark.parametrize("uuid", ["", "x" * 101, "GPU-\n1", 7, None])
def test_a_manifest_gpu_device_is_taken_only_when_it_is_a_short_printable_uuid(uuid):
    assert ta.device_of({"gpu_device": {"index": 0, "uuid": uuid}}) is None
    assert ta.device_of({"gpu_device": "GPU-1"}) is None and ta.device_of([]) is None
    assert ta.device_of({"gpu_device": {"index": 0, "uuid": "GPU-ab-12"}}) == "GPU-ab-12"


def test_backward_on_an_autograd_device_thread_counts_as_operators(tmp_path):
    # GIVEN a step (synthetic) whose backward runs on the autograd engine's device thread for
    # 4 ms while the training thread waits, and a data-loader thread busy in an operator
    def x(name: str, tid: int, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 7, "tid": 7, "ts": 0, "dur": 10_000},
        x("aten::linear", 7, 1000, 1000),
        x("autograd::engine::evaluate_function: AddmmBackward0", 9, 2000, 4000),
        x("aten::pin_memory", 11, 0, 10_000),
    ]
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))

    # WHEN it is analysed
    cpu = ta.analyze_rank(ta.RankInput(str(path)))["steps"][0]["cpu"]

    # THEN forward and backward are operator time; the data-loader thread hides nothing
    assert cpu["ops"] == pytest.approx(5.0)
    assert cpu["outside_ops"] == pytest.approx(5.0)


# -- the command --------------------------------------------------------------------------------
def test_analyze_job_prints_the_table_and_saves_an_artifact(store_with, capsys):
    # GIVEN the store holds a job-wide trace group
    store = store_with("slow1")

    # WHEN the job is analysed
    rc = main(["analyze", "--job", "fixture-slow1"])

    # THEN the table has both ranks and the verdict, and an analysis artifact is saved
    out = capsys.readouterr().out
    assert rc == 0
    assert "STRAGGLER on vm: rank 1:" in out
    assert "CPU OPS" in out and "OUTSIDE" in out
    (art,) = store.list(kind="analysis")
    assert art.manifest["job"] == "fixture-slow1"
    assert art.manifest["summary"]["straggler_rank"] == 1
    assert f"saved as {art.id}" in out

    # WHEN it is shown, or given to `dynprof analyze` again
    assert main(["show", art.id]) == 0
    shown = capsys.readouterr().out
    assert main(["analyze", art.id, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)

    # THEN `dynprof show` renders the same table, and the saved analysis comes back as it was
    assert "STRAGGLER on vm: rank 1:" in shown
    assert again["artifact"] == art.id and again["straggler"]["rank"] == 1
    assert len(store.list(kind="analysis")) == 1  # printing a saved analysis saves nothing new


def test_analyze_json_schema(store_with, capsys):
    store_with("even")
    rc = main(["analyze", "--job", "fixture-even", "--json", "--top", "3", "--no-save"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["schema_version"] == ta.SCHEMA_VERSION
    assert {"ranks", "steps", "top_kernels", "top_ops", "straggler"} <= set(data)
    assert data["straggler"] is None
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert len(data["top_ops"]) == 3
    assert data["artifact"] is None
    assert len(data["steps"]) == 3 and len(data["steps"][0]["ranks"]) == 2


def test_analyze_group_by_id_and_by_artifacts(store_with, capsys):
    store = store_with("slow1", "even")
    traces = store.list(job="fixture-slow1", kind="trace")
    group = traces[0].manifest["options"]["group_id"]
    assert main(["analyze", "--group", group[:6], "--json", "--no-save"]) == 0
    by_group = json.loads(capsys.readouterr().out)
    assert main(["analyze", *[a.id for a in traces], "--json", "--no-save"]) == 0
    by_ids = json.loads(capsys.readouterr().out)
    assert by_group["straggler"]["rank"] == by_ids["straggler"]["rank"] == 1


def test_compare_two_groups(store_with, capsys):
    # GIVEN a slow job and an even one in the store
    store = store_with("slow1", "even")
    g = {
        job: store.list(job=job, kind="trace")[0].manifest["options"]["group_id"]
        for job in ("fixture-slow1", "fixture-even")
    }

    # WHEN they are compared
    rc = main(["analyze", "--compare", g["fixture-slow1"], g["fixture-even"], "--json"])

    # THEN the step time and the time outside operators dropped, and the verdicts are given
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    cats = {c["category"]: c for c in data["categories"]}
    assert cats["step_ms"]["delta_ms"] < -20
    assert cats["cpu.collective_wait"]["delta_ms"] < -10
    assert data["straggler"]["a"]["rank"] == 1 and data["straggler"]["b"] is None
    assert data["ops"], "no operators compared"
    assert main(["analyze", "--compare", g["fixture-slow1"], g["fixture-even"]]) == 0
    assert "B-A" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["analyze"], 2, "nothing to analyse"),
        (["analyze", "--job", "nosuchjob"], 1, "no job-wide trace of job 'nosuchjob'"),
        (["analyze", "--group", "ffffff"], 1, "no trace group 'ffffff'"),
        (["analyze", "no/such/artifact"], 1, "no artifact"),
    ],
)
def test_bad_requests_get_a_clear_error(store_with, capsys, argv, code, message):
    store_with("slow1")
    assert main(argv) == code
    assert message in capsys.readouterr().err


def test_a_damaged_trace_is_reported_not_a_traceback(store_with, capsys):
    # GIVEN one rank's trace is truncated
    store = store_with("slow1")
    (victim,) = [a for a in store.list(kind="trace") if a.manifest["rank"] == 0]
    data = victim.file("trace.json.gz").read_bytes()
    victim.file("trace.json.gz").write_bytes(gzip.compress(gzip.decompress(data)[:5000]))

    # WHEN the job is analysed
    rc = main(["analyze", "--job", "fixture-slow1", "--no-save"])

    # THEN the other rank is analysed and the damaged one named in a warning
    captured = capsys.readouterr()
    assert rc == 0
    assert "1 rank(s)" in captured.out
    assert "rank 0 not analysed" in captured.err and "truncated" in captured.err


# -- the web page -------------------------------------------------------------------------------
def test_artifact_page_draws_svg_charts(store_with):
    from dynprof.cli.serve import page_views
    from dynprof.sidecar.app import create_app

    store = store_with("slow1")
    assert main(["analyze", "--job", "fixture-slow1"]) == 0
    (art,) = store.list(kind="analysis")
    page = create_app(store, views=page_views()).test_client().get(f"/artifact/{art.id}").get_data(as_text=True)
    assert page.count("<svg") == 2
    assert "class='seg outside_ops'" in page and "class='lane cpu_wait'" in page
    assert "Straggler: rank 1" in page
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    # each chart is well-formed SVG (XML), with a bar per rank and a lane per rank
    import re
    import xml.etree.ElementTree as ET

    svgs = [ET.fromstring(m) for m in re.findall(r"<svg.*?</svg>", page, re.S)]
    ns = "{http://www.w3.org/2000/svg}"
    labels = [t.text for t in svgs[0].iter(ns + "text")]
    assert "rank 0 CPU" in labels and "rank 1 CPU" in labels
    lanes = [r for r in svgs[1].iter(ns + "rect") if "lane" in (r.get("class") or "")]
    assert lanes and all(float(r.get("width")) > 0 for r in lanes)


def test_traces_over_the_size_limit_are_refused_with_exit_1(store_with, capsys):
    # GIVEN a job's traces, and a decompressed-size limit below their size
    store_with("slow1")

    # WHEN the job is analysed with that limit, as JSON
    rc = main(["analyze", "--job", "fixture-slow1", "--max-trace-bytes", "10K", "--json"])

    # THEN no rank is analysed: exit 1, the reason in the JSON error and on stderr
    captured = capsys.readouterr()
    assert rc == 1
    error = json.loads(captured.out)["error"]
    assert "no trace could be analysed" in error["message"]
    assert "more than 10240 bytes once decompressed" in error["message"]
    assert "--max-trace-bytes" in captured.err


def test_fewer_workers_when_traces_are_large(monkeypatch, tmp_path):
    # GIVEN 8 traces whose gzip trailers say 1 GiB each, and 3 GiB of memory available
    import psutil

    for i in range(8):
        (tmp_path / f"r{i}.json.gz").write_bytes(gzip.compress(b"{}")[:-4] + (1024**3).to_bytes(4, "little"))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 3 * 1024**3})())
    monkeypatch.setattr(ta.os, "cpu_count", lambda: 64)

    # WHEN the number of parallel workers is chosen
    n = ta.default_workers([ta.RankInput(str(p)) for p in tmp_path.glob("*.gz")])

    # THEN it keeps them under half the available memory
    assert n == 1


# -- GPU traces of a 2-rank gloo job sharing one H200 (gradients all-reduced on the CPU), as
# `dynprof start --job J --steps 6` wrote them (tests/gpu/programs/gpu_fault_program.py)
GPU_TRACES = Path(__file__).resolve().parents[1] / "data" / "gpu_traces"


def _gpu_case(case: str, device: str | None = None) -> dict:
    from collectors import trace_analysis as ta

    files = sorted(GPU_TRACES.glob(f"{case}-*.json.gz"))
    assert len(files) == 2
    return ta.combine(ta.analyze_ranks([ta.RankInput(path=str(f), device=device) for f in files], workers=1))


@pytest.mark.parametrize("case,rank,cause", [("gpu-compute", 1, "GPU compute"), ("data-loading", 1, "data loading")])
def test_recorded_stragglers_on_one_shared_h200_are_named_when_the_gpu_is_known_to_be_shared(case, rank, cause):
    # GIVEN the recorded pairs (two ranks on one H200), each rank's GPU said to be that one
    result = _gpu_case(case, device="GPU-5e0c7f2a")
    # THEN the straggler that does more work (60 matmuls more, or a slower loader) is named still
    s = result["straggler"]
    assert s is not None and (s["rank"], s["cause"]) == (rank, cause), result["straggler_check"]


def test_a_gpu_compute_straggler_behind_gloo_collectives_is_named_with_its_kernels():
    # GIVEN rank 1 running 60 extra 2048x2048 matmuls per step, rank 0 waiting for it in gloo
    result = _gpu_case("gpu-compute")
    # THEN rank 1 is the straggler, for GPU compute, with the matmul kernel that holds it
    s = result["straggler"]
    assert s is not None and s["rank"] == 1, result["straggler_check"]
    assert s["cause"] == "GPU compute" and "sgemm" in s["reason"], s["reason"]
    # and the waiting on the CPU side counts as waiting on a GPU trace
    waits = {r["rank"]: r["collective_ms"] for r in result["ranks"]}
    assert waits[0] > waits[1] > 0, waits


def test_a_data_loading_straggler_on_a_gpu_trace_is_named_as_data_loading():
    result = _gpu_case("data-loading")
    s = result["straggler"]
    assert s is not None and s["rank"] == 1, result["straggler_check"]
    assert s["cause"] == "data loading" and "DataLoader" in s["reason"], s["reason"]


def test_an_even_gpu_job_has_no_straggler():
    result = _gpu_case("none")
    assert result["straggler"] is None and result["straggler_check"].startswith("no straggler"), result


@pytest.mark.parametrize(
    "name", ["ProfilerStep#-1", "ProfilerStep#\u0661\u0662", "ProfilerStep# 3", "ProfilerStep#1_0"]
)
def test_a_step_number_is_read_only_in_ascii_digits_and_never_negative(tmp_path, name):
    # GIVEN a trace whose steps are #5, #6 and one span named otherwise (-1, Arabic-Indic 12, ...)
    events = [
        {"ph": "X", "cat": "user_annotation", "name": n, "pid": 7, "tid": 7, "ts": 1e6 + i * 1e4, "dur": 1e4}
        for i, n in enumerate(["ProfilerStep#5", "ProfilerStep#6", name])
    ]
    path = tmp_path / "r0.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    # WHEN it is analysed
    r = ta.analyze_rank(ta.RankInput(str(path)))
    # THEN that span is not a step: no step -1 or 12
    assert [s["step"] for s in r["steps"]] == [5, 6]
    assert ta.profiler_step_number(name) is None and ta.profiler_step_number("ProfilerStep#12") == 12
