"""``link-test``: this node's side of a link test between a job's nodes (:func:`collect`),
run by the job-wide healthcheck through the sidecars' ``link-test`` action and by
``dynprof link-test`` (docs/links.md)."""

from __future__ import annotations

from typing import Any

from dynprof.action_spec import ActionSpec
from dynprof.errors import DynprofError, Timeout
from dynprof.result import Result
from healthcheck.links.side import LinkTestRequest, SideResult, run_side

LINK_TEST_SCHEMA = "dynprof.link_test"


class LinkSide(Result):
    """One side's answer: ``{"schema", "schema_version", <the side's figures>}``."""

    def __init__(self, side: SideResult) -> None:
        super().__init__({}, 0 if side.status == "ok" else 1, [])
        self.side = side

    def to_json(self) -> dict[str, Any]:
        return {"schema": LINK_TEST_SCHEMA, "schema_version": 1, **self.side.to_json()}


def collect(request: LinkTestRequest) -> LinkSide:
    """This node's side of the link test ``request``."""
    try:
        assert request.store_host is not None  # checked when the request was made
        side = run_side(
            rank=request.rank,
            world=request.world,
            store_host=request.store_host,
            store_port=request.store_port,
            backend=request.backend,
            pattern=request.pattern,
            size_bytes=request.size,
            iters=request.iters,
            warmup=request.warmup,
            limit_s=request.limit,
            start_at=request.start_at,
            bind=request.bind,
        )
    except OSError as exc:
        raise DynprofError(f"link-test could not start its worker: {exc}") from None
    result = LinkSide(side)
    if side.status == "hung":
        result.exit_code = Timeout.exit_code
    return result


# The sidecar's ``link-test`` action (the kinds' table names it): one node's side of a link test
# between nodes, in a child, which runs the torch.distributed worker in a process group of its
# own, killed past --limit.
ACTION = ActionSpec(
    LinkTestRequest,
    collect,
    limits={"default_timeout_s": 120.0, "max_timeout_s": 900.0, "in_subprocess": True, "changes_jobs": True},
)
