"""The two documents of the job watch, and their only decoders.

A *progress document* (schema ``dynprof.progress``) is what a node's sidecar answers at
``GET /api/progress``: every rank of a job on that node as its agent last told the sidecar
(step count, time of the last step, mean step time, the GPU's side of the last step) and as the
sidecar sees the process (its state, its CPU time, its children's included, and, for a rank
that stopped stepping on CUDA, NVML's reading of its device). Ages are measured on the node's own clock, so a
watch on another machine never compares two clocks.

A *verdict* (schema ``dynprof.verdict``) is what the watch decided and why: the kind of finding,
one conclusion for people, the culprit ranks with where each is, every rank's last step and its
age, and the evidence behind it (merged stacks, flight recorder, healthcheck, straggler rule).
It is printed, written as a ``verdict`` artifact and shown by ``dynprof show`` and the page.

Both come over the network or from a file: :meth:`NodeProgress.from_json` and
:meth:`Verdict.from_json` keep fields of the right type only, cut strings and lists to a bound
and raise :class:`~dynprof.errors.ArtifactError` when the input is not such a document.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dynprof.errors import ArtifactError
from dynprof.watch.signals import STRAGGLER, all_signals

PROGRESS_SCHEMA = "dynprof.progress"
PROGRESS_VERSION = 1
VERDICT_SCHEMA = "dynprof.verdict"
VERDICT_VERSION = 1
VERDICT_KIND = "verdict"  # the artifact kind

MAX_RANKS_PER_NODE = 4096
MAX_CULPRITS = 64
MAX_RANKS_IN_VERDICT = 100_000
MAX_TEXT = 2000
MAX_EVIDENCE_KEYS = 64

AGENT_STATES = ("up", "unresponsive", "error", "gone")
# What a verdict says. "hang": ranks wait for others that do not come; "busy": no rank stepped
# for the stall time but they are doing something that is not a step (checkpoint, evaluation,
# compilation, data loading), so no hang; then each sampled signal's own kind (its row of
# dynprof.watch.signals.SIGNALS: "straggler", one rank holds the others back); "agent-down":
# ranks the watch cannot read; "ok": nothing to say.
_LOOK_KINDS = ("hang", "busy")
_OTHER_KINDS = ("agent-down", "ok")


def verdict_kinds() -> tuple[str, ...]:
    """Every kind a verdict may be: the watch's own and its signals' (read when asked)."""
    kinds = [s.verdict_kind for s in all_signals() if s.verdict_kind]
    return (*_LOOK_KINDS, *dict.fromkeys(kinds), *_OTHER_KINDS)


VERDICT_KINDS = verdict_kinds()
"""The kinds a verdict may be, with the signals of :data:`~dynprof.watch.signals.SIGNALS`."""


def _text(value: Any, limit: int = MAX_TEXT) -> str | None:
    if not isinstance(value, str):
        return None
    return value[:limit]


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if -(1 << 62) < value < (1 << 62) else None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _nonneg(value: int | None) -> int | None:
    return value if value is None or value >= 0 else None


def _check_schema(doc: Any, schema: str, version: int, what: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise ArtifactError(f"not a {what} (not a JSON object)")
    if doc.get("schema") != schema:
        raise ArtifactError(f"not a {what} (schema {str(doc.get('schema'))[:80]!r}, expected {schema!r})")
    if doc.get("schema_version") != version:
        raise ArtifactError(
            f"{what} version {str(doc.get('schema_version'))[:20]} is not read by this dynprof (reads {version})"
        )
    return doc


MAX_GPU_BYTES = 1 << 50  # 1 PiB: more than any device holds
MAX_GPU_DEVICE = 1 << 16


def _bounded_int(value: Any, low: int, high: int) -> int | None:
    v = _int(value)
    return v if v is not None and low <= v <= high else None


@dataclass(slots=True)
class GpuStep:
    """The GPU's side of a rank's latest step: the CUDA event its agent recorded at that step's
    end, queried when the agent was asked (``done``: the GPU finished what was queued by then)."""

    step: int
    done: bool
    age_s: float  # seconds since the event was recorded, at the agent's answer
    device: int | None = None  # the CUDA device index in the process
    device_uuid: str = ""  # "GPU-...", "" if unknown
    coredump_armed: bool = False  # the driver's user-triggered GPU core dump is armed in it
    # The agent's progress probe (dynprof/agent/_gpu_step.py), once the rank has not stepped for a
    # while: whether the GPU finished what was queued on its default stream ``probe_age_s`` ago.
    probe_done: bool | None = None  # None: no probe reported
    probe_age_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "done": self.done,
            "age_s": self.age_s,
            "device": self.device,
            "device_uuid": self.device_uuid,
            "coredump_armed": self.coredump_armed,
            "probe": None if self.probe_done is None else {"done": self.probe_done, "age_s": self.probe_age_s},
        }

    def gpu_behind(self, at_least_s: float) -> bool:
        """The GPU has not finished work queued at least ``at_least_s`` ago (the probe says so)."""
        return self.probe_done is False and self.probe_age_s >= at_least_s

    @classmethod
    def from_json(cls, d: Any) -> GpuStep | None:
        """None unless it is one (a step count, a boolean ``done`` and an age)."""
        if not isinstance(d, dict):
            return None
        step = _bounded_int(d.get("step"), 0, 1 << 62)
        done = d.get("done")
        age = _float(d.get("age_s"))
        if step is None or not isinstance(done, bool) or age is None or not 0.0 <= age <= 1e9:
            return None
        probe = d.get("probe")
        probe_done, probe_age = None, 0.0
        if isinstance(probe, dict) and isinstance(probe.get("done"), bool):
            p_age = _float(probe.get("age_s"))
            if p_age is not None and 0.0 <= p_age <= 1e9:
                probe_done, probe_age = probe["done"], p_age
        return cls(
            step=step,
            done=done,
            age_s=age,
            device=_bounded_int(d.get("device"), 0, MAX_GPU_DEVICE),
            device_uuid=_text(d.get("device_uuid"), 100) or "",
            coredump_armed=d.get("coredump_armed") is True,
            probe_done=probe_done,
            probe_age_s=probe_age,
        )


@dataclass(slots=True)
class GpuReading:
    """What the node's NVML said of a rank's device when the rank had not stepped for a while
    (:func:`dynprof.watch.gpu_side.read_gpus`), or why it says nothing (``note``)."""

    index: int | None = None  # NVML's index of the device on the node (nvidia-smi's)
    utilization_pct: int | None = None  # percent of the last sample period a kernel ran
    used_bytes: int | None = None
    total_bytes: int | None = None
    process_bytes: int | None = None  # what the rank's process holds there; None: not listed
    note: str = ""  # why there is no reading ("no NVML here", "device not found", ...)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "utilization_pct": self.utilization_pct,
            "used_bytes": self.used_bytes,
            "total_bytes": self.total_bytes,
            "process_bytes": self.process_bytes,
            "note": self.note,
        }

    @classmethod
    def from_json(cls, d: Any) -> GpuReading | None:
        if not isinstance(d, dict):
            return None
        return cls(
            index=_bounded_int(d.get("index"), 0, MAX_GPU_DEVICE),
            utilization_pct=_bounded_int(d.get("utilization_pct"), 0, 100),
            used_bytes=_bounded_int(d.get("used_bytes"), 0, MAX_GPU_BYTES),
            total_bytes=_bounded_int(d.get("total_bytes"), 0, MAX_GPU_BYTES),
            process_bytes=_bounded_int(d.get("process_bytes"), 0, MAX_GPU_BYTES),
            note=_text(d.get("note"), 300) or "",
        )


@dataclass(slots=True)
class RankProgress:
    """One rank (one process with an agent) of a job on one node, at the sidecar's last poll."""

    job: str
    rank: int | None  # None: the agent did not say (not a distributed process yet)
    world_size: int | None
    pid: int
    host: str  # the node's name for itself
    step: int = 0  # completed optimizer steps
    last_step_at: float = 0.0  # unix time of the last step boundary, on the node's clock; 0: none yet
    last_step_age_s: float | None = None  # seconds since then at polled_at; None: no step yet
    step_time_s: float = 0.0  # the agent's recent mean step duration; 0: unknown
    agent: str = "up"  # one of AGENT_STATES
    process_state: str = "?"  # psutil's status: running, sleeping, disk-sleep, stopped, zombie, ...
    cpu_s: float | None = None  # CPU seconds of the process and its children; None: unreadable
    io_bytes: int | None = None  # bytes read and written (any file or socket), with its children; None: unreadable
    started_at: float | None = None  # process start, unix time
    polled_at: float = 0.0  # when the sidecar read this, node clock
    gpu_step: GpuStep | None = None  # None: no step on CUDA (or the agent did not say)
    gpu: GpuReading | None = None  # the node's NVML reading of its device; None: not read
    # The watch's own, never on the wire: its agent does not answer and neither its node nor this
    # watch ever heard its step count (``step`` 0 is then no count).
    step_unknown: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "host": self.host,
            "step": self.step,
            "last_step_at": self.last_step_at,
            "last_step_age_s": self.last_step_age_s,
            "step_time_s": self.step_time_s,
            "agent": self.agent,
            "process_state": self.process_state,
            "cpu_s": self.cpu_s,
            "io_bytes": self.io_bytes,
            "started_at": self.started_at,
            "polled_at": self.polled_at,
            "gpu_step": self.gpu_step.to_json() if self.gpu_step is not None else None,
            "gpu": self.gpu.to_json() if self.gpu is not None else None,
        }

    @classmethod
    def from_json(cls, d: Any) -> RankProgress | None:
        """One row (untrusted); None when it is not one (no pid or job)."""
        if not isinstance(d, dict):
            return None
        pid = _int(d.get("pid"))
        job = _text(d.get("job"), 200)
        if pid is None or job is None:
            return None
        agent = d.get("agent")
        age = _float(d.get("last_step_age_s"))
        return cls(
            job=job,
            rank=_int(d.get("rank")),
            world_size=_int(d.get("world_size")),
            pid=pid,
            host=_text(d.get("host"), 255) or "?",
            step=max(0, _int(d.get("step")) or 0),
            last_step_at=max(0.0, _float(d.get("last_step_at")) or 0.0),
            last_step_age_s=max(0.0, age) if age is not None else None,
            step_time_s=max(0.0, _float(d.get("step_time_s")) or 0.0),
            agent=agent if agent in AGENT_STATES else "error",
            process_state=_text(d.get("process_state"), 40) or "?",
            cpu_s=_float(d.get("cpu_s")),
            io_bytes=_nonneg(_int(d.get("io_bytes"))),
            started_at=_float(d.get("started_at")),
            polled_at=_float(d.get("polled_at")) or 0.0,
            gpu_step=GpuStep.from_json(d.get("gpu_step")),
            gpu=GpuReading.from_json(d.get("gpu")),
        )


@dataclass(slots=True)
class NodeProgress:
    """A progress document: one node's ranks of one job (or of every job when none was asked)."""

    host: str
    time: float  # the node's clock when it answered
    poll_every_s: float  # how often the sidecar reads its agents
    ranks: list[RankProgress] = field(default_factory=list)
    truncated: int = 0  # rows dropped on reading (over the bound, or not rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PROGRESS_SCHEMA,
            "schema_version": PROGRESS_VERSION,
            "host": self.host,
            "time": self.time,
            "poll_every_s": self.poll_every_s,
            "ranks": [r.to_json() for r in self.ranks],
            "truncated": self.truncated,
        }

    @classmethod
    def from_json(cls, doc: Any) -> NodeProgress:
        d = _check_schema(doc, PROGRESS_SCHEMA, PROGRESS_VERSION, "progress document")
        items = d.get("ranks")
        rows: list[RankProgress] = []
        dropped = 0
        if isinstance(items, list):
            for item in items[:MAX_RANKS_PER_NODE]:
                row = RankProgress.from_json(item)
                if row is None:
                    dropped += 1
                else:
                    rows.append(row)
            dropped += max(0, len(items) - MAX_RANKS_PER_NODE)
        return cls(
            host=_text(d.get("host"), 255) or "?",
            time=_float(d.get("time")) or 0.0,
            poll_every_s=max(0.0, _float(d.get("poll_every_s")) or 0.0),
            ranks=rows,
            truncated=dropped + max(0, _int(d.get("truncated")) or 0),
        )


@dataclass(slots=True)
class Culprit:
    """A rank the verdict names, and why."""

    rank: int | None
    host: str  # as the node list names the node
    where: str  # e.g. "load_next_batch (data.py:88)", or a native frame "cudaStreamSynchronize [libcudart.so]"
    why: str  # one line: "stopped (SIGSTOP)", "not in the collective the others wait in", ...
    pid: int | None = None
    since_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "where": self.where,
            "why": self.why,
            "since_step": self.since_step,
        }

    @classmethod
    def from_json(cls, d: Any) -> Culprit | None:
        if not isinstance(d, dict):
            return None
        return cls(
            rank=_int(d.get("rank")),
            host=_text(d.get("host"), 255) or "?",
            pid=_int(d.get("pid")),
            where=_text(d.get("where")) or "?",
            why=_text(d.get("why")) or "",
            since_step=_int(d.get("since_step")),
        )


@dataclass(slots=True)
class Verdict:
    """What the watch decided about a job, and the evidence."""

    kind: str  # one of verdict_kinds()
    job: str
    conclusion: str  # one paragraph for people, naming culprit rank(s), host(s) and the evidence
    detected_at: float  # when the watch saw the stall (watch's clock)
    decided_at: float  # when the verdict was complete
    culprits: list[Culprit] = field(default_factory=list)
    # Every rank: {"rank", "host", "step", "last_step_age_s", "state"} (state: what the watch
    # decided the rank is doing: "waiting in all_reduce", "stopped", "moving", ...).
    ranks: list[dict[str, Any]] = field(default_factory=list)
    # Named pieces of evidence, each a JSON object: "stacks" (a stacks document or its summary),
    # "flight_recorder", "healthcheck" (per host), a signal's own ("straggler"), "samples". Free-form
    # but bounded.
    evidence: dict[str, Any] = field(default_factory=dict)
    nodes_unanswered: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": VERDICT_SCHEMA,
            "schema_version": VERDICT_VERSION,
            "kind": self.kind,
            "job": self.job,
            "conclusion": self.conclusion,
            "detected_at": self.detected_at,
            "decided_at": self.decided_at,
            "culprits": [c.to_json() for c in self.culprits],
            "ranks": self.ranks,
            "evidence": self.evidence,
            "nodes_unanswered": self.nodes_unanswered,
        }

    @classmethod
    def from_json(cls, doc: Any) -> Verdict:
        d = _check_schema(doc, VERDICT_SCHEMA, VERDICT_VERSION, "verdict")
        kind = d.get("kind")
        if kind not in verdict_kinds():
            raise ArtifactError(f"verdict of unknown kind {str(kind)[:40]!r}")
        culprits_in = d.get("culprits")
        culprits = (
            [c for c in (Culprit.from_json(x) for x in culprits_in[:MAX_CULPRITS]) if c]
            if isinstance(culprits_in, list)
            else []
        )
        ranks_in = d.get("ranks")
        ranks = (
            [r for r in ranks_in[:MAX_RANKS_IN_VERDICT] if isinstance(r, dict)] if isinstance(ranks_in, list) else []
        )
        evidence_in = d.get("evidence")
        evidence = (
            {str(k)[:100]: v for k, v in list(evidence_in.items())[:MAX_EVIDENCE_KEYS] if isinstance(v, (dict, list))}
            if isinstance(evidence_in, dict)
            else {}
        )
        unanswered = d.get("nodes_unanswered")
        return cls(
            kind=kind,
            job=_text(d.get("job"), 200) or "?",
            conclusion=_text(d.get("conclusion"), 20_000) or "",
            detected_at=_float(d.get("detected_at")) or 0.0,
            decided_at=_float(d.get("decided_at")) or 0.0,
            culprits=culprits,
            ranks=ranks,
            evidence=evidence,
            nodes_unanswered=[h for h in (_text(x, 255) for x in unanswered[:100_000]) if h]
            if isinstance(unanswered, list)
            else [],
        )


RankValues = dict[tuple[str, int], float]
"""A gauge's value per (host, rank)."""


@dataclass(slots=True, init=False)
class WatchGauges:
    """What a watch hosted by a sidecar (``serve --watch``) exports on its ``/metrics``, per job."""

    job: str
    stalled: bool  # no rank advanced for the stall time (whatever the verdict said of it)
    verdicts: dict[str, int]  # verdict kind -> verdicts written so far
    # Each signal's gauges from its last sample, by name: signal -> gauge -> (host, rank) -> value
    # (the names of dynprof.watch.signals.SIGNALS).
    signals: dict[str, dict[str, RankValues]]

    def __init__(
        self,
        job: str,
        stalled: bool = False,
        straggler_scores: RankValues | None = None,
        verdicts: dict[str, int] | None = None,
        signals: dict[str, dict[str, RankValues]] | None = None,
    ) -> None:
        self.job = job
        self.stalled = stalled
        self.verdicts = dict(verdicts or {})
        self.signals = {name: {g: dict(v) for g, v in gauges.items()} for name, gauges in (signals or {}).items()}
        if straggler_scores is not None:  # the straggler's score by its name of before signals
            self.signals.setdefault(_STRAGGLER, {})[_SCORE] = dict(straggler_scores)

    def rank_values(self, signal: str, gauge: str) -> RankValues:
        """A signal's gauge, per (host, rank); empty when it has none."""
        return self.signals.get(signal, {}).get(gauge, {})

    @property
    def straggler_scores(self) -> RankValues:
        """The straggler signal's ``score`` gauge: (host, rank) -> score."""
        return self.rank_values(_STRAGGLER, _SCORE)


_STRAGGLER = STRAGGLER.name
_SCORE = STRAGGLER.gauges[0].name
