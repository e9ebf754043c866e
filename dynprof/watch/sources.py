"""Where the watch reads: a job's progress, its stacks, the evidence of a hang, and the traces
of a straggler sample.

A :class:`WatchSource` answers the engine (:mod:`dynprof.watch.engine`) and the samplers: every
node's progress document (a :class:`NodeRead` each, or why there is none), one sample of the
job's stacks (a :class:`StacksRead`, merged by :func:`merged_with_native`), the flight recorder,
the involved nodes' quick healthcheck, a GPU's dump, and one aligned trace of a couple of steps
(:class:`~dynprof.watch.traces.SampledTraces`, which the straggler's sampler analyses). Two
sources: :class:`SidecarSource` reads the nodes' sidecars, :class:`LocalSource` this node's
agents directly (no sidecar).
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from collectors.flight_recorder import collect as nccl
from collectors.stacks import Budget, Source, Stacks, merge
from collectors.stacks import collect as stacks_kind
from collectors.stacks.collect import StacksRequest
from collectors.torch_trace.collect import Started
from dynprof import errors
from dynprof.identity import detect
from dynprof.job.answers import node_labels, read
from dynprof.job.client import NodeFailure
from dynprof.job.fetch import fetch_by_path
from dynprof.job.stacks import read_answer
from dynprof.job.start import PS_TIMEOUT_S, START_ARM_TIMEOUT_S, arm_at_one_step, follow_traces
from dynprof.registry import list_records
from dynprof.watch.evidence import healthcheck_summary, report_summary
from dynprof.watch.model import NodeProgress
from dynprof.watch.progress import read_progress
from dynprof.watch.traces import (
    KEEP_SAMPLES,
    MAX_TRACE_DURATION_S,
    LocalTrace,
    SampledTraces,
    SampleTraces,
    failed_note,
    local_trace,
    local_traces,
)

log = logging.getLogger("dynprof.watch.straggler")

DEFAULT_STACKS_TIMEOUT_S = 10.0
# Each rank's dump: a rank whose agent does not answer (stopped, holding the GIL) is given up on
# after this, and the others' dumps say what it missed.
FLIGHT_RECORDER_TIMEOUT_S = 3.0
HEALTHCHECK_TIMEOUT_S = 120.0
GPU_COREDUMP_TIMEOUT_S = 60.0
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
    """Where a watch reads: progress, stacks, the evidence of a hang, and a sample's traces."""

    def nodes(self) -> list[str]: ...

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]: ...

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead: ...

    def flight_recorder(
        self, job: str, unanswered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The flight recorder's analysis of ``job`` (or why there is none). ``unanswered``:
        the (node, pid) of ranks whose agents did not answer the look's last poll."""
        ...

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        """Each node's quick healthcheck; the processes of ``job`` there are its own, not others
        holding its devices."""
        ...

    def gpu_coredump(self, node: str, pid: int) -> dict[str, Any]:
        """Dump process ``pid``'s GPU on ``node`` and name what it ran: its ``kernel`` line and
        ``coredump`` facts, or why it is not named (``kernel`` alone)."""
        ...

    def trace(self, job: str, steps: int, limit_s: float) -> SampledTraces:
        """One aligned trace of ``steps`` steps of every rank of ``job``, within ``limit_s``,
        its artifacts in this machine's file system (see :class:`SampledTraces`)."""
        ...


# (job, per node: the processes not to ask) -> (the analysis, or why there is none)
FlightRecorder = Callable[[str, dict[Any, tuple[int, ...]]], tuple[dict[str, Any] | None, str | None]]


class _Quiet:
    """Progress that says nothing: the watch prints its own lines."""

    def update(self, text: str) -> None:
        pass

    def done(self) -> None:
        pass


class SidecarSource:
    """The nodes' sidecars: ``GET /api/progress`` and the ``stacks``, ``healthcheck`` and trace
    (``start``, ``ps``, fetch) actions, through one client, to the very node objects the user
    named (never their display labels: ``host`` alone stands for ``host:8787``)."""

    def __init__(
        self,
        client: Any,  # a dynprof.job.client.SidecarClient
        nodes: Sequence[Any],  # dynprof.nodes.Node
        flight_recorder: FlightRecorder | None = None,
        stacks_timeout: float = DEFAULT_STACKS_TIMEOUT_S,
        keep_traces: Path | None = None,
    ) -> None:
        self.client = client
        self.node_list = list(nodes)
        self.labels = node_labels(self.node_list)
        self.by_label = {label: node for node, label in self.labels.items()}
        self._flight_recorder = flight_recorder
        self.stacks_timeout = stacks_timeout
        # where a sample's traces are copied and left (None: a temporary directory, removed)
        self.keep_traces = keep_traces
        self.named_groups: list[str] = []  # the trace groups (every node's) of samples that named a straggler

    def nodes(self) -> list[str]:
        return [self.labels[n] for n in self.node_list]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
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
            source, failure = read_answer(answer, label, budget)
            if failure is not None:
                failures[f"node {label}"] = failure
            if source is not None:
                (native_sources if options.get("native") else plain_sources).append(source)
        return StacksRead(merged_with_native(plain_sources, native_sources), failures)

    def flight_recorder(
        self, job: str, unanswered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[dict[str, Any] | None, str | None]:
        # An agent that did not answer the look's poll cannot dump its recorder either: asked,
        # it would hold the read for its timeout (FLIGHT_RECORDER_TIMEOUT_S). Each node's
        # sidecar is told which of its processes to leave out; the note says who was not asked.
        if self._flight_recorder is None:
            return None, "the flight recorder is not read by this watch"
        skip: dict[Any, list[int]] = {}
        for label, pid in unanswered:
            node = self.by_label.get(label)
            if node is not None:
                skip.setdefault(node, []).append(pid)
        analysis, note = self._flight_recorder(job, {n: tuple(sorted(p)) for n, p in skip.items()})
        if skip:
            who = "; ".join(f"{self.labels[n]}: {', '.join(map(str, sorted(p)))}" for n, p in skip.items())
            said = f"not asked: process(es) whose agent did not answer the look ({who})"
            note = f"{note}; {said}" if note else said
        return analysis, note

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        chosen = [self.by_label[n] for n in nodes if n in self.by_label]
        if not chosen:
            return {}
        options: dict[str, Any] = {"level": "quick", "no_save": True, **({"job": job} if job else {})}
        answers = self.client.action_all(chosen, "healthcheck", options, timeout=HEALTHCHECK_TIMEOUT_S)
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

    def gpu_coredump(self, node: str, pid: int) -> dict[str, Any]:
        """A GPU on another node is not dumped from here: the line says how to dump it there."""
        return {
            "kernel": "not named: this watch dumps GPUs on its own node only; on "
            f"{node}: `dynprof gpu-coredump --pid {pid} --yes` (it ends the rank's GPU work)"
        }

    def trace(self, job: str, steps: int, limit_s: float) -> SampledTraces:
        """One sampled trace of ``steps`` steps of every rank of ``job`` on the nodes, as ``dynprof
        start --job J --hosts ... --steps N --with-stack --fetch DIR`` takes it, through the same
        public functions: every node armed at one common step
        (:func:`dynprof.job.start.arm_at_one_step`), each rank's trace followed until written
        (:func:`dynprof.job.start.follow_traces`), the traces copied back and checked against
        their manifests (:func:`dynprof.job.fetch.fetch_by_path`) into :attr:`keep_traces` or a
        temporary directory (removed once the sample is judged).

        On each node the traces are a sample's (``dynprof start --sample-keep``): the node
        deletes its older samples' traces but the latest :data:`KEEP_SAMPLES` and those of
        samples that named a straggler (:attr:`named_groups`). Ranks and culprits are named by
        :func:`~dynprof.job.answers.node_labels` of the nodes (the names the watch prints)."""
        started = time.monotonic()
        parsed = list(dict.fromkeys(self.node_list))
        got = SampledTraces()
        if not parsed:
            got.note = "no node to sample"
            return got
        labels = node_labels(parsed)
        given = {n.address: labels[n] for n in parsed}
        ps_options = {"job": job, "timeout": PS_TIMEOUT_S}
        start_options: dict[str, Any] = {
            "job": job,
            "steps": steps,
            "no_wait": True,
            "timeout": START_ARM_TIMEOUT_S,
            "max_duration": min(MAX_TRACE_DURATION_S, max(10.0, limit_s)),
            "sample_keep": KEEP_SAMPLES,
        }
        if self.named_groups:
            start_options["keep_groups"] = list(self.named_groups)[-64:]
        start_options["with_stack"] = True
        armed = arm_at_one_step(
            self.client,
            parsed,
            labels,
            at_step=None,
            job=job,
            select_all=False,
            start_options=start_options,
            ps_options=ps_options,
            progress=_Quiet(),
        )
        got.at_step = armed.at_step
        armed_answers = [read(a, Started.from_json) for a in armed.answers if a.ok]
        got.groups = sorted({s.group_id for s in armed_answers if s is not None and s.group_id is not None})[:256]
        if armed.at_step is None:
            got.note = "; ".join(armed.messages) or "no rank of the job has stepped"
            return got
        tmp: str | None = None
        try:
            left = max(5.0, limit_s - (time.monotonic() - started))
            results, missed = follow_traces(
                self.client,
                parsed,
                labels,
                armed,
                ps_options=ps_options,
                no_wait=False,
                timeout=left,
                node_timeout=self.client.timeout,
                progress=_Quiet(),
            )
            address = {labels[n]: n.address for n in parsed}
            by_node: dict[str, list[str]] = {}
            for r in results:
                if r.get("status") in ("complete", "partial") and isinstance(r.get("artifact"), str) and r["artifact"]:
                    by_node.setdefault(address[r["node"]], []).append(r["artifact"])
            if not by_node:
                why = "; ".join(f"rank {m['rank']} on {m['node']}: {m['reason']}" for m in missed[:5])
                got.note = f"no trace was written{': ' + why if why else ''}"
                return got
            dest = self.keep_traces or Path(tmp := tempfile.mkdtemp(prefix="dynprof-straggler-"))
            got.fetched = fetch_by_path(self.client, dest, armed.answers, by_node, job)
        except Exception as exc:  # a sample that fails is a note, never the watch's end
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            log.debug("straggler sample of %s failed", job, exc_info=exc)
            got.note = failed_note(exc)
            return got
        got.label_of = {n.address: given[n.address] for n in parsed}
        got.notes = [
            f"rank {m['rank']} on {given.get(address.get(m['node'], ''), m['node'])}: {m['reason']}" for m in missed
        ]
        got.notes += [f"not fetched from {f['node']}: {f['error']}" for f in got.fetched if f.get("error")]
        got.evidence = {"missed": missed[:64]}

        def done(named: bool) -> None:
            if named:
                self.named_groups.extend(g for g in got.groups if g not in self.named_groups)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

        got.done = done
        return got


class LocalSource:
    """This node's agents, read directly (no sidecar): stacks, the flight recorder, the
    healthcheck, a GPU's dump and traces by the kinds' own local paths. ``run_trace`` takes a
    sample's trace (:func:`~dynprof.watch.traces.local_trace`); its artifacts are kept and
    pruned in this machine's store by :attr:`sample_traces`."""

    def __init__(
        self,
        host: str | None = None,
        stacks_timeout: float = DEFAULT_STACKS_TIMEOUT_S,
        run_trace: LocalTrace = local_trace,
    ) -> None:
        self.host = host or detect().host or socket.gethostname()
        self.stacks_timeout = stacks_timeout
        self.run_trace = run_trace
        self.sample_traces = SampleTraces()

    def nodes(self) -> list[str]:
        return [self.host]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:  # always read now
        return [NodeRead(self.host, read_progress(list_records(), self.host, job, timeout=1.0))]

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        failures: dict[str, str] = {}

        def read(request: StacksRequest) -> Stacks:
            try:
                return stacks_kind.collect(request).stacks
            except errors.DynprofError as exc:
                failures[f"node {self.host}"] = exc.message
                return Stacks([])

        plain = read(StacksRequest(job=job, save=False, timeout=self.stacks_timeout))
        pids = native.get(self.host) or []
        natives = (
            read(StacksRequest(pids=tuple(pids), native=True, save=False, timeout=self.stacks_timeout))
            if pids
            else Stacks([])
        )
        merged = merged_with_native([Source(plain, node=self.host)], [Source(natives, node=self.host)] if pids else [])
        return StacksRead(merged, failures)

    def flight_recorder(
        self, job: str, unanswered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[dict[str, Any] | None, str | None]:
        # An agent that did not answer the look's poll (its process holds the GIL in a C call,
        # or is stopped) cannot dump its recorder either: asked, it would only hold the read for
        # its timeout. The others are asked (the request's ``skip``, as each node's sidecar is
        # told); the note says who was not.
        skipped = sorted(pid for node, pid in unanswered if node == self.host)
        if skipped and not any(r.job_id == job and r.pid not in skipped for r in list_records()):
            return None, "not read: no rank's agent answered the look"
        request = nccl.NcclRequest(job=job, timeout=FLIGHT_RECORDER_TIMEOUT_S, skip=tuple(skipped))
        try:
            got = nccl.collect(request)
        except errors.Unsupported:
            return None, FLIGHT_RECORDER_OFF  # every rank said so (and no artifact was written)
        except errors.DynprofError as exc:
            return None, exc.message[:1000]
        if skipped:
            return (
                got.analysis,
                f"not asked: process(es) {', '.join(map(str, skipped))}, whose agent did not answer the look",
            )
        return got.analysis, None

    def gpu_coredump(self, node: str, pid: int) -> dict[str, Any]:
        """Dump process ``pid``'s GPU and name what it ran (``dynprof gpu-coredump``): its
        ``kernel`` line and ``coredump`` facts, or why it is not named."""
        from collectors import gpu_coredump as gc

        try:
            got = gc.take(pid, timeout=GPU_COREDUMP_TIMEOUT_S)
        except gc.TriggerError as exc:
            return {"kernel": f"not named: {exc.message}"[:1000]}
        dump = got.get("dump")
        if not dump:
            return {"kernel": f"not named: the dump ({got['artifact']}) cannot be read: {got.get('error')}"[:1000]}
        running = dump["running"]
        facts = {"artifact": got["artifact"], "dump_s": got["dump_s"], "running": running[:16]}
        if not running:
            return {"kernel": "no kernel was running on its GPU when it was dumped", "coredump": facts}
        more = f" and {len(running) - 3} more" if len(running) > 3 else ""
        return {"kernel": "running " + "; ".join(running[:3]) + more, "coredump": facts}

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        """This node's quick healthcheck, through the kind's own entry point
        (:func:`healthcheck.collect.collect`): it runs in a child process, killed past its time,
        since it may touch the GPUs, which must leave no CUDA state in the watch (nor in the
        sidecar that hosts it)."""
        from healthcheck.collect import HealthcheckRequest, collect

        try:
            # the job's own ranks hold the devices: not "other processes"
            report = collect(HealthcheckRequest(level="quick", job=job or None, timeout=HEALTHCHECK_TIMEOUT_S))
        except errors.DynprofError as exc:
            return {self.host: {"verdict": "could not run", "error": exc.message[:1000], "problems": []}}
        return {self.host: report_summary(report)}

    def trace(self, job: str, steps: int, limit_s: float) -> SampledTraces:
        """One trace of ``steps`` steps of this node's ranks of ``job`` (``run_trace``), its
        ranks named on this node; the traces are kept or pruned once the sample is judged."""
        got = local_traces(self.run_trace(job, steps, limit_s), self.host)
        written = [str(row["path"]) for row in got.fetched]
        if written:

            def done(named: bool) -> None:
                self.sample_traces.add(written, named)

            got.done = done
        return got


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
