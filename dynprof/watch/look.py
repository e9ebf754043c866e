"""The watch's look at a stalled job: read every rank's stacks twice, decide, gather the evidence
of a hang, and build the verdict.

The engine (:mod:`dynprof.watch.engine`) looks when no rank advanced for the stall time; a look
goes in named parts:

- :func:`take`: the first stacks sample, the look interval, every node's progress read again
  (the CPU a rank spent across the look; whether its GPU finished what was queued before it),
  the second sample with native frames for the ranks that may be the culprits
  (:func:`native_reads`), each rank's :class:`~dynprof.watch.RankLook`;
- :func:`decide`: the decision (:func:`dynprof.watch.detect.decide`), the waiting ranks' wait
  timed across looks;
- :func:`hang_evidence`: on a hang, the flight recorder and the involved nodes' quick
  healthcheck at once, and the decision again with the flight recorder;
- :func:`verdict_of`: the verdict's evidence, conclusion and rows.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from collectors.stacks import ProcessStacks, Stacks
from dynprof.watch import detect, gpu_side
from dynprof.watch.classify import RankLook
from dynprof.watch.conclusion import health_clause
from dynprof.watch.evidence import by_process, failure_of, fr_summary, name_kernels_of, stacks_evidence
from dynprof.watch.frames import collective_of, python_frames
from dynprof.watch.model import RankProgress, Verdict
from dynprof.watch.sources import StacksRead, WatchSource
from dynprof.watch.stall import EXITED_STATES, Stall, median_step_time

MAX_NATIVE_CANDIDATES = 64  # ranks read natively in one look for not waiting with the others
GPU_BEHIND_S = 1.0  # a rank's GPU is behind when work queued this long ago has not finished

Rows = list[tuple[str, RankProgress]]
Poll = Callable[[bool], tuple[Rows, dict[str, str]]]


@dataclass
class Sample:
    """What one look read: two stacks samples, every rank's progress again, each rank's look."""

    first: StacksRead
    second: StacksRead
    after_rows: Rows
    native: dict[str, list[int]]  # node -> pids read natively in the second sample
    unread: dict[str, str]  # who -> why their stacks were not read
    looks: list[RankLook]
    started_at: float
    looked_at: float


@dataclass
class HangEvidence:
    """What a hang's verdict keeps beside the stacks: the flight recorder and the healthcheck."""

    fr_analysis: dict[str, Any] | None = None
    fr_note: str | None = None
    health: dict[str, Any] | None = None


def take(
    source: WatchSource,
    job: str,
    rows: Rows,
    gone: Rows,
    look_interval_s: float,
    clock: Callable[[], float],
    sleep: Callable[[float], object],
    poll: Poll,
) -> Sample | None:
    """Every rank's stacks twice, ``look_interval_s`` apart, with every node's progress read
    again between them (``poll(fresh)``); None when every rank exited during the look (a job
    ends some seconds after its last step: no verdict on a job that is no more)."""
    started = clock()
    first = source.stacks(job, {})
    wait = look_interval_s - (clock() - started)
    if wait > 0:
        sleep(wait)
    # read now: the CPU a rank spent is measured across the look, which the nodes' last polls
    # (every few seconds) may not span; and each CUDA rank's progress probe says whether its
    # GPU finished what was queued before the look (dynprof/agent/_gpu_step.py)
    after_rows, after_failed = poll(True)
    after = {(node, r.pid): r for node, r in after_rows}
    if not after_failed and all(exited(after.get((node, r.pid))) for node, r in rows):
        return None
    native = native_reads(rows, first.stacks, after, look_interval_s)
    second = source.stacks(job, native)
    first_by = by_process(first.stacks)
    second_by = by_process(second.stacks)
    unread = {**first.failures, **second.failures, **second.stacks.failures}
    looks = []
    for node, r in rows:
        where = (node, r.pid)
        looks.append(
            RankLook(
                node=node,
                before=r,
                after=after.get(where),
                first=first_by.get(where),
                second=second_by.get(where),
                unread=failure_of(unread, node, r),
            )
        )
    for node, r in gone:
        looks.append(RankLook(node=node, before=r, after=None))
    return Sample(first, second, after_rows, native, unread, looks, started, clock())


def native_reads(
    rows: Rows, first: Stacks, after: dict[tuple[str, int], RankProgress], look_interval_s: float
) -> dict[str, list[int]]:
    """The ranks the second sample reads natively, by node: those whose agent does not answer,
    and those that do not wait with the others (the culprits to be)."""
    native: dict[str, list[int]] = {}
    in_collective = {key: in_python_collective(p) for key, p in by_process(first).items()}
    others_wait = any(in_collective.values())
    candidates = 0
    for node, r in rows:
        if r.process_state == "stopped":
            continue
        if r.agent == "unresponsive":
            native.setdefault(node, []).append(r.pid)
        elif (
            not in_collective.get((node, r.pid), False)
            and candidates < MAX_NATIVE_CANDIDATES
            and (others_wait or gpu_behind(after.get((node, r.pid)), look_interval_s))
        ):
            # read natively the ranks that do not wait with the others (the culprits to be):
            # where one is in C (a CUDA synchronize behind a long kernel) is its native frame.
            # When no rank waits, only those whose GPU has not finished work queued a while
            # ago (all ranks behind their GPUs: a hang on the devices): a native read costs
            # a node far more, and a busy phase needs none.
            candidates += 1
            native.setdefault(node, []).append(r.pid)
    return native


def decide(
    sample: Sample,
    stall: Stall,
    confirm_s: float,
    moving_cpu_s: float,
    waiting_for: Callable[[tuple[Any, ...] | None, float], float | None],
) -> tuple[detect.Decision, float | None]:
    """The look's decision without the flight recorder, and how long the waiting ranks have
    waited in the same place (``waiting_for(key, now)``: timed across looks)."""
    first_take = detect.decide(sample.looks, stall, None, None, confirm_s, moving_cpu_s)
    # The waiting ranks' wait is timed across looks: a hang whose culprits only move waits for it.
    waited = waiting_for(first_take.waiting_key, sample.looked_at)
    return detect.decide(sample.looks, stall, None, waited, confirm_s, moving_cpu_s), waited


def hang_evidence(
    sample: Sample,
    rows: Rows,
    decision: detect.Decision,
    stall: Stall,
    decide_again: Callable[[dict[str, Any] | None], detect.Decision],
    flight_recorder: Callable[[frozenset[tuple[str, int]]], tuple[dict[str, Any] | None, str | None]],
    healthcheck: Callable[[list[str]], dict[str, Any]] | None,
) -> tuple[detect.Decision, HangEvidence]:
    """On a hang: the flight recorder (of the ranks whose agents answered the look) and the
    involved nodes' healthcheck at once (both take seconds), the decision again with the flight recorder (``decide_again(analysis)``), and the
    healthcheck of the culprits' nodes it adds."""
    got = HangEvidence()
    with ThreadPoolExecutor(max_workers=2) as pool:
        involved = sorted({c.host for c in decision.culprits} or {n for n, _ in rows})
        health_future = pool.submit(healthcheck, involved) if healthcheck is not None else None
        # the ranks whose agents did not answer the look's poll are not asked for a dump
        unanswered = frozenset((node, r.pid) for node, r in sample.after_rows if r.agent == "unresponsive")
        got.fr_analysis, got.fr_note = flight_recorder(unanswered)
        got.health = health_future.result() if health_future is not None else None
    decision = decide_again(got.fr_analysis)
    if got.health is not None and healthcheck is not None:
        more = sorted({c.host for c in decision.culprits} - set(got.health) - {"?"})
        if more:
            got.health.update(healthcheck(more))
    return decision, got


def verdict_key(decision: detect.Decision) -> tuple[Any, ...]:
    """What a verdict says, for saying it once while it does not change: its kind and culprits."""
    return (
        decision.kind,
        tuple(sorted((c.host, c.rank if c.rank is not None else -1) for c in decision.culprits)),
    )


@dataclass
class Said:
    """The verdict's frame: the job, the stall's episode, what the watch was told to do."""

    job: str
    started_at: float  # the stall's start (watch clock)
    detected_at: float
    look_interval_s: float
    gpu_coredump: bool


def verdict_of(
    said: Said,
    sample: Sample,
    rows: Rows,
    failed: dict[str, str],
    stall: Stall,
    decision: detect.Decision,
    hang: HangEvidence,
    name_kernels: Callable[[list[dict[str, Any]], set[tuple[str, int]]], None],
    clock: Callable[[], float],
) -> Verdict:
    """The verdict of a look: its evidence (the stall, the stacks, the samples, on a hang the
    flight recorder and the healthcheck, each culprit's GPU), its conclusion and every rank's row."""
    detected_s = max(0.0, said.detected_at - said.started_at)
    look_s = round(sample.looked_at - sample.started_at, 3)
    evidence: dict[str, Any] = {
        "stall": {
            "age_s": round(stall.age_s or 0.0, 3),
            "stall_after_s": stall.stall_after_s,
            "first_step": stall.first_step,
            "last_step": stall.last_step,
            "median_step_time_s": round(median_step_time([r for _, r in rows]), 6),
            "started_at": said.started_at,
        },
        "stacks": stacks_evidence(sample.second.stacks),
        "samples": {
            "look_interval_s": said.look_interval_s,
            "look_s": look_s,
            "first_at": sample.started_at,
            "unread": dict(list(sample.unread.items())[:100]),
            "native_read": {n: p[:100] for n, p in sample.native.items()},
        },
    }
    if decision.kind == "hang":
        evidence["flight_recorder"] = {"analysis": fr_summary(hang.fr_analysis), "note": hang.fr_note}
        if hang.health is not None:
            evidence["healthcheck"] = hang.health
    conclusion = decision.conclusion + health_clause(evidence.get("healthcheck"))
    gpu = gpu_side.evidence(decision.kind, decision.culprits, [*rows, *sample.after_rows])
    if gpu and said.gpu_coredump and decision.kind == "hang":
        waiting = {(st.node, st.pid) for st in decision.states if st.state == "waiting-gpu"}
        name_kernels(gpu, waiting)
    if gpu:  # what each culprit's GPU is doing (dynprof/watch/gpu_side.py)
        evidence["gpu"] = gpu
        conclusion += gpu_side.clause(gpu)
    if failed:
        conclusion += "; no answer from node(s) " + ", ".join(sorted(failed)[:20])
    decided = clock()
    evidence["timing"] = {
        "stall_started_at": said.started_at,
        "detected_at": said.detected_at,
        "detection_s": round(detected_s, 3),
        "verdict_s": round(decided - said.detected_at, 3),
        "look_s": look_s,
    }
    return Verdict(
        kind=decision.kind,
        job=said.job,
        conclusion=conclusion,
        detected_at=said.detected_at,
        decided_at=decided,
        culprits=decision.culprits,
        ranks=[s.row() for s in decision.states],
        evidence=evidence,
        nodes_unanswered=sorted(failed),
    )


def kernel_namer(
    source: WatchSource, dumps: dict[tuple[str, int], dict[str, Any]]
) -> Callable[[list[dict[str, Any]], set[tuple[str, int]]], None]:
    """Names the kernels of the culprits' GPUs through ``source``, each process dumped once
    (``dumps``: the watch's, across verdicts)."""

    def name(items: list[dict[str, Any]], waiting_gpu: set[tuple[str, int]]) -> None:
        name_kernels_of(source.gpu_coredump, dumps, items, waiting_gpu)

    return name


def exited(row: RankProgress | None) -> bool:
    """The rank's process exited (or its row is no more), as its node saw it: an agent that
    answers is not exited, whatever its pid means on that node (another pid namespace)."""
    return row is None or (row.agent != "up" and row.process_state in EXITED_STATES)


def gpu_behind(row: RankProgress | None, look_interval_s: float) -> bool:
    """Its agent's progress probe says its GPU has not finished work queued a while ago: the
    probe asked at the look's start, read about ``look_interval_s`` later, is not done after
    half that (at most GPU_BEHIND_S)."""
    limit = min(GPU_BEHIND_S, 0.5 * look_interval_s)
    return row is not None and row.gpu_step is not None and row.gpu_step.gpu_behind(limit)


def in_python_collective(p: ProcessStacks | None) -> bool:
    """Whether a process's main thread was seen in a torch.distributed collective's Python frame."""
    if p is None:
        return False
    main = p.main_thread()
    return main is not None and collective_of(python_frames(main.frames)) is not None
