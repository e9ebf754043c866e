"""The sidecar's actions, one row each (:data:`ACTIONS`): the request the action carries (its
options are the request's ``OPTIONS``), the kind's ``collect`` that answers it on this node,
and, for a job-level action, its job-wide function (``job``: the same options sent to every
node's sidecar and their answers merged), with the action's time limits and where it runs.

Each ``collect`` returns an answer with its own codec (``to_json()``, an exit code, stderr
lines: :class:`dynprof.sidecar.outcome.Answer`); the sidecar sends that document, and the CLI
renders the same answer. Nothing here imports the CLI.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from collectors.flight_recorder import collect as flight_recorder
from collectors.flight_recorder.collect import NcclRequest
from collectors.memory.collect import MemoryPlanRequest, MemoryRequest
from collectors.stacks import collect as stacks
from collectors.stacks.collect import StacksRequest
from collectors.torch_trace.collect import TraceRequest
from dynprof import errors
from dynprof.job import links, ls, memory, nccl, ps, start, stop
from dynprof.job import stacks as stacks_job
from dynprof.job.merge import Reach
from dynprof.node_requests import LsRequest, PsRequest, StopRequest
from dynprof.nodes import Node
from dynprof.result import Result
from healthcheck.collect import HealthcheckRequest, collect_here
from healthcheck.links.side import LinkTestRequest

HEALTHCHECK_COULD_NOT_RUN = 3  # the healthcheck's exit when it could not run (1 and 2 are the node's health)

JobWide = Callable[[dict[str, Any], list[Node], Reach], Any]


@dataclass(frozen=True)
class Option:
    flag: str
    kind: str  # "str", "int", "float", "bool", "ints" (list of integers), "strs"


class Request(Protocol):
    """A kind's request as an action carries it: ``OPTIONS`` (``{name: kind}``, what its
    ``from_json`` reads; :mod:`dynprof.requests`) are the action's options."""

    OPTIONS: ClassVar[dict[str, str]]


@dataclass(frozen=True)
class Action:
    """One action: the CLI ``command`` it answers as, its ``options`` (the request's), the
    kind's ``collect`` of the request on this node and, job-level, its job-wide function
    ``job`` (``job(options, nodes, reach)``); ``decode`` reads the checked options as the
    request (a refused value is a :class:`~dynprof.errors.UsageError`)."""

    command: str
    options: dict[str, Option]
    collect: Callable[[Any], Any]
    decode: Callable[[dict[str, Any]], Any]
    job: JobWide | None = None
    timeout_option: str | None = None  # the option that bounds the command's own waiting
    default_timeout_s: float = 60.0
    max_timeout_s: float = 3600.0
    in_subprocess: bool = False
    changes_jobs: bool = False  # acts on a job (a trace, a snapshot): refused by a read-only sidecar
    own_default_timeout: bool = True  # the command's --timeout has a default of its own
    failed_exit: int = 1  # the exit code of "could not run" (healthcheck: 3; 1 and 2 are verdicts there)
    leading: tuple[str, ...] = ()  # the command's own positional words first (memory-plan: ``memory plan``)
    # The kind's request the action carries (its options are the request's OPTIONS, plus
    # ``text_options``: how the command prints, no part of the request); None: no request.
    request: type[Request] | None = None
    text_options: tuple[str, ...] = ()

    @property
    def fans_out(self) -> bool:
        """It takes ``hosts`` (the command's --hosts): a job-wide view through the sidecars."""
        return self.job is not None


def _opts(**kinds: str) -> dict[str, Option]:
    return {name: Option("--" + name.replace("_", "-"), kind) for name, kind in kinds.items()}


def _request_action(
    command: str,
    request: type[Request],
    collect: Callable[[Any], Any],
    job: JobWide | None = None,
    *,
    decode: Callable[[dict[str, Any]], Any] | None = None,
    text_options: dict[str, str] | None = None,
    **row: Any,
) -> Action:
    """The row of an action that carries a kind's request: its options are the request's
    ``OPTIONS`` (one table, the kind's), then ``text_options``, each a flag of its name; the
    request reads them (``decode``, by default the request's ``from_json``)."""
    text = text_options or {}
    return Action(
        command,
        _opts(**request.OPTIONS, **text),
        collect,
        decode or request.from_json,  # type: ignore[attr-defined]
        job,
        request=request,
        text_options=tuple(text),
        **row,
    )


def _healthcheck_request(options: dict[str, Any]) -> HealthcheckRequest:
    """The ``healthcheck`` action's options as the kind's request; a value it refuses is the
    healthcheck's usage error (exit 3: 1 and 2 are the node's health)."""
    try:
        return HealthcheckRequest.from_json(options)
    except errors.DynprofError as exc:
        error = errors.UsageError(f"healthcheck: {exc.message}", help="See `dynprof healthcheck --help`.")
        error.exit_code = HEALTHCHECK_COULD_NOT_RUN
        raise error from None


def _healthcheck(request: HealthcheckRequest) -> Result:
    """This node's checks for ``request`` (the report with the artifact it was saved as); an
    error is exit 3, whatever its own code."""
    try:
        checked = collect_here(request)
    except errors.DynprofError as exc:
        exc.exit_code = HEALTHCHECK_COULD_NOT_RUN
        raise
    return Result(checked.to_json(), checked.report.exit_code, checked.messages)


ACTIONS: dict[str, Action] = {
    "ps": _request_action(
        "ps",
        PsRequest,
        ps.collect,
        ps.collect_job,
        timeout_option="timeout",
        default_timeout_s=10.0,
        max_timeout_s=60.0,
    ),
    "ls": _request_action("ls", LsRequest, ls.collect, ls.collect_job),
    # `full` is how the text is printed: the document an action answers is the same
    "stacks": _request_action(
        "stacks",
        StacksRequest,
        stacks.collect,
        stacks_job.collect_job,
        decode=stacks_job.request_of,
        text_options={"full": "bool"},
        timeout_option="timeout",
        default_timeout_s=15.0,
        max_timeout_s=300.0,
    ),
    "start": _request_action(
        "start",
        TraceRequest,
        start.collect,
        start.collect_job,
        timeout_option="timeout",
        default_timeout_s=600.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        own_default_timeout=False,
    ),
    "stop": _request_action(
        "stop",
        StopRequest,
        stop.collect,
        stop.collect_job,
        timeout_option="timeout",
        default_timeout_s=120.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
    ),
    "memory": _request_action(
        "memory",
        MemoryRequest,
        memory.collect,
        memory.collect_job,
        timeout_option="timeout",
        default_timeout_s=300.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
    ),
    # one optimizer step measured in each target (hooks for that step only), and the plan
    "memory-plan": _request_action(
        "memory",
        MemoryPlanRequest,
        memory.collect_plan,
        timeout_option="timeout",
        default_timeout_s=300.0,
        max_timeout_s=3600.0,
        changes_jobs=True,
        leading=("plan",),
    ),
    "nccl": _request_action(
        "nccl",
        NcclRequest,
        flight_recorder.collect,
        nccl.collect_job,
        timeout_option="timeout",
        default_timeout_s=15.0,
        max_timeout_s=300.0,
        changes_jobs=True,
    ),
    "healthcheck": _request_action(
        "healthcheck",
        HealthcheckRequest,
        _healthcheck,
        decode=_healthcheck_request,
        default_timeout_s=900.0,
        max_timeout_s=900.0,
        in_subprocess=True,
        changes_jobs=True,
        failed_exit=3,
    ),
    # one node's side of a link test between nodes (healthcheck.links): in a child, which runs
    # the torch.distributed worker in a process group of its own, killed past --limit
    "link-test": _request_action(
        "link-test",
        LinkTestRequest,
        links.collect,
        default_timeout_s=120.0,
        max_timeout_s=900.0,
        in_subprocess=True,
        changes_jobs=True,
    ),
}
