"""The watch's loop (dynprof.watch.engine) over a fake source: once per stall, evidence, hooks."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from collectors.stacks import Frame, ProcessStacks, Stacks, ThreadStack, merge
from collectors.stacks import Source as StacksSource
from dynprof.renderers import render
from dynprof.store import ArtifactStore
from dynprof.watch.engine import WatchConfig, WatchEngine
from dynprof.watch.model import NodeProgress, RankProgress, Verdict
from dynprof.watch.render import render_verdict_text
from dynprof.watch.sources import NodeRead, StacksRead
from dynprof.watch.straggler.rule import StragglerReport
from dynprof.watch.straggler.sampler import StragglerSampler

DIST = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


class FakeSource:
    """Two nodes, two ranks each; rank 3 parks in load_next_batch once ``stuck`` is set."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.step = 10
        self.stuck = False
        self.down: set[str] = set()
        self.healthchecks: list[list[str]] = []
        self.fr_unanswered: list[frozenset[tuple[str, int]]] = []
        self.healthcheck_jobs: list[str | None] = []
        self.stack_reads = 0

    def nodes(self) -> list[str]:
        return ["node-1", "node-2"]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
        self.t += 1.0
        if not self.stuck:
            self.step += 1
        out = []
        for node, ranks in (("node-1", (0, 1)), ("node-2", (2, 3))):
            if node in self.down:
                out.append(NodeRead(node, None, "connection refused"))
                continue
            rows = [
                RankProgress(
                    job=job,
                    rank=r,
                    world_size=4,
                    pid=100 + r,
                    host=node,
                    step=self.step,
                    last_step_at=self.last_step,
                    last_step_age_s=self.t - self.last_step,
                    step_time_s=0.1,
                    cpu_s=5.0,
                    started_at=0.0,
                    polled_at=self.t,
                )
                for r in ranks
            ]
            out.append(NodeRead(node, NodeProgress(host=node, time=self.t, poll_every_s=1.0, ranks=rows)))
        return out

    @property
    def last_step(self) -> float:
        if not self.stuck:
            self._last = self.t
        return getattr(self, "_last", self.t)

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        self.stack_reads += 1
        sources = []
        for node, ranks in (("node-1", (0, 1)), ("node-2", (2, 3))):
            processes = []
            for r in ranks:
                frames = (
                    [Frame("load_next_batch", "/job/data.py", 88), Frame("main", "/job/train.py", 9)]
                    if r == 3
                    else [Frame("all_reduce", DIST, 2806), Frame("main", "/job/train.py", 40)]
                )
                processes.append(
                    ProcessStacks(
                        pid=100 + r, method="py-spy", rank=r, threads=[ThreadStack(100 + r, main=True, frames=frames)]
                    )
                )
            sources.append(StacksSource(Stacks(processes), node=node))
        return StacksRead(merge(sources, by_host=True))

    def flight_recorder(
        self, job: str, unanswered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[dict[str, Any] | None, str | None]:
        self.fr_unanswered.append(unanswered)
        return None, "the flight recorder is off"

    def healthcheck(self, nodes: list[str], job: str | None = None) -> dict[str, dict[str, Any]]:
        self.healthchecks.append(nodes)
        self.healthcheck_jobs.append(job)
        return {n: {"verdict": "healthy", "problems": []} for n in nodes}


def engine_for(source: FakeSource, **kw: Any) -> tuple[WatchEngine, list[tuple[Verdict, str | None]]]:
    said: list[tuple[Verdict, str | None]] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=5.0, look_interval_s=0.0, **kw)
    engine = WatchEngine(config, source, on_verdict=lambda v, p: said.append((v, p)), clock=lambda: source.t)
    return engine, said


def first_verdict(engine: WatchEngine, said: list[tuple[Verdict, str | None]]) -> Verdict:
    """The first verdict the watch says, ticking 20 times at most (then an IndexError)."""
    for _ in range(20):
        engine.tick()
        if said:
            break
    return said[0][0]


def test_a_hang_is_said_once_per_stall_with_its_evidence_and_saved_as_a_verdict_artifact():
    # GIVEN a job that steps, then rank 3 parks in data loading
    source = FakeSource()
    engine, said = engine_for(source)
    for _ in range(3):
        assert engine.tick().verdict is None
    source.stuck = True
    # WHEN the watch goes on for 12 more rounds
    ticks = [engine.tick() for _ in range(12)]
    # THEN one hang verdict, naming rank 3 on node-2, with the evidence and the times
    hangs = [v for v, _ in said if v.kind == "hang"]
    assert len(hangs) == 1, [v.conclusion for v, _ in said]
    verdict, path = said[0]
    assert [(c.rank, c.host) for c in verdict.culprits] == [(3, "node-2")]
    assert verdict.conclusion.startswith("rank 3 on node-2 is in load_next_batch (/job/data.py:88)")
    assert [r["rank"] for r in verdict.ranks] == [0, 1, 2, 3]
    assert verdict.evidence["healthcheck"] == {"node-2": {"verdict": "healthy", "problems": []}}
    assert set(source.healthcheck_jobs) == {"j"}  # the job's own ranks are no other processes there
    assert verdict.evidence["flight_recorder"]["note"] == "the flight recorder is off"
    assert verdict.evidence["timing"]["detection_s"] >= 5.0
    assert verdict.evidence["stacks"]["groups"][0]["size"] == 3
    stalled = [t for t in ticks if t.stall is not None and t.stall.stalled]
    assert stalled
    # and the ranks' stacks are not read every round of the stall once it is said
    assert source.stack_reads < 2 * len(stalled)
    assert engine.gauges()[0].stalled and engine.gauges()[0].verdicts == {"hang": 1}
    # and the artifact holds the verdict, which `dynprof show`'s renderer reads back
    assert path is not None
    art = ArtifactStore().get(os.path.relpath(path, ArtifactStore().root))
    assert art.kind == "verdict" and art.manifest["summary"]["conclusion"] == verdict.conclusion
    assert Verdict.from_json(json.loads((art.path / "verdict.json").read_text())).culprits[0].rank == 3
    summary, text = render(art)
    assert summary is not None and summary["kind"] == "hang"
    assert text.startswith("HANG job j: rank 3 on node-2 is in load_next_batch")

    # WHEN progress resumes
    source.stuck = False
    resumed = engine.tick()
    # THEN it is said once, and the next stall is a new episode
    assert resumed.verdict is not None and resumed.verdict.kind == "ok"
    assert "progress resumed" in resumed.verdict.conclusion
    assert engine.tick().verdict is None and not engine.gauges()[0].stalled


def test_nodes_that_do_not_answer_are_named_not_dropped():
    # GIVEN node-1 down, rank 3 stuck
    source = FakeSource()
    engine, said = engine_for(source)
    engine.tick()
    source.down = {"node-1"}
    source.stuck = True
    # WHEN
    ticks = [engine.tick() for _ in range(8)]
    # THEN every round names it, and so does the verdict
    assert all(t.nodes_unanswered == {"node-1": "connection refused"} for t in ticks)
    verdict = next(v for v, _ in said if v.kind == "hang")
    assert verdict.nodes_unanswered == ["node-1"]
    assert "no answer from node(s) node-1" in verdict.conclusion


class HookSampler:
    """The straggler's sampler, its samples ``hook(job)``: what a sample says, without a trace."""

    name = "straggler"

    def __init__(self, hook: Any, every_s: float) -> None:
        self.hook = hook
        self.every_s = every_s

    def sample(self, job: str) -> StragglerReport:
        return self.hook(job)


def test_the_straggler_sampler_is_called_every_sample_and_its_scores_exported():
    # GIVEN a straggler sampler that scores rank 2
    source = FakeSource()
    calls: list[str] = []

    def straggler(job: str) -> StragglerReport:
        calls.append(job)
        return StragglerReport(sampled_at=source.t, steps=2, scores={("node-2", 2): 0.3})

    said: list[Verdict] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=60.0)
    engine = WatchEngine(
        config,
        source,
        on_verdict=lambda v, p: said.append(v),
        samplers=[HookSampler(straggler, 3.0)],
        clock=lambda: source.t,
    )
    # WHEN ten rounds of one second run (each sample done before the next round)
    for _ in range(10):
        engine.tick()
        assert engine.wait_for_sample(timeout=30)
    # THEN it was sampled every 3 s, and the score is in the gauges
    assert calls == ["j", "j", "j"]
    assert engine.gauges()[0].straggler_scores == {("node-2", 2): 0.3}
    assert said == []


def test_progress_polls_go_on_while_a_sample_is_in_flight():
    # GIVEN a straggler sample that does not finish until the test lets it
    import threading

    source = FakeSource()
    started, release = threading.Event(), threading.Event()

    def straggler(job: str) -> StragglerReport:
        started.set()
        release.wait(60)
        return StragglerReport(sampled_at=source.t, steps=2, scores={("node-2", 2): 0.0}, check="no straggler")

    samples: list[StragglerReport] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=5.0, look_interval_s=0.0)
    samplers = [HookSampler(straggler, 2.0)]
    engine = WatchEngine(config, source, samplers=samplers, clock=lambda: source.t, on_sample=samples.append)
    try:
        # WHEN rounds run after the sample started, and the job stalls meanwhile
        engine.tick()
        engine.tick()
        assert started.wait(30)
        before = source.t
        source.stuck = True
        ticks = [engine.tick() for _ in range(10)]

        # THEN every round polled (the clock moved each time), the stall was seen with the
        # sample still in flight, and no second sample started beside it
        assert len(ticks) == 10 and source.t >= before + 10
        assert engine.sampling()
        assert any(t.stall is not None and t.stall.stalled for t in ticks)
        assert samples == []
    finally:
        release.set()
    assert engine.wait_for_sample(timeout=30)
    assert len(samples) == 1 and samples[0].check == "no straggler"


def test_a_sample_that_raises_is_still_said():
    # GIVEN the straggler's sampler over a source whose trace fails
    source = FakeSource()

    def trace(job: str, steps: int, limit_s: float) -> Any:
        raise RuntimeError("boom")

    source.trace = trace  # type: ignore[attr-defined]
    samples: list[StragglerReport] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=60.0)
    samplers = [StragglerSampler(source, 1.0, clock=lambda: source.t)]
    engine = WatchEngine(config, source, samplers=samplers, clock=lambda: source.t, on_sample=samples.append)
    # WHEN a sample is due (the round's poll moves the clock 1 s)
    engine.tick()
    assert engine.wait_for_sample(timeout=30)
    # THEN the watch says it failed, and why
    assert len(samples) == 1 and "boom" in samples[0].note and samples[0].verdict is None


def test_the_job_ending_ends_the_watch():
    # GIVEN a job seen once, then no rank on any node
    source = FakeSource()
    engine, _ = engine_for(source)
    engine.tick()
    source.progress = lambda job, fresh=False: [  # type: ignore[method-assign]
        NodeRead(n, NodeProgress(host=n, time=0.0, poll_every_s=1.0)) for n in ("node-1", "node-2")
    ]
    # WHEN
    tick = engine.tick()
    # THEN
    assert tick.ended and engine.run() == []


def _exited_rows(source: FakeSource, job: str) -> list[NodeRead]:
    """What the nodes keep a while of a job whose ranks all exited: rows in state gone."""
    reads = FakeSource.progress(source, job)
    for read in reads:
        assert read.progress is not None
        for r in read.progress.ranks:
            r.agent, r.process_state = "gone", "gone"
    return reads


def test_a_job_whose_ranks_all_exited_is_neither_a_hang_nor_progress():
    # GIVEN a job seen stepping, then every rank exited; the nodes keep the ranks' rows a while
    source = FakeSource()
    engine, said = engine_for(source)
    engine.tick()
    source.stuck = True
    source.progress = lambda job, fresh=False: _exited_rows(source, job)  # type: ignore[method-assign]
    # WHEN the watch goes on past the stall time
    ticks = [engine.tick() for _ in range(8)]
    # THEN it says so, looks at nothing and says no verdict (no hang; no "progress resumed")
    assert all(t.note == "every rank of the job exited" and not t.ended for t in ticks), [t.note for t in ticks]
    assert said == [] and source.stack_reads == 0
    # AND a launcher that starts the ranks again is watched on (an elastic restart)
    source.stuck = False
    source.progress = lambda job, fresh=False: FakeSource.progress(source, job)  # type: ignore[method-assign]
    assert engine.tick().ranks == 4 and said == []
    # AND once the nodes forget the rows of a job that ended, the watch ends
    source.progress = lambda job, fresh=False: [  # type: ignore[method-assign]
        NodeRead(n, NodeProgress(host=n, time=0.0, poll_every_s=1.0)) for n in ("node-1", "node-2")
    ]
    assert engine.tick().ended


def test_ranks_that_exit_during_the_look_are_no_hang():
    # GIVEN a job that stopped stepping (its ranks on their way out, slow to exit)
    source = FakeSource()
    engine, said = engine_for(source)
    for _ in range(2):
        engine.tick()
    source.stuck = True
    alive = source.progress

    def progress(job: str, fresh: bool = False) -> list[NodeRead]:
        # every rank has exited by the look's own read (a fresh one)
        return _exited_rows(source, job) if fresh else alive(job)

    source.progress = progress  # type: ignore[method-assign]
    # WHEN the watch looks at the stalled job
    ticks = [engine.tick() for _ in range(10)]
    looked = source.stack_reads
    source.progress = lambda job, fresh=False: _exited_rows(source, job)  # type: ignore[method-assign]
    last = engine.tick()
    # THEN it looked, but said nothing of a job that is gone (nor after)
    assert looked > 0, [t.note for t in ticks]
    assert [v.kind for v, _ in said] == []
    assert last.note == "every rank of the job exited" and last.verdict is None


def test_verdict_files_are_private(tmp_path):
    # GIVEN / WHEN a verdict written by the engine
    source = FakeSource()
    engine, said = engine_for(source)
    engine.tick()
    source.stuck = True
    for _ in range(8):
        engine.tick()
    path = next(p for v, p in said if v.kind == "hang")
    assert path is not None
    # THEN its files are the store's usual private ones
    mode = stat.S_IMODE(os.stat(os.path.join(path, "verdict.json")).st_mode)
    assert mode & 0o077 == 0


class RecordingSource(FakeSource):
    """FakeSource that remembers which ranks each look asked to read natively; with
    ``all_busy`` no rank is in a collective (every rank in save_checkpoint)."""

    def __init__(self, all_busy: bool = False) -> None:
        super().__init__()
        self.native_asked: list[dict[str, list[int]]] = []
        self.all_busy = all_busy

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        self.native_asked.append({k: sorted(v) for k, v in native.items()})
        if not self.all_busy:
            return super().stacks(job, native)
        self.stack_reads += 1
        sources = []
        for node, ranks in (("node-1", (0, 1)), ("node-2", (2, 3))):
            frames = [Frame("save_checkpoint", "/job/train.py", 210), Frame("main", "/job/train.py", 9)]
            processes = [
                ProcessStacks(
                    pid=100 + r, method="py-spy", rank=r, threads=[ThreadStack(100 + r, main=True, frames=frames)]
                )
                for r in ranks
            ]
            sources.append(StacksSource(Stacks(processes), node=node))
        return StacksRead(merge(sources, by_host=True))


def test_the_look_reads_natively_only_the_ranks_that_do_not_wait_with_the_others():
    # GIVEN ranks 0-2 in all_reduce and rank 3 parked elsewhere; and a job whose ranks all save
    for all_busy, expected in ((False, {"node-2": [103]}), (True, {})):
        source = RecordingSource(all_busy=all_busy)
        engine, _ = engine_for(source)
        engine.tick()
        source.stuck = True
        # WHEN the watch looks at the stall
        for _ in range(8):
            engine.tick()
        # THEN the second sample reads natively rank 3 alone; none when no rank waits (a
        # native read costs a node far more, and busy ranks need none)
        assert source.native_asked and source.native_asked[0] == {}
        assert source.native_asked[1] == expected


class StoppingSource(FakeSource):
    """Rank 3's agent stops answering after the step ``stops_at`` (its process stopped); its
    node then reports for it the step ``reported`` (0: what a fresh read of an agent that does
    not answer says; else a stale count) and no time of a last step."""

    def __init__(self, stops_at: int, reported: int) -> None:
        super().__init__()
        self.step = 0
        self.stops_at = stops_at
        self.reported = reported
        self.step_times: dict[int, float] = {}

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
        self.stuck = self.step >= self.stops_at
        reads = super().progress(job, fresh)
        self.step_times.setdefault(self.step, self.last_step)
        for read in reads:
            assert read.progress is not None
            for r in read.progress.ranks:
                if r.rank == 3 and self.stuck:
                    r.agent, r.process_state = "unresponsive", "stopped"
                    r.step, r.last_step_at, r.last_step_age_s = self.reported, 0.0, None
        return reads


def test_a_rank_whose_agent_stopped_answering_is_said_at_the_last_step_the_watch_saw_it_make():
    for stops_at, reported in ((5, 0), (149, 24), (149, 0)):
        # GIVEN a job the watch saw step to `stops_at`, then rank 3 stopped, its node reporting
        # `reported` steps for it and no time of its last step
        source = StoppingSource(stops_at, reported)
        engine, said = engine_for(source)
        while source.step < stops_at:
            engine.tick()
        last_step_at = source.step_times[stops_at]
        # WHEN the watch goes on until it says the hang
        verdict = first_verdict(engine, said)
        # THEN the culprit is rank 3, since the last step the watch saw it make, and its age
        # counts from that step, not from its process's start
        assert [c.rank for c in verdict.culprits] == [3], verdict.conclusion
        assert verdict.culprits[0].since_step == stops_at, verdict.conclusion
        assert f"since step {stops_at}" in verdict.conclusion
        row3 = next(r for r in verdict.ranks if r["rank"] == 3)
        assert row3["step"] == stops_at
        assert row3["last_step_age_s"] is not None
        assert abs(row3["last_step_age_s"] - (source.t - last_step_at)) <= 1.0, (row3, source.t, last_step_at)
        # AND its agent, silent in the look's poll, was not asked for a flight-recorder dump
        assert source.fr_unanswered and all({pid for _, pid in u} == {103} for u in source.fr_unanswered)


def test_a_rank_whose_agent_never_answered_this_watch_is_said_with_its_last_step_unknown_not_0():
    # GIVEN a job that made 5 steps before the watch started (`watch --once` after the fact),
    # rank 3 stopped since, its node reporting 0 steps and no last step for it
    source = StoppingSource(5, 0)
    while source.step < 5:
        source.progress("j")
    engine, said = engine_for(source)
    # WHEN the watch looks
    verdict = first_verdict(engine, said)
    # THEN rank 3 is the culprit, with its last step and its age unknown, never "since step 0"
    # nor aged from its process's start; the other ranks keep theirs
    assert [c.rank for c in verdict.culprits] == [3], verdict.conclusion
    assert verdict.culprits[0].since_step is None
    assert "since step 0" not in verdict.conclusion, verdict.conclusion
    said_of_3 = (
        "rank 3 on node-2 is stopped (SIGSTOP or a debugger) in load_next_batch (/job/data.py:88) "
        "(its last step unknown: its agent has not answered this watch)"
    )
    assert said_of_3 in verdict.conclusion, verdict.conclusion
    row3 = next(r for r in verdict.ranks if r["rank"] == 3)
    assert row3["step"] is None and row3["last_step_age_s"] is None, row3
    others = [r for r in verdict.ranks if r["rank"] != 3]
    assert all(r["step"] == 5 and r["last_step_age_s"] is not None for r in others), others
    # and the printed table says it is not known
    (line,) = [ln for ln in render_verdict_text(verdict).splitlines() if ln.startswith("  3 ")]
    assert line.split()[:4] == ["3", "node-2", "?", "-"], line


class SpinningSource(FakeSource):
    """Ranks 0-2 wait in all_reduce; rank 3 spins in Python (its stack changes at every read):
    the only culprit moves, so the hang waits to be confirmed."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = True
        self._last = self.t  # its last step

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        read = super().stacks(job, native)
        line = 10 + self.stack_reads
        for p in read.stacks.processes:
            if p.rank == 3:
                p.threads[0].frames[:] = [Frame("spin", "/job/train.py", line), Frame("main", "/job/train.py", 9)]
        return read


def _once(source: FakeSource, look_interval_s: float = 0.0) -> tuple[list[Verdict], list[Any], list[float]]:
    """``watch --once`` over ``source`` once its stall has lasted 8 s: what it said, its ticks
    and the sleeps it took (on the source's clock)."""
    said: list[Verdict] = []
    ticks: list[Any] = []
    slept: list[float] = []
    config = WatchConfig(job="j", interval_s=1.0, stall_after_s=5.0, look_interval_s=look_interval_s)

    def sleep(s: float) -> None:
        slept.append(s)
        source.t += s

    engine = WatchEngine(
        config,
        source,
        on_verdict=lambda v, p: said.append(v),
        on_tick=ticks.append,
        clock=lambda: source.t,
        sleep=sleep,
    )
    for _ in range(8):
        source.t += 1.0
    engine.run(once=True)
    return said, ticks, slept


def test_once_looks_again_to_confirm_a_hang_instead_of_saying_nothing():
    # GIVEN a stalled job whose only culprit moves (confirmed after half the 5 s stall time)
    source = SpinningSource()
    # WHEN the watch checks once
    said, ticks, slept = _once(source)
    # THEN its first look left the hang to be confirmed, it looked again when it could be,
    # and said the hang, naming the spinning rank
    assert ticks[0].verdict is None and ticks[0].confirm_in_s is not None, ticks[0]
    assert "to be confirmed" in ticks[0].note
    assert slept and slept[0] == ticks[0].confirm_in_s
    assert [v.kind for v in said] == ["hang"], [v.conclusion for v in said]
    assert [(c.rank, c.host) for c in said[0].culprits] == [(3, "node-2")]


class BehindGpuSource(FakeSource):
    """Every rank stopped at the same line of the program, its main thread spinning (CPU) in a
    CUDA device-to-host copy (the recorded H200 stacks of tests/data/gpu_stacks/item.json) when
    read natively; each agent's progress probe says whether its GPU finished what was queued."""

    def __init__(self, gpu_behind: bool, probe_age_s: float = 2.0) -> None:
        super().__init__()
        self.stuck = True
        self._last = self.t
        self.gpu_behind = gpu_behind
        self.probe_age_s = probe_age_s
        self.native_asked: list[dict[str, list[int]]] = []
        from tests.unit.test_watch_detect import _gpu_stack

        self.native_frames = _gpu_stack("item")
        self.python_frames = [f for f in self.native_frames if not f.native]

    def progress(self, job: str, fresh: bool = False) -> list[NodeRead]:
        from dynprof.watch.model import GpuStep

        reads = super().progress(job, fresh)
        for read in reads:
            for r in read.progress.ranks if read.progress else []:
                r.cpu_s = 5.0 + self.t  # the CUDA runtime's wait spins
                r.gpu_step = GpuStep(step=self.step, done=True, age_s=self.t - self._last, device=0)
                r.gpu_step.probe_done, r.gpu_step.probe_age_s = (not self.gpu_behind), self.probe_age_s
        return reads

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        self.native_asked.append({n: list(p) for n, p in native.items()})
        read = super().stacks(job, native)
        for p in read.stacks.processes:
            natively = p.pid in native.get(p.host or "", []) or any(p.pid in pids for pids in native.values())
            p.threads[0].frames[:] = self.native_frames if natively else self.python_frames
        return read


def test_every_rank_behind_its_gpu_is_read_natively_and_called_a_hang_on_the_devices():
    # GIVEN every rank spinning in a CUDA copy while its GPU has not finished work queued 2 s ago
    source = BehindGpuSource(gpu_behind=True)
    # WHEN the watch checks once
    said, ticks, _ = _once(source)
    # THEN every rank was read natively (no rank waits in a collective), the hang was left to be
    # confirmed, then said: on the devices, each rank waiting for its GPU in the copy
    assert source.native_asked[0] == {} and sorted(p for pids in source.native_asked[1].values() for p in pids) == [
        100,
        101,
        102,
        103,
    ]
    assert ticks[0].confirm_in_s is not None
    assert [v.kind for v in said] == ["hang"], [v.conclusion for v in said]
    assert "every rank waits for its GPU" in said[0].conclusion and "the hang is on the devices" in said[0].conclusion
    assert "ranks 2-3 on node-2 wait for their GPUs in a device-to-host copy" in said[0].conclusion, said[0].conclusion
    assert all(r["state"].startswith("waiting for its GPU in a device-to-host copy") for r in said[0].ranks)


def test_ranks_whose_gpus_keep_up_are_busy_and_not_read_natively():
    # GIVEN the same stacks, but each GPU finishes what is queued (an evaluation loop that syncs
    # at every batch spins in the same copy)
    source = BehindGpuSource(gpu_behind=False)
    # WHEN the watch checks once
    said, _, _ = _once(source)
    # THEN no native read, and the job is busy, not hung
    assert all(asked == {} for asked in source.native_asked)
    assert [v.kind for v in said] == ["busy"], [v.conclusion for v in said]


def test_a_probe_asked_at_the_looks_start_counts_once_half_the_look_interval_has_passed():
    # GIVEN looks 1 s apart (the probe asked at the look's start is read about 1 s later)
    # WHEN each rank's probe is unfinished after 0.6 s, or after 0.4 s only
    behind = BehindGpuSource(gpu_behind=True, probe_age_s=0.6)
    said_behind, _, _ = _once(behind, look_interval_s=1.0)
    early = BehindGpuSource(gpu_behind=True, probe_age_s=0.4)
    said_early, _, _ = _once(early, look_interval_s=1.0)
    # THEN the first are read natively and called a hang on the devices; the second are not read
    assert [v.kind for v in said_behind] == ["hang"], [v.conclusion for v in said_behind]
    assert all(asked == {} for asked in early.native_asked)
    assert [v.kind for v in said_early] == ["busy"], [v.conclusion for v in said_early]


class AllParkedSource(FakeSource):
    """Every rank stalled at the same line outside any collective, spending no CPU (a deadlock
    on a dead worker's queue, or workers starved for a look)."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = True
        self._last = self.t

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        read = super().stacks(job, native)
        for p in read.stacks.processes:
            p.threads[0].frames[:] = [Frame("load_next_batch", "/job/data.py", 88), Frame("main", "/job/train.py", 9)]
        return read


def test_no_rank_moving_is_called_a_hang_once_confirmed_by_a_second_look():
    # GIVEN a stalled job whose ranks all sit in the same place, no CPU spent
    source = AllParkedSource()
    # WHEN the watch checks once
    said, ticks, slept = _once(source)
    # THEN its first look left the hang to be confirmed (one look may be a starved node), it
    # looked again after the confirm time, and said it: every rank named
    assert ticks[0].verdict is None and ticks[0].confirm_in_s is not None, ticks[0]
    assert slept and slept[0] == ticks[0].confirm_in_s
    assert [v.kind for v in said] == ["hang"], [v.conclusion for v in said]
    assert "no rank moves" in said[0].conclusion
    assert sorted(c.rank for c in said[0].culprits if c.rank is not None) == [0, 1, 2, 3]
