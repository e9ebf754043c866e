"""healthcheck.allreduce: the bus-bandwidth factor, the all-reduce's correctness check, and the
entry point's exit codes and JSON, over a fake torch.distributed (no process group is started)."""

from __future__ import annotations

import json

import pytest
import torch

from healthcheck import allreduce
from healthcheck.functional.measurement import Measurement


class FakeDist:
    """The few torch.distributed calls the module makes, for ``world`` ranks seen from ``rank``."""

    def __init__(self, rank: int = 0, world: int = 4, correct: bool = True, elapsed_s: float = 0.5) -> None:
        self.rank, self.world, self.correct, self.elapsed_s = rank, world, correct, elapsed_s
        self.destroyed = False

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("get_rank", "get_world_size", "all_reduce", "barrier", "get_backend", "all_gather"):
            monkeypatch.setattr(allreduce.dist, name, getattr(self, name))
        monkeypatch.setattr(allreduce.dist, "destroy_process_group", self.destroy_process_group)

    def get_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world

    def get_backend(self) -> str:
        return "gloo"

    def barrier(self) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        if op is not None:  # the MAX of the elapsed times: the slowest rank's
            tensor.fill_(self.elapsed_s)
        elif self.correct:
            tensor.fill_(self.world * (self.world + 1) / 2)

    def all_gather(self, out: list[torch.Tensor], mine: torch.Tensor) -> None:
        for t in out:
            t.copy_(mine)

    def destroy_process_group(self) -> None:
        self.destroyed = True


@pytest.mark.parametrize(("world", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_factor_is_nccl_tests_two_n_minus_one_over_n(world, factor):
    assert allreduce.bus_factor(world) == pytest.approx(factor)


def test_a_correct_all_reduce_reports_bus_bandwidth_from_the_slowest_ranks_time(monkeypatch):
    # GIVEN 4 ranks whose sum is right and whose slowest rank took 0.5 s for 10 iterations
    FakeDist(world=4, elapsed_s=0.5).install(monkeypatch)
    # WHEN 1 MiB is measured
    m = allreduce.allreduce_busbw(torch.device("cpu"), size_bytes=1024**2, warmup=1, iters=10)
    # THEN algbw = bytes / per-iteration time, busbw = algbw * 2 (n - 1) / n
    algbw = 1024**2 / 0.05 / 1e9
    assert m.ok is True and m.reason == ""
    assert m.value == pytest.approx(algbw * 1.5)
    assert m.metric == "allreduce_busbw_gbps_4gpu" and m.unit == "GB/s"
    assert (m.details["world_size"], m.details["bytes"], m.details["iterations"]) == (4, 1024**2, 10)


def test_a_wrong_sum_is_reported_as_wrong(monkeypatch):
    # GIVEN an all-reduce that leaves each rank's value unsummed
    FakeDist(world=4, correct=False).install(monkeypatch)
    # WHEN measured
    m = allreduce.allreduce_busbw(torch.device("cpu"), size_bytes=4096, warmup=0, iters=2)
    # THEN the measurement is not ok and says why
    assert m.ok is False
    assert m.reason == "all-reduce returned a wrong sum"


def test_a_size_not_a_multiple_of_four_bytes_is_rounded_down_to_whole_floats(monkeypatch):
    FakeDist(world=2).install(monkeypatch)
    m = allreduce.allreduce_busbw(torch.device("cpu"), size_bytes=4099, warmup=0, iters=1)
    assert m.details["bytes"] == 4096


def test_gather_hostnames_gives_each_ranks_name(monkeypatch):
    # GIVEN 3 ranks (the fake gathers this rank's name three times)
    FakeDist(world=3).install(monkeypatch)
    monkeypatch.setattr(allreduce.socket, "gethostname", lambda: "node-a17")
    # WHEN gathered
    # THEN the names come back decoded, without the tensor's zero padding
    assert allreduce.gather_hostnames(torch.device("cpu")) == ["node-a17"] * 3


def test_gather_hostnames_cuts_a_name_longer_than_its_buffer(monkeypatch):
    FakeDist(world=1).install(monkeypatch)
    monkeypatch.setattr(allreduce.socket, "gethostname", lambda: "h" * 400)
    [name] = allreduce.gather_hostnames(torch.device("cpu"))
    assert name == "h" * allreduce.HOSTNAME_BYTES


def test_main_without_a_cuda_device_says_so_and_exits_3(monkeypatch, capsys):
    # GIVEN no CUDA device (and no --cpu)
    monkeypatch.setattr(allreduce.torch.cuda, "is_available", lambda: False)
    # WHEN run
    code = allreduce.main([])
    # THEN it exits "could not run" with one JSON object naming the reason
    out = json.loads(capsys.readouterr().out)
    assert code == 3
    assert out == {"schema": allreduce.ALLREDUCE_SCHEMA, "error": "no CUDA device visible"}


def test_main_reports_a_failed_rendezvous_on_stderr_and_exits_3(monkeypatch, capsys):
    # GIVEN a process group that cannot be formed
    def fail(device, timeout_s):
        raise RuntimeError("connect timeout to HEAD:29500")

    monkeypatch.setattr(allreduce, "init_process_group", fail)
    monkeypatch.setenv("RANK", "5")
    # WHEN run
    code = allreduce.main(["--cpu"])
    # THEN it does not hang or raise: exit 3 and the error as JSON on stderr
    err = json.loads(capsys.readouterr().err)
    assert code == 3
    assert err["rank"] == "5" and "connect timeout" in err["error"]


def fake_run(monkeypatch, value: float, ok: bool = True, rank: int = 0, hosts=("b", "a", "a", "")) -> FakeDist:
    fake = FakeDist(rank=rank)
    fake.install(monkeypatch)
    monkeypatch.setattr(allreduce, "init_process_group", lambda device, timeout_s: None)
    measurement = Measurement("allreduce", "allreduce_busbw_gbps_4gpu", value, "GB/s", ok, "" if ok else "wrong")
    monkeypatch.setattr(allreduce, "allreduce_busbw", lambda device, size, iters: measurement)
    monkeypatch.setattr(allreduce, "gather_hostnames", lambda device: list(hosts))
    return fake


def test_main_on_rank_0_prints_the_figures_and_exits_0_when_fast_enough(monkeypatch, capsys):
    # GIVEN a correct all-reduce of 350 GB/s and a floor of 300
    fake = fake_run(monkeypatch, 350.0)
    # WHEN run
    code = allreduce.main(["--cpu", "--min-busbw-gbps", "300"])
    # THEN it passes, names each node once (sorted, empty names dropped), and leaves the group
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["ok"], out["busbw_gbps"], out["min_busbw_gbps"], out["reason"]) == (True, 350.0, 300.0, "")
    assert out["nodes"] == ["a", "b"]
    assert fake.destroyed


def test_main_fails_a_bandwidth_below_the_floor_as_slow(monkeypatch, capsys):
    fake_run(monkeypatch, 250.0)
    code = allreduce.main(["--cpu", "--min-busbw-gbps", "300"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2
    assert (out["ok"], out["reason"]) == (False, "slow")


def test_main_fails_a_wrong_sum_whatever_its_speed(monkeypatch, capsys):
    fake_run(monkeypatch, 9999.0, ok=False)
    code = allreduce.main(["--cpu"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2
    assert (out["ok"], out["reason"]) == (False, "wrong")


def test_only_rank_0_prints_but_every_rank_gives_the_exit_code(monkeypatch, capsys):
    fake_run(monkeypatch, 250.0, rank=3)
    code = allreduce.main(["--cpu", "--min-busbw-gbps", "300"])
    assert code == 2
    assert capsys.readouterr().out == ""


def test_main_leaves_nvls_off_unless_told(monkeypatch, capsys):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    fake_run(monkeypatch, 1.0)
    allreduce.main(["--cpu"])
    assert allreduce.os.environ["NCCL_NVLS_ENABLE"] == "0"
    capsys.readouterr()
