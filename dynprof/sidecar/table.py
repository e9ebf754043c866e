"""The sidecar's actions, one row each (:data:`ACTIONS`): the request the action carries (its
options are the request's ``OPTIONS``), the kind's ``collect`` that answers it on this node,
and, for a job-level action, its job-wide function (``job``: the same options sent to every
node's sidecar and their answers merged), with the action's time limits and where it runs.

The rows written here come first; then a row for each kind whose row of the kinds' table names
its action (``action="module:ATTR"``, :mod:`dynprof.kinds`): an
:class:`~dynprof.action_spec.ActionSpec` in the kind's own code, read in the table's order. A
spec that gives ``per_rank`` (the kind's decoder of a node's per-rank rows) has the job layer's
per-rank merge as its job-wide answer (:class:`~dynprof.job.merge.PerRankJob`), each node waiting
the action's ``timeout`` option, else the row's ``default_timeout_s``.

Each ``collect`` returns an answer with its own codec (``to_json()``, an exit code, stderr
lines: :class:`dynprof.sidecar.outcome.Answer`); the sidecar sends that document, and the CLI
renders the same answer. Nothing here imports the CLI.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from collectors.memory.collect import DEFAULT_TIMEOUT_S, MemoryPlanRequest, MemoryRequest
from collectors.stacks import collect as stacks
from collectors.stacks.collect import StacksRequest
from collectors.torch_trace.collect import TraceRequest
from dynprof.action_spec import ActionSpec
from dynprof.job import ls, memory, ps, start, stop
from dynprof.job import stacks as stacks_job
from dynprof.job.memory import MemoryResults
from dynprof.job.merge import PerRankJob, Reach
from dynprof.job.stop import Stopped
from dynprof.kinds import actions
from dynprof.node_requests import STOP_TIMEOUT_S, LsRequest, PsRequest, StopRequest
from dynprof.nodes import Node

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
    per_rank: Callable[[Any], Any] | None = None,
    **row: Any,
) -> Action:
    """The row of an action that carries a kind's request: its options are the request's
    ``OPTIONS`` (one table, the kind's), then ``text_options``, each a flag of its name; the
    request reads them (``decode``, by default the request's ``from_json``). ``per_rank``, the
    kind's decoder of a node's per-rank rows, makes the job-wide answer their merge: the nodes
    are asked for action ``command``, so a subcommand's action (``leading``) has none."""
    text = text_options or {}
    if per_rank is not None:
        if job is not None or row.get("leading"):
            raise ValueError(f"{command}: per_rank is the job-wide answer of a command's own action, and its only one")
        job = PerRankJob(command, row.get("default_timeout_s", Action.default_timeout_s), per_rank)
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


def _spec_action(name: str, spec: ActionSpec) -> Action:
    """The row of the action ``name`` from a kind's spec."""
    return _request_action(
        name, spec.request, spec.collect, spec.job, decode=spec.decode, per_rank=spec.per_rank, **spec.limits
    )


def _kinds_actions() -> dict[str, Action]:
    """The rows of the kinds whose row of the kinds' table names their action, in its order."""
    rows = {}
    for name, target in actions().items():
        module, _, attr = target.partition(":")
        rows[name] = _spec_action(name, getattr(importlib.import_module(module), attr))
    return rows


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
        per_rank=Stopped.from_json,
        timeout_option="timeout",
        default_timeout_s=STOP_TIMEOUT_S,
        max_timeout_s=3600.0,
        changes_jobs=True,
    ),
    "memory": _request_action(
        "memory",
        MemoryRequest,
        memory.collect,
        per_rank=MemoryResults.from_json,
        timeout_option="timeout",
        default_timeout_s=DEFAULT_TIMEOUT_S,
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
    # then the kinds' own (nccl, healthcheck, link-test): named by their rows of dynprof.kinds
    **_kinds_actions(),
}
