"""healthcheck.functional.launcher: the level plans, and the supervision of worker processes:
here each worker is a small shell script that writes the events a real worker would (no torch
is started), so timeouts, crashes and errors are crafted."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from healthcheck.functional import launcher
from healthcheck.functional.launcher import (
    CheckOutcome,
    LevelPlan,
    level_plan,
    run_workers,
)
from healthcheck.functional.table import HOST_FUNCTIONAL_CHECKS, PER_DEVICE_CHECKS

READY = {"event": "ready", "pid": 4242, "name": "Fake GPU", "uuid": "GPU-fake"}


def measurement(check: str, value: float = 100.0) -> dict:
    return {
        "check": check,
        "metric": f"{check}_x",
        "value": value,
        "unit": "GB/s",
        "ok": True,
        "reason": "",
        "details": {},
    }


def lines(*events: dict | str) -> str:
    """A shell command printing each event as a line (strings are printed as they are)."""
    return "; ".join(f"printf '%s\\n' {shlex.quote(e if isinstance(e, str) else json.dumps(e))}" for e in events)


@pytest.fixture
def workers(monkeypatch):
    """Replace each worker by the shell script ``scripts[local_rank]``; record what it was given."""
    scripts: dict[int, str] = {}
    seen: list[dict] = []
    real = subprocess.Popen

    def popen(argv, **kwargs):
        env = kwargs["env"]
        rank = int(env["LOCAL_RANK"])
        seen.append({"argv": argv, "env": env, "spec": json.loads(argv[-1])})
        return real(["/bin/sh", "-c", scripts[rank]], **kwargs)

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    return scripts, seen


def by_check(outcomes: list[CheckOutcome], rank: int = 0) -> dict[str, CheckOutcome]:
    return {o.check: o for o in outcomes if o.local_rank == rank}


# -- plans ------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["standard", "full"])
def test_every_functional_check_has_parameters_and_a_timeout_at_each_level(level):
    plan = level_plan(level)
    for check in (*PER_DEVICE_CHECKS, *HOST_FUNCTIONAL_CHECKS, "allreduce"):
        assert check in plan.params, check
        assert plan.timeouts[check] > 0, check


def test_full_measures_longer_than_standard_with_the_same_all_reduce_size():
    standard, full = level_plan("standard"), level_plan("full")
    assert full.params["gemm_bf16"]["measure_s"] > standard.params["gemm_bf16"]["measure_s"]
    assert all(full.timeouts[c] >= standard.timeouts[c] for c in standard.timeouts)
    # the baseline of the all-reduce is for one message size
    assert full.params["allreduce"]["size_bytes"] == standard.params["allreduce"]["size_bytes"]


def test_a_level_other_than_full_gets_the_standard_plan():
    assert level_plan("quick") == level_plan("standard")


# -- supervision ------------------------------------------------------------------------------
def test_each_worker_gets_its_rank_and_the_spec_and_its_results_are_collected(workers):
    # GIVEN two workers that each measure both checks
    scripts, seen = workers
    checks = ["memory_bandwidth", "host_transfer"]
    for rank in (0, 1):
        scripts[rank] = lines(
            READY,
            {"event": "start", "check": "memory_bandwidth"},
            {
                "event": "result",
                "check": "memory_bandwidth",
                "measurement": measurement("memory_bandwidth", 10.0 + rank),
            },
            {"event": "start", "check": "host_transfer"},
            {"event": "result", "check": "host_transfer", "measurement": measurement("h2d")},
            {"event": "result", "check": "host_transfer", "measurement": measurement("d2h")},
            {"event": "done"},
        )
    # WHEN run
    outcomes, identities = run_workers([0, 1], checks, level_plan("standard"), device_type="cpu")
    # THEN every check of every worker has its measurements, and each worker said who it is
    assert [(o.local_rank, o.check, o.error) for o in outcomes] == [
        (0, "memory_bandwidth", None),
        (0, "host_transfer", None),
        (1, "memory_bandwidth", None),
        (1, "host_transfer", None),
    ]
    assert by_check(outcomes, 1)["memory_bandwidth"].measurements[0].value == 11.0
    assert [m.check for m in by_check(outcomes)["host_transfer"].measurements] == ["h2d", "d2h"]
    assert [(i.local_rank, i.pid, i.uuid) for i in identities] == [(0, 4242, "GPU-fake"), (1, 4242, "GPU-fake")]
    # AND each worker was started with its ranks, one rendezvous on loopback, and the plan's sizes
    envs = [s["env"] for s in seen]
    assert [(e["LOCAL_RANK"], e["RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "2"), ("1", "1", "2")]
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    spec = seen[0]["spec"]
    assert spec["checks"] == checks and spec["device_type"] == "cpu"
    assert spec["params"]["memory_bandwidth"] == level_plan("standard").params["memory_bandwidth"]
    # AND the working directory (with the transfer lock) is gone
    assert not Path(spec["transfer_lock"]).parent.exists()


def test_an_error_event_is_the_checks_outcome_and_the_next_check_still_runs(workers):
    scripts, _ = workers
    scripts[0] = lines(
        READY,
        {"event": "start", "check": "gemm_bf16"},
        {"event": "error", "check": "gemm_bf16", "message": "RuntimeError: CUDA error: out of memory"},
        "this line is not JSON and is ignored",
        {"event": "start", "check": "memory_bandwidth"},
        {"event": "result", "check": "memory_bandwidth", "measurement": measurement("memory_bandwidth")},
        {"event": "done"},
    )
    outcomes = by_check(run_workers([0], ["gemm_bf16", "memory_bandwidth"], level_plan("standard"))[0])
    assert outcomes["gemm_bf16"].error == "RuntimeError: CUDA error: out of memory"
    assert outcomes["memory_bandwidth"].error is None and outcomes["memory_bandwidth"].measurements


def test_a_worker_that_dies_names_its_exit_code_the_check_and_its_last_words(workers):
    # GIVEN a worker that crashes in the middle of the GEMM, with a message on stderr
    scripts, _ = workers
    scripts[0] = lines(READY, {"event": "start", "check": "gemm_bf16"}) + "; echo 'Segmentation fault' >&2; exit 139"
    # WHEN run
    outcomes = by_check(run_workers([0], ["gemm_bf16", "memory_pattern"], level_plan("standard"))[0])
    # THEN the GEMM says why, and the check after it was not run for that reason
    assert outcomes["gemm_bf16"].error == "worker exited with code 139 during gemm_bf16: Segmentation fault"
    assert outcomes["memory_pattern"].error.startswith("not run: worker exited with code 139")


def test_a_check_that_outlives_its_timeout_is_killed_and_unknown_never_pass(workers):
    # GIVEN a worker stuck in the GEMM (a hung device) and a 0.2 s limit for it
    scripts, _ = workers
    scripts[0] = lines(READY, {"event": "start", "check": "gemm_bf16"}) + "; exec sleep 30"
    plan = LevelPlan(params={}, timeouts={"gemm_bf16": 0.2})
    # WHEN run
    outcomes = by_check(run_workers([0], ["gemm_bf16", "memory_pattern"], plan)[0])
    # THEN the GEMM timed out naming itself, the worker was killed, and no measurement is reported
    assert "in gemm_bf16 (device hung or far too slow); worker killed" in outcomes["gemm_bf16"].error
    assert outcomes["gemm_bf16"].measurements == []
    assert outcomes["memory_pattern"].error.startswith("not run: timed out")


def test_a_worker_that_never_starts_up_is_killed_after_the_startup_limit(workers, monkeypatch):
    scripts, _ = workers
    scripts[0] = "exec sleep 30"
    monkeypatch.setattr(launcher, "STARTUP_TIMEOUT_S", 0.2)
    outcomes, identities = run_workers([0], ["gemm_bf16"], level_plan("standard"))
    assert outcomes[0].error.startswith("not run: timed out") and "in startup" in outcomes[0].error
    assert identities[0].pid is None, "a worker that never said ready has no identity"


def test_the_timeout_scale_stretches_every_limit(workers, monkeypatch):
    # GIVEN a 0.05 s startup limit stretched 100 times, and a worker ready after a short wait
    scripts, _ = workers
    scripts[0] = "sleep 0.1; " + lines(READY, {"event": "done"})
    monkeypatch.setattr(launcher, "STARTUP_TIMEOUT_S", 0.05)
    outcomes, identities = run_workers([0], ["gemm_bf16"], level_plan("standard"), timeout_scale=100)
    # THEN it was not killed at startup; a check it never ran is "did not run"
    assert identities[0].pid == 4242
    assert outcomes[0].error == "did not run"


def test_progress_names_the_device_and_the_check(workers):
    scripts, _ = workers
    scripts[3] = lines(READY, {"event": "start", "check": "memory_pattern"}, {"event": "done"})
    said: list[str] = []
    run_workers([3], ["memory_pattern"], level_plan("standard"), progress=said.append)
    assert said == ["device 3: memory_pattern"]


def test_the_all_reduce_gets_its_rendezvous_timeout_scaled(workers):
    scripts, seen = workers
    scripts[0] = lines(READY, {"event": "done"})
    run_workers([0], ["allreduce"], level_plan("standard"), timeout_scale=2.0)
    assert seen[0]["spec"]["params"]["allreduce"]["init_timeout_s"] == level_plan("standard").timeouts["allreduce"] * 2
