"""healthcheck.links.side: one side of a link test answers within its limit whatever its worker
does, and trusts nothing the worker prints. The worker here is a small shell script standing in
for ``python -m healthcheck.links.worker`` (no torch, no network)."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from healthcheck.links import side
from healthcheck.links.side import MAX_WORKER_OUTPUT, SideResult, run_side
from healthcheck.links.worker import LINK_SIDE_SCHEMA

GOOD = {
    "schema": LINK_SIDE_SCHEMA,
    "busbw_gbps": 48.5,
    "algbw_gbps": 48.5,
    "bus_factor": 1.0,
    "seconds": 0.0013,
    "backend": "gloo",
    "pattern": "sendrecv",
    "size_bytes": 65536,
    "iters": 10,
    "interface": "eth0",
    "late_s": None,
}


@pytest.fixture
def worker(monkeypatch):
    """Make the side's worker the shell command ``script[0]``; record the argv and env it got."""
    script: list[str] = ["true"]
    seen: list[dict] = []
    real = subprocess.Popen

    def popen(argv, **kwargs):
        seen.append({"argv": argv, "env": kwargs.get("env"), "session": kwargs.get("start_new_session")})
        return real(["/bin/sh", "-c", script[0]], **kwargs)

    monkeypatch.setattr(side.subprocess, "Popen", popen)
    return script, seen


def answer(doc: object) -> str:
    return f"printf '%s' {shlex.quote(json.dumps(doc))}"


def side_of(**kwargs) -> SideResult:
    args = {"rank": 1, "world": 2, "store_host": "10.0.0.1", "store_port": 29400, "limit_s": 5.0, **kwargs}
    return run_side(**args)


def test_a_good_answer_is_read_into_the_result(worker):
    script, _ = worker
    script[0] = answer(GOOD)
    result = side_of(pattern="sendrecv", size_bytes=65536, iters=10)
    assert (result.status, result.rank, result.world) == ("ok", 1, 2)
    assert (result.busbw_gbps, result.backend, result.size_bytes, result.iters) == (48.5, "gloo", 65536, 10)
    assert result.interface == "eth0" and result.error is None
    assert result.to_json()["busbw_gbps"] == 48.5


def test_the_worker_is_started_in_its_own_session_with_the_sides_arguments_and_no_agent(worker, monkeypatch):
    script, seen = worker
    script[0] = answer(GOOD)
    monkeypatch.setenv("DYNPROF", "1")
    side_of(backend="gloo", pattern="allreduce", size_bytes=4096, iters=3, warmup=1, start_at=12.5, bind="10.0.0.1")
    [call] = seen
    argv = call["argv"]
    assert argv[1:3] == ["-m", "healthcheck.links.worker"]
    for arg in ("--rank=1", "--world=2", "--store-host=10.0.0.1", "--store-port=29400", "--backend=gloo"):
        assert arg in argv
    assert {"--pattern=allreduce", "--size=4096", "--iters=3", "--warmup=1", "--start-at=12.5"} <= set(argv)
    assert "--bind=10.0.0.1" in argv and "--timeout=5.0" in argv
    assert call["session"] is True, "its own process group, so that all of it can be killed"
    assert "DYNPROF" not in call["env"]


def test_no_bind_means_no_bind_argument(worker):
    script, seen = worker
    script[0] = answer(GOOD)
    side_of()
    assert not any(a.startswith("--bind") for a in seen[0]["argv"])


@pytest.mark.parametrize(("backend", "pattern"), [("mpi", "sendrecv"), ("gloo", "alltoall")])
def test_an_unknown_backend_or_pattern_is_refused_before_anything_starts(worker, backend, pattern):
    _, seen = worker
    with pytest.raises(ValueError, match="unknown backend or pattern"):
        side_of(backend=backend, pattern=pattern)
    assert seen == []


def test_a_worker_past_its_limit_is_killed_and_the_side_answers_hung(worker):
    script, _ = worker
    script[0] = "sleep 30 & wait"  # a child in the group, too
    result = side_of(limit_s=0.2)
    assert result.status == "hung"
    assert "did not end within its limit of 0.2 s" in result.error
    assert result.busbw_gbps is None


def test_a_failed_worker_gives_its_last_line_on_stderr(worker):
    script, _ = worker
    script[0] = "echo 'noise' >&2; echo 'link test failed: RuntimeError: Connection refused' >&2; echo >&2; exit 3"
    result = side_of()
    assert (result.status, result.error) == ("failed", "link test failed: RuntimeError: Connection refused")


def test_a_failed_worker_without_words_gives_its_exit_code(worker):
    script, _ = worker
    script[0] = "exit 9"
    assert side_of().error == "exit 9"


def test_a_failed_workers_message_is_bounded(worker):
    script, _ = worker
    script[0] = "head -c 100000 /dev/zero | tr '\\0' x >&2; exit 3"
    assert len(side_of().error) == 2000


@pytest.mark.parametrize(
    "output",
    [
        "",
        "not json",
        json.dumps([1, 2]),
        json.dumps({**GOOD, "schema": "something.else"}),
        json.dumps({**GOOD, "pad": "x" * MAX_WORKER_OUTPUT}),  # cut at the bound: no longer JSON
    ],
)
def test_an_answer_that_is_not_one_of_the_schema_is_no_answer(worker, output):
    script, _ = worker
    script[0] = f"printf '%s' {shlex.quote(output)}"
    result = side_of()
    assert (result.status, result.error) == ("failed", "the link test wrote no answer")


@pytest.mark.parametrize("busbw", [None, -1.0, "fast", True, float("nan"), float("inf")])
def test_an_answer_without_a_sane_bandwidth_fails(worker, busbw):
    script, _ = worker
    script[0] = answer({**GOOD, "busbw_gbps": busbw})
    result = side_of()
    assert (result.status, result.error) == ("failed", "the link test's answer has no bandwidth")


def test_hostile_fields_of_an_answer_are_dropped_or_cut(worker):
    script, _ = worker
    doc = {
        **GOOD,
        "algbw_gbps": -3,
        "seconds": "0.1",
        "late_s": True,
        "size_bytes": 1.5,
        "iters": True,
        "backend": "b" * 1000,
        "pattern": {"x": 1},
        "interface": "i" * 1000,
    }
    script[0] = answer(doc)
    result = side_of()
    assert result.status == "ok"
    assert (result.algbw_gbps, result.seconds, result.late_s) == (None, None, None)
    assert (result.size_bytes, result.iters) == (None, None)
    assert len(result.backend) == 20 and len(result.pattern) <= 20 and len(result.interface) == 40


# -- the request of one side ------------------------------------------------------------------------
def test_a_link_test_request_goes_through_json_and_back():
    from healthcheck.links.side import LinkTestRequest

    request = LinkTestRequest(rank=1, world=3, store_host="gpu01", store_port=29800, size=4096, bind="10.0.0.2")
    assert LinkTestRequest.from_json(request.to_json()) == request
    # the action's options are the request's fields but bind, which only the sidecar sets
    assert set(LinkTestRequest.OPTIONS) == set(request.to_json()) - {"bind"}


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"rank": 1}, "--store-host names rank 0's node"),
        ({"store_host": "a b"}, "--store-host names rank 0's node"),
        ({"store_host": "n", "world": 4}, "--world is 2 or 3"),
        ({"store_host": "n", "rank": 2}, "--world is 2 or 3 and --rank within it"),
        ({"store_host": "n", "store_port": 80}, "no privileged port"),
        ({"store_host": "n", "backend": "mpi"}, "--backend is one of auto, gloo, nccl"),
        ({"store_host": "n", "pattern": "alltoall"}, "--pattern is one of sendrecv, allreduce"),
        ({"store_host": "n", "size": 1 << 31}, "--size is 4 bytes to 1 GiB"),
        ({"store_host": "n", "iters": 0}, "--iters is 1-10000"),
        ({"store_host": "n", "limit": 0}, "--limit is over 0"),
        ({"store_host": "n", "start_at": 1e12}, "--start-at is epoch seconds"),
        ({"store_host": "n", "bind": ""}, "--bind names an address"),
        ({"store_host": "n", "rank": True}, "option 'rank' must be an integer"),
        ({"store_host": "n", "command": "sh"}, "unknown option 'command'"),
    ],
)
def test_a_bad_link_test_request_is_refused_with_what_is_wrong(doc, said):
    from dynprof import errors
    from healthcheck.links.side import LinkTestRequest

    with pytest.raises(errors.UsageError) as refused:
        LinkTestRequest.from_json(doc)
    assert said in refused.value.message
