"""Where the watch reads: a job's progress, its stacks, and the evidence of a hang.

A :class:`WatchSource` answers the engine (:mod:`dynprof.watch.engine`): every node's progress
document (a :class:`NodeRead` each, or why there is none), one sample of the job's stacks (a
:class:`StacksRead`, merged by :func:`merged_with_native`), the flight recorder and the involved
nodes' quick healthcheck. :class:`SidecarSource` reads the nodes' sidecars; the faces build the
one that reads this node's agents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from collectors.stacks import Budget, Source, Stacks, from_json, merge
from dynprof import errors
from dynprof.watch.evidence import healthcheck_summary
from dynprof.watch.model import NodeProgress

DEFAULT_STACKS_TIMEOUT_S = 10.0
FLIGHT_RECORDER_OFF = "not on for this job (`dynprof run --flight-recorder`)"
"""The flight-recorder note of a verdict on a job whose ranks record nothing (a source's answer
when every rank said the recorder is off; no artifact is written then)."""


@dataclass
class NodeRead:
    """One node's progress document, or why there is none."""

    node: str  # the node's label (as output names it)
    progress: NodeProgress | None
    error: str | None = None


@dataclass
class StacksRead:
    """One sample of the job's stacks: merged, each process's ``host`` its node's label."""

    stacks: Stacks
    failures: dict[str, str] = field(default_factory=dict)


class WatchSource(Protocol):
    """Where a watch reads: progress, stacks, and the evidence of a hang."""

    def nodes(self) -> list[str]: ...

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]: ...

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead: ...

    def flight_recorder(self, job: str) -> tuple[dict[str, Any] | None, str | None]: ...

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        """Each node's quick healthcheck; the processes of ``job`` there are its own, not others
        holding its devices."""
        ...


FlightRecorder = Callable[[str], tuple[dict[str, Any] | None, str | None]]


class SidecarSource:
    """The nodes' sidecars: ``GET /api/progress`` and the ``stacks`` and ``healthcheck`` actions."""

    def __init__(
        self,
        client: Any,  # a dynprof.job.client.SidecarClient
        nodes: Sequence[Any],  # dynprof.nodes.Node
        flight_recorder: FlightRecorder | None = None,
        stacks_timeout: float = DEFAULT_STACKS_TIMEOUT_S,
    ) -> None:
        from dynprof.job.answers import node_labels

        self.client = client
        self.node_list = list(nodes)
        self.labels = node_labels(self.node_list)
        self.by_label = {label: node for node, label in self.labels.items()}
        self._flight_recorder = flight_recorder
        self.stacks_timeout = stacks_timeout

    def nodes(self) -> list[str]:
        return [self.labels[n] for n in self.node_list]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
        from dynprof.job.client import NodeFailure

        def one(node: Any) -> NodeRead:
            label = self.labels[node]
            try:
                return NodeRead(label, NodeProgress.from_json(self.client.progress(node, job, fresh=fresh)))
            except NodeFailure as exc:
                return NodeRead(label, None, exc.reason)
            except errors.ArtifactError as exc:
                return NodeRead(label, None, f"not a progress document: {exc.message}")

        workers = max(1, min(self.client.max_in_flight, len(self.node_list)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(one, self.node_list))

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        plain = {"job": job, "no_save": True, "timeout": self.stacks_timeout}
        calls: list[tuple[Any, dict[str, Any]]] = [(n, plain) for n in self.node_list]
        for label, pids in native.items():
            node = self.by_label.get(label)
            if node is not None and pids:
                calls.append(
                    (node, {"pid": sorted(set(pids)), "native": True, "no_save": True, "timeout": self.stacks_timeout})
                )
        workers = max(1, min(self.client.max_in_flight, len(calls)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            answers = list(
                pool.map(lambda c: self.client.action(c[0], "stacks", c[1], timeout=self.stacks_timeout + 5.0), calls)
            )
        plain_sources: list[Source] = []
        native_sources: list[Source] = []
        failures: dict[str, str] = {}
        budget = Budget()
        for (node, options), answer in zip(calls, answers):
            label = self.labels[node]
            if not answer.answered:
                failures[f"node {label}"] = answer.error or "no answer"
                continue
            try:
                found = from_json(answer.result, budget)
            except errors.ArtifactError as exc:
                failures[f"node {label}"] = answer.command_error() or exc.message
                continue
            (native_sources if options.get("native") else plain_sources).append(Source(found, node=label))
        return StacksRead(merged_with_native(plain_sources, native_sources), failures)

    def flight_recorder(self, job: str) -> tuple[dict[str, Any] | None, str | None]:
        if self._flight_recorder is None:
            return None, "the flight recorder is not read by this watch"
        return self._flight_recorder(job)

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        chosen = [self.by_label[n] for n in nodes if n in self.by_label]
        if not chosen:
            return {}
        options: dict[str, Any] = {"level": "quick", "no_save": True, **({"job": job} if job else {})}
        answers = self.client.action_all(chosen, "healthcheck", options, timeout=120.0)
        out: dict[str, dict[str, Any]] = {}
        for node, answer in zip(chosen, answers):
            label = self.labels[node]
            if not answer.answered:
                out[label] = {"verdict": "no answer", "error": answer.error, "problems": []}
            elif answer.failure is not None and not isinstance(answer.result, dict):
                out[label] = {"verdict": "could not run", "error": answer.failure.message, "problems": []}
            else:
                out[label] = healthcheck_summary(answer.result)
        return out


def merged_with_native(plain: Sequence[Source], native: Sequence[Source]) -> Stacks:
    """THE merge of one sample: the native reads replace the plain reads of the same processes."""
    replaced = {(s.node, p.pid) for s in native for p in s.stacks.processes}
    sources = [
        Source(
            Stacks([p for p in s.stacks.processes if (s.node, p.pid) not in replaced], failures=s.stacks.failures),
            node=s.node,
            host=s.host,
        )
        for s in plain
    ]
    return merge([*sources, *native], by_host=True)
