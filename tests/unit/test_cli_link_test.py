"""`dynprof link-test`: the bounds it checks before any worker starts, its exit codes (a hung
side is 9) and the text and JSON of one side's result."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from dynprof import errors
from dynprof.cli.link_test import LinkTestCommand
from dynprof.job import links
from dynprof.job.links import LINK_TEST_SCHEMA, LinkSide
from healthcheck.links.side import SideResult


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    LinkTestCommand().prepare_parser(parser)
    return parser.parse_args(["--store-host", "node-0", *argv])


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--store-host", ""], "--store-host names rank 0's node"),
        (["--store-host", "a b"], "--store-host names rank 0's node"),
        (["--world", "4"], "--world is 2 or 3"),
        (["--rank", "2"], "--rank within it"),
        (["--store-port", "80"], "--store-port is 1024-65535"),
        (["--bind", "a b"], "--bind names an address"),
        (["--size", "2"], "--size is 4 bytes to 1 GiB"),
        (["--size", str(2 << 30)], "--size is 4 bytes to 1 GiB"),
        (["--iters", "0"], "--iters is 1-10000"),
        (["--warmup", "1001"], "--warmup 0-1000"),
        (["--limit", "0"], "--limit is over 0"),
        (["--limit", "901"], "--limit is over 0"),
        (["--start-at", "-1"], "--start-at is epoch seconds"),
        (["--start-at", str(time.time() + 10_000)], "--start-at is epoch seconds"),
    ],
)
def test_bad_options_are_usage_errors_before_any_worker(argv, said, monkeypatch):
    monkeypatch.setattr(links, "run_side", lambda **kw: pytest.fail("a worker was started"))
    with pytest.raises(errors.UsageError, match=said):
        LinkTestCommand().collect(_parse(*argv))


def _side(status: str, **kw: object) -> SideResult:
    return SideResult(status=status, rank=1, world=2, limit_s=60.0, wall_s=1.0, **kw)  # type: ignore[arg-type]


def test_the_options_reach_the_side_and_ok_is_exit_0(monkeypatch):
    seen: dict[str, object] = {}

    def run_side(**kw: object) -> SideResult:
        seen.update(kw)
        return _side("ok", busbw_gbps=12.3456, seconds=0.5, backend="gloo", pattern="sendrecv", size_bytes=64, iters=3)

    monkeypatch.setattr(links, "run_side", run_side)
    command = LinkTestCommand()
    result = command.collect(_parse("--rank", "1", "--size", "64", "--iters", "3", "--backend", "gloo"))
    assert result.exit_code == 0
    assert (seen["rank"], seen["world"], seen["store_host"], seen["size_bytes"], seen["iters"]) == (
        1,
        2,
        "node-0",
        64,
        3,
    )
    assert command.render(result) == (
        "link sendrecv rank 1/2 over gloo: 12.346 GB/s bus bandwidth (64 bytes x 3 in 0.500 s)"
    )
    doc = result.to_json()
    assert doc["schema"] == LINK_TEST_SCHEMA and doc["schema_version"] == 1 and doc["status"] == "ok"
    json.dumps(doc)


def test_a_hung_side_is_exit_9_and_a_failed_one_exit_1(monkeypatch):
    monkeypatch.setattr(links, "run_side", lambda **kw: _side("hung", error="peer never joined"))
    result = LinkTestCommand().collect(_parse())
    assert result.exit_code == errors.Timeout.exit_code == 9
    assert LinkTestCommand().render(result) == "link test hung: peer never joined"
    assert LinkSide(_side("failed", error="x")).exit_code == 1


def test_a_worker_that_cannot_start_is_a_dynprof_error(monkeypatch):
    def run_side(**kw: object) -> SideResult:
        raise OSError("no more processes")

    monkeypatch.setattr(links, "run_side", run_side)
    with pytest.raises(errors.DynprofError, match="could not start its worker: no more processes"):
        LinkTestCommand().collect(_parse())
