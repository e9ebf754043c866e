"""healthcheck.functional.table: the rows of the functional checks, held whole (every level a row
runs at has its parameters and its time limit, names are unique), the runner's and the
launcher's views read from them, and the worker running every row by its row on the CPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from healthcheck.checks import table as checks_table
from healthcheck.functional import table, worker
from healthcheck.functional.launcher import free_port, level_plan
from healthcheck.functional.measurement import Measurement
from healthcheck.functional.table import CHECKS, HOST_FUNCTIONAL_CHECKS, Check, Scope, Target, check_named, find
from healthcheck.options import LEVELS

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


class FakeSampler:
    """Readings a worker would take of its device through NVML while a check runs."""

    def clocks(self) -> dict:
        return {"sm_clock_mhz": 1980, "clock_event_reasons": 0x1}

    def pcie(self) -> dict:
        return {"pcie_gen_under_load": 5, "pcie_width_under_load": 16}


# The smallest sizes of each check, to run every row on the CPU in a moment. A new row needs its
# line here (test_every_row_has_tiny_parameters_here says so).
TINY: dict[str, dict] = {
    "gemm_bf16": {"n": 16, "warmup_s": 0.0, "measure_s": 0.001, "repeats": 1},
    "memory_bandwidth": {"size_bytes": 64 * 1024, "warmup_s": 0.0, "iters": 2},
    "host_transfer": {"size_bytes": 64 * 1024, "iters": 1},
    "memory_pattern": {"fraction": 1.0, "chunk_bytes": 64 * 1024, "free_bytes": 64 * 1024},
    "allreduce": {"size_bytes": 4096, "warmup": 1, "iters": 2, "init_timeout_s": 60},
    "host_gemm_fp32": {"n": 32, "measure_s": 0.001, "repeats": 1, "warmup_s": 0.0},
    "host_memory_bandwidth": {"size_bytes": 64 * 1024, "iters": 1, "repeats": 1},
}


# -- the rows are whole ---------------------------------------------------------------------------
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_every_level_of_a_row_has_its_parameters_and_a_positive_timeout(check: Check):
    assert check.levels, "a row runs at some level"
    assert set(check.levels) <= set(LEVELS) - {"quick"}, "quick measures nothing"
    assert set(check.params_by_level) == set(check.levels), "parameters for exactly the row's levels"
    assert set(check.timeout_by_level) == set(check.levels), "a time limit for exactly the row's levels"
    for level in check.levels:
        assert isinstance(check.params(level), dict)
        assert check.timeout(level) > 0


def test_the_names_of_the_rows_and_of_their_results_are_unique_among_all_checks():
    names = [c.name for c in CHECKS]
    assert len(names) == len(set(names))
    results = [name for c in CHECKS for name in (*c.result_names, *c.under_load)]
    assert len(results) == len(set(results))
    # a functional result never takes the name of a passive or host check (--skip names one check)
    assert not set(results) & set(checks_table.PASSIVE_CHECKS + checks_table.HOST_CHECKS)
    assert len(checks_table.ALL_CHECKS) == len(set(checks_table.ALL_CHECKS))


def test_a_rows_results_are_its_name_unless_it_names_them():
    assert check_named("gemm_bf16").result_names == ("gemm_bf16",)
    assert check_named("host_transfer").result_names == ("h2d_bandwidth", "d2h_bandwidth")


def test_the_runners_lists_are_read_from_the_rows_in_table_order():
    # each row's results, then the checks judged under its load, row after row
    expected = [name for c in CHECKS if c.scope is not Scope.HOST for name in (*c.result_names, *c.under_load)]
    assert list(checks_table.FUNCTIONAL_CHECKS) == expected
    assert checks_table.FUNCTIONAL_CHECKS[:2] == ("gemm_bf16", "clocks_under_load")
    assert HOST_FUNCTIONAL_CHECKS == tuple(c.name for c in CHECKS if c.scope is Scope.HOST)
    assert table.PER_DEVICE_CHECKS == tuple(c.name for c in CHECKS if c.scope is Scope.DEVICE)
    assert set(checks_table.ALL_CHECKS) >= set(checks_table.FUNCTIONAL_CHECKS + HOST_FUNCTIONAL_CHECKS)


def test_every_functional_check_is_documented():
    docs = ROOT / "docs"
    text = (docs / "healthcheck.md").read_text() + (docs / "preflight.md").read_text()
    missing = [name for name in checks_table.FUNCTIONAL_CHECKS + HOST_FUNCTIONAL_CHECKS if f"`{name}`" not in text]
    assert not missing, f"document these checks in docs/healthcheck.md: {missing}"


@pytest.mark.parametrize("level", ["standard", "full"])
def test_the_launchers_plan_of_a_level_is_its_rows(level):
    plan = level_plan(level)
    assert plan.params == {c.name: dict(c.params_by_level[level]) for c in CHECKS if level in c.levels}
    assert plan.timeouts == {c.name: c.timeout_by_level[level] for c in CHECKS if level in c.levels}
    # the plan is a copy: the worker's run function may change its parameters
    plan.params["gemm_bf16"]["n"] = 1
    assert check_named("gemm_bf16").params_by_level[level]["n"] == 8192


def test_the_standard_time_limits_are_the_documented_ones():
    # docs/healthcheck.md: GEMM 60 s, memory bandwidth 30 s, host transfers 30 s, memory pattern
    # 60 s, all-reduce 120 s
    documented = {"gemm_bf16": 60, "memory_bandwidth": 30, "host_transfer": 30, "memory_pattern": 60, "allreduce": 120}
    timeouts = level_plan("standard").timeouts
    assert {name: timeouts[name] for name in documented} == documented


# -- the worker runs every row by its row ---------------------------------------------------------
def test_every_row_has_tiny_parameters_here():
    assert set(TINY) == {c.name for c in CHECKS}, "give a new check its smallest parameters in TINY"


@pytest.fixture
def one_rank_group(monkeypatch):
    """The environment of a worker alone in its process group (a node check on one device)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.name)
def test_the_worker_runs_every_row_and_its_results_carry_the_rows_names(check: Check, one_rank_group):
    got = worker.run_check(check.name, CPU, dict(TINY[check.name]), FakeSampler(), None)
    assert [m.check for m in got] == list(check.result_names)
    assert all(isinstance(m, Measurement) and m.ok for m in got), got


def test_a_run_function_is_given_the_workers_device_and_its_sampler():
    gemm = worker.run_check("gemm_bf16", CPU, dict(TINY["gemm_bf16"]), FakeSampler(), None)
    h2d, d2h = worker.run_check("host_transfer", CPU, dict(TINY["host_transfer"]), FakeSampler(), None)
    # the GEMM reads the clocks under load, the host-to-device copy the PCIe link
    assert gemm[0].details["sm_clock_mhz"] == 1980
    assert h2d.details["pcie_gen_under_load"] == 5 and "pcie_gen_under_load" not in d2h.details


def test_the_worker_dispatches_by_the_row_it_finds(monkeypatch):
    # GIVEN a row whose run function records what it is given
    seen: list[tuple[Target, dict]] = []

    def run(on: Target, params: dict) -> list[Measurement]:
        seen.append((on, params))
        return [Measurement("probe", "probe_x", 1.0, "x")]

    row = dataclasses.replace(check_named("memory_bandwidth"), name="probe", run=run)
    monkeypatch.setattr(worker, "check_named", lambda name: row if name == "probe" else check_named(name))
    sampler = FakeSampler()
    # WHEN the worker runs it
    got = worker.run_check("probe", CPU, {"size": 3}, sampler, None)
    # THEN the row's function ran, on the worker's device and sampler, with the parameters
    assert [m.metric for m in got] == ["probe_x"]
    assert seen == [(Target(CPU, sampler), {"size": 3})]


def test_only_a_row_that_runs_one_at_a_time_takes_the_transfer_lock(monkeypatch, capsys, tmp_path):
    # GIVEN a spec with a check of every device at once, then the host transfer
    held: list[str | None] = []
    real = worker.exclusive

    def exclusive(lock_path):
        held.append(lock_path)
        return real(lock_path)

    monkeypatch.setattr(worker, "exclusive", exclusive)
    monkeypatch.setenv("LOCAL_RANK", "0")
    lock = str(tmp_path / "host_transfer.lock")
    spec = {
        "device_type": "cpu",
        "checks": ["memory_bandwidth", "host_transfer"],
        "params": {name: TINY[name] for name in ("memory_bandwidth", "host_transfer")},
        "transfer_lock": lock,
    }
    # WHEN the worker runs
    assert worker.main([json.dumps(spec)]) == 0
    # THEN only the host transfer held the lock
    assert held == [None, lock]
    assert check_named("host_transfer").one_at_a_time and not check_named("memory_bandwidth").one_at_a_time


# -- an unknown name ------------------------------------------------------------------------------
def test_an_unknown_check_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"^unknown check 'gemm_fp64'$"):
        check_named("gemm_fp64")
    assert find("gemm_fp64") is None
    assert "gemm_fp64" not in level_plan("full").params


def test_the_worker_says_an_unknown_check_is_unknown_and_goes_on(monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    spec = {"device_type": "cpu", "checks": ["gemm_fp64", "memory_bandwidth"], "params": TINY}
    assert worker.main([json.dumps(spec)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    errors = [e for e in events if e["event"] == "error"]
    assert errors == [{"event": "error", "check": "gemm_fp64", "message": "ValueError: unknown check 'gemm_fp64'"}]
    assert [e["check"] for e in events if e["event"] == "result"] == ["memory_bandwidth"]
