"""healthcheck.functional.worker: the events a worker writes for the launcher, each check run on
the CPU device with tiny sizes, the transfer lock, and the NVML sampler over a fake pynvml."""

from __future__ import annotations

import fcntl
import json
import sys
import types
from unittest import mock

import pytest
import torch

from healthcheck.functional import worker

CPU = torch.device("cpu")


def events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_emit_writes_one_json_object_a_line(capsys):
    worker.emit("result", check="gemm_bf16", value=torch.device("cpu"))
    [event] = events(capsys.readouterr().out)
    assert event == {"event": "result", "check": "gemm_bf16", "value": "cpu"}, "odd values are written as text"


def test_a_run_writes_ready_start_result_and_done_and_an_error_does_not_stop_it(monkeypatch, capsys):
    # GIVEN a spec with a check that works, one that does not exist, and another that works
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    spec = {
        "device_type": "cpu",
        "checks": ["memory_bandwidth", "no_such_check", "memory_pattern"],
        "params": {
            "memory_bandwidth": {"size_bytes": 64 * 1024, "warmup_s": 0.0, "iters": 2},
            "memory_pattern": {"fraction": 1.0, "chunk_bytes": 64 * 1024, "free_bytes": 64 * 1024},
        },
    }
    # WHEN the worker runs
    assert worker.main([json.dumps(spec)]) == 0
    got = events(capsys.readouterr().out)
    # THEN the launcher sees every step, in order, and the error names its check
    assert [(e["event"], e.get("check")) for e in got] == [
        ("ready", None),
        ("start", "memory_bandwidth"),
        ("result", "memory_bandwidth"),
        ("start", "no_such_check"),
        ("error", "no_such_check"),
        ("start", "memory_pattern"),
        ("result", "memory_pattern"),
        ("done", None),
    ]
    assert got[0]["name"] == "cpu" and got[0]["local_rank"] == 0
    assert got[4]["message"] == "ValueError: unknown check 'no_such_check'"
    assert got[2]["measurement"]["metric"] == "memory_bandwidth_gbps"


def test_run_check_gives_each_check_its_measurements():
    sampler = worker.NvmlSampler(None)
    transfer = worker.run_check("host_transfer", CPU, {"size_bytes": 4096, "iters": 1}, sampler, None)
    gemm = worker.run_check(
        "gemm_bf16", CPU, {"n": 16, "warmup_s": 0.0, "measure_s": 0.001, "repeats": 1}, sampler, None
    )
    assert [m.check for m in transfer] == ["h2d_bandwidth", "d2h_bandwidth"]
    assert [m.check for m in gemm] == ["gemm_bf16"]


def test_run_check_refuses_an_unknown_check():
    with pytest.raises(ValueError, match="unknown check 'bogus'"):
        worker.run_check("bogus", CPU, {}, worker.NvmlSampler(None), None)


def test_the_identity_of_the_cpu_device():
    assert worker.device_identity(CPU) == {"name": "cpu", "uuid": None}


def test_exclusive_holds_the_lock_file_while_inside(tmp_path):
    lock = tmp_path / "host_transfer.lock"
    with worker.exclusive(str(lock)):
        # another open file description cannot take the lock meanwhile
        with open(lock) as other:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on the way out


def test_exclusive_without_a_lock_path_is_a_plain_block():
    entered = []
    with worker.exclusive(None):
        entered.append(True)
    assert entered == [True]


def test_a_sampler_without_a_uuid_reads_nothing():
    sampler = worker.NvmlSampler(None)
    assert sampler.clocks() == {} and sampler.pcie() == {}


def fake_pynvml(fail_init: bool = False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM = 1
    nv.NVML_TEMPERATURE_GPU = 0

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def power(handle):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nv.nvmlInit = init
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: ("handle", uuid)
    nv.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == 1 else 0
    nv.nvmlDeviceGetCurrentClocksThrottleReasons = lambda h: 0x4
    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61
    nv.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    return nv


def test_the_sampler_reads_clocks_and_pcie_and_leaves_out_what_fails():
    with mock.patch.dict(sys.modules, {"pynvml": fake_pynvml()}):
        sampler = worker.NvmlSampler("GPU-1234")
        clocks, pcie = sampler.clocks(), sampler.pcie()
    # the older throttle-reasons call is used where the newer one is missing; power fails and is left out
    assert clocks == {"sm_clock_mhz": 1980, "clock_event_reasons": 4, "temperature_c": 61}
    assert pcie == {"pcie_gen_under_load": 5, "pcie_width_under_load": 16}


def test_a_sampler_whose_nvml_does_not_load_reads_nothing():
    with mock.patch.dict(sys.modules, {"pynvml": fake_pynvml(fail_init=True)}):
        sampler = worker.NvmlSampler("GPU-1234")
    assert sampler.clocks() == {} and sampler.pcie() == {}
