"""dynprof/job/links.py: one node's side of a link test (its answer's document and exit code),
and the sidecar's ``link-test`` action that the kinds' table names."""

from __future__ import annotations

import json

import pytest

from dynprof import errors
from dynprof.job import links
from healthcheck.links.side import LinkTestRequest, SideResult


def _side(status: str, **kw: object) -> SideResult:
    return SideResult(status=status, rank=0, world=2, limit_s=30.0, wall_s=1.0, **kw)  # type: ignore[arg-type]


def test_a_side_answers_its_figures_under_the_schema_and_hung_is_exit_9(monkeypatch):
    # GIVEN a worker that hangs
    monkeypatch.setattr(links, "run_side", lambda **kw: _side("hung", error="peer never joined"))
    # WHEN this node's side runs
    got = links.collect(LinkTestRequest(store_host="node-0", limit=30.0))
    # THEN it is the timeout's exit, and its document is the side's figures under the schema
    assert got.exit_code == errors.Timeout.exit_code
    doc = json.loads(json.dumps(got.to_json()))
    assert doc["schema"] == links.LINK_TEST_SCHEMA and doc["schema_version"] == 1
    assert (doc["status"], doc["error"], doc["limit_s"]) == ("hung", "peer never joined", 30.0)
    assert links.collect.__module__ == "dynprof.job.links"


def test_the_request_reaches_the_worker_as_its_arguments(monkeypatch):
    seen: dict[str, object] = {}

    def run_side(**kw: object) -> SideResult:
        seen.update(kw)
        return _side("ok")

    monkeypatch.setattr(links, "run_side", run_side)
    got = links.collect(LinkTestRequest(rank=1, store_host="node-0", size=64, iters=3, bind="10.0.0.1"))
    assert got.exit_code == 0
    assert (seen["rank"], seen["store_host"], seen["size_bytes"], seen["iters"], seen["bind"]) == (
        1,
        "node-0",
        64,
        3,
        "10.0.0.1",
    )


def test_a_worker_that_cannot_start_is_a_dynprof_error(monkeypatch):
    def run_side(**kw: object) -> SideResult:
        raise OSError("no more processes")

    monkeypatch.setattr(links, "run_side", run_side)
    with pytest.raises(errors.DynprofError, match="could not start its worker: no more processes"):
        links.collect(LinkTestRequest(store_host="node-0"))


def test_the_action_runs_this_sides_collect_in_a_child_and_acts_on_the_node():
    spec = links.ACTION
    assert spec.request is LinkTestRequest and spec.collect is links.collect and spec.job is None
    assert spec.limits == {
        "default_timeout_s": 120.0,
        "max_timeout_s": 900.0,
        "in_subprocess": True,
        "changes_jobs": True,
    }
