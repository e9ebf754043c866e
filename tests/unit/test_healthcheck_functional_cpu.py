"""healthcheck.functional.cpu: the host's own figures (CPU GEMM, host memory bandwidth) with tiny
sizes, and the CPU model they are grouped by."""

from __future__ import annotations

import io

import pytest
import torch

from healthcheck.functional import cpu


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # The figures set torch's thread count (they run in a worker of their own); put it back.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def fake_cpuinfo(monkeypatch, text: str | None) -> None:
    def fake_open(path, *args, **kwargs):
        assert path == "/proc/cpuinfo"
        if text is None:
            raise PermissionError(13, "Permission denied")
        return io.StringIO(text)

    monkeypatch.setattr(cpu, "open", fake_open, raising=False)


def test_the_cpu_model_is_the_first_model_name_of_proc_cpuinfo(monkeypatch):
    fake_cpuinfo(monkeypatch, "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nmodel name\t: other\n")
    assert cpu.cpu_model() == "AMD EPYC 9654 96-Core Processor"


def test_arm_cpuinfo_names_the_model_under_another_key(monkeypatch):
    fake_cpuinfo(monkeypatch, "processor : 0\nBogoMIPS : 50\nModel : Neoverse-V2\n")
    assert cpu.cpu_model() == "Neoverse-V2"


def test_an_empty_model_name_is_skipped(monkeypatch):
    fake_cpuinfo(monkeypatch, "model name :   \ncpu model : R4000\n")
    assert cpu.cpu_model() == "R4000"


def test_a_model_name_is_cut_to_its_limit(monkeypatch):
    fake_cpuinfo(monkeypatch, "model name : " + "X" * 1000 + "\n")
    assert cpu.cpu_model() == "X" * cpu.MAX_MODEL_CHARS


def test_without_cpuinfo_the_machine_type_is_used(monkeypatch):
    fake_cpuinfo(monkeypatch, None)
    assert cpu.cpu_model() == cpu.os.uname().machine


def test_host_gemm_is_correct_on_one_thread_and_names_its_peer_group():
    m = cpu.host_gemm(n=64, measure_s=0.01, repeats=3, warmup_s=0.005)
    assert m.ok is True and m.reason == ""
    assert (m.metric, m.unit) == ("host_gemm_fp32_gflops", "GFLOP/s")
    assert m.details["threads"] == 1
    assert m.details["peer_group"] == f"cpu {cpu.cpu_model()}"
    # the figure is the best of the repeats
    assert m.value == pytest.approx(max(m.details["all_gflops"]), abs=0.1)
    assert m.details["max_rel_error"] <= 1e-4


def test_host_gemm_uses_at_least_one_thread():
    m = cpu.host_gemm(n=16, measure_s=0.002, repeats=1, warmup_s=0.0, threads=0)
    assert m.details["threads"] == 1


def test_host_memory_bandwidth_counts_read_and_written_bytes_and_checks_the_copy():
    m = cpu.host_memory_bandwidth(size_bytes=256 * 1024, iters=2, repeats=3)
    assert m.ok is True
    assert (m.metric, m.unit) == ("host_memory_bandwidth_gbps", "GB/s")
    assert (m.details["bytes"], m.details["iterations"], m.details["repeats"]) == (256 * 1024, 2, 3)
    assert m.details["cpus"] >= 1 and m.value > 0
