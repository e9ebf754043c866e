"""The watch's loop: poll every node's progress, and when a job stalls, look, decide and say so.

Every ``interval`` the engine reads each node's progress (one ``GET /api/progress?job=J`` per
node, all nodes at once, through :class:`~dynprof.job.client.SidecarClient`, or this node's
agents directly); nodes that do not answer are named in what it says, never dropped. When no
rank advanced for the stall time (:func:`dynprof.watch.stall.check_stall`) it looks
(:mod:`dynprof.watch.look`): every rank's stacks twice, ``look_interval`` apart, through the
nodes' ``stacks`` action (native frames for the ranks whose agent does not answer), merged by
:func:`collectors.stacks.merge`, and decides (:func:`dynprof.watch.detect.decide`). On a hang it
gathers the evidence (the flight recorder's analysis when the job has it on; each involved
node's quick healthcheck), builds the :class:`~dynprof.watch.model.Verdict`, writes it as a ``verdict`` artifact, hands
it to ``on_verdict`` (printing, the user's hook) and does not say it again while the stall
lasts, unless the verdict changes (other culprits, busy becoming a hang); when progress
resumes it says that once. It never acts on the job.

Beside the polls it runs its samplers (:mod:`dynprof.watch.sampler`), each on its schedule and
its own thread: the straggler's sampled trace is the first (:mod:`dynprof.watch.straggler`). A
sample's gauges are kept for ``/metrics``, its verdict is published as the loop's are, and its
report handed to ``on_sample``; the engine knows no signal by name.

Where the engine reads is a :class:`~dynprof.watch.sources.WatchSource`:
:class:`~dynprof.watch.sources.SidecarSource` (the nodes' sidecars) or
:class:`~dynprof.watch.sources.LocalSource` (this node's agents: ``dynprof watch`` without
nodes, ``dynprof serve --watch``). What a verdict keeps of what it read is shaped in :mod:`dynprof.watch.evidence`, its
conclusion's healthcheck clause and its artifact in :mod:`dynprof.watch.conclusion`, and the
user's ``--on-verdict`` hook runs in :mod:`dynprof.watch.hook`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from collectors.stacks import Stacks
from dynprof import errors
from dynprof.watch import detect, look
from dynprof.watch.classify import MOVING_CPU_S
from dynprof.watch.conclusion import write_verdict
from dynprof.watch.evidence import rank_row
from dynprof.watch.model import RankProgress, RankValues, Verdict, WatchGauges
from dynprof.watch.sampler import Sampler, SignalReport
from dynprof.watch.sources import WatchSource
from dynprof.watch.stall import Stall, check_stall

log = logging.getLogger("dynprof.watch")

DEFAULT_INTERVAL_S = 5.0
DEFAULT_LOOK_INTERVAL_S = 3.0
ONCE_CONFIRM_LOOKS = 2  # --once: looks again at most this many times to confirm a hang it found


@dataclass
class Episode:
    """One stall, from when the watch saw it until progress resumes."""

    detected_at: float
    started_at: float  # the stall's start: the last step of any rank (watch clock)
    last_key: tuple[Any, ...] | None = None
    verdicts: int = 0
    waiting_key: tuple[Any, ...] | None = None
    waiting_since: float | None = None
    next_look_at: float = 0.0  # after a verdict, the next look waits (the ranks are not paused for nothing)
    confirm_at: float | None = None  # the last look's decision was pending: it can be confirmed then


@dataclass
class WatchConfig:
    job: str
    interval_s: float = DEFAULT_INTERVAL_S
    stall_after_s: float | None = None  # None: the larger of 60 s and 20x the median step time
    look_interval_s: float = DEFAULT_LOOK_INTERVAL_S
    confirm_s: float | None = None  # None: half the stall time
    healthcheck: bool = True
    save: bool = True
    moving_cpu_s: float = MOVING_CPU_S
    # on a hang, dump the GPU of each culprit whose step's GPU work has not finished, to name the
    # kernel it runs (the driver's user-triggered core dump; it ends that rank's GPU work)
    gpu_coredump: bool = False


@dataclass
class _Scheduled:
    """A sampler, when its last sample started, and its sample in flight."""

    sampler: Sampler
    last_at: float
    thread: threading.Thread | None = None

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class Tick:
    """What one round of the loop found (for the face's progress line and for tests)."""

    ranks: int
    nodes_unanswered: dict[str, str]
    stall: Stall | None
    verdict: Verdict | None = None
    artifact: str | None = None
    ended: bool = False
    note: str = ""
    # A look found a hang still to be confirmed: it can be called this many seconds from now
    # (``--once`` looks again then, instead of ending with nothing said).
    confirm_in_s: float | None = None


class WatchEngine:
    """The loop over one job (see the module's docstring)."""

    def __init__(
        self,
        config: WatchConfig,
        source: WatchSource,
        on_verdict: Callable[[Verdict, str | None], None] | None = None,
        on_tick: Callable[[Tick], None] | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] | None = None,
        on_sample: Callable[[SignalReport], None] | None = None,
        samplers: Sequence[Sampler] = (),
    ) -> None:
        self.config = config
        self.source = source
        self.on_verdict = on_verdict
        self.on_tick = on_tick
        self.on_sample = on_sample  # each sample's report (a SignalReport)
        chosen = list(samplers)
        self.clock = clock
        self._stop = threading.Event()
        self._sleep = sleep or (lambda s: self._stop.wait(s) and None)
        self.episode: Episode | None = None
        self.seen: dict[tuple[str, int], RankProgress] = {}
        self.verdicts: list[Verdict] = []
        self.counts: dict[str, int] = {}
        self.stalled = False
        # each sampler's gauges from its last sample: name -> gauge -> (host, rank) -> value
        self.signal_gauges: dict[str, dict[str, RankValues]] = {}
        self._scheduled = [_Scheduled(sampler, clock()) for sampler in chosen]
        self._lock = threading.Lock()
        self._gpu_dumps: dict[tuple[str, int], dict[str, Any]] = {}  # (node, pid) -> what its dump named

    # -- running --------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(self, once: bool = False) -> list[Verdict]:
        """Until the job ends (every rank gone), :meth:`stop`, or after one round with ``once``."""
        while not self._stop.is_set():
            started = time.monotonic()
            tick = self.tick(force_look=once)
            if self.on_tick is not None:
                self.on_tick(tick)
            # One check that found a hang still to be confirmed (every rank waits for its GPU;
            # the only culprits move) looks again once it can be: it says what it found.
            looks = 0
            while once and tick.confirm_in_s is not None and looks < ONCE_CONFIRM_LOOKS and not self._stop.is_set():
                looks += 1
                self._sleep(tick.confirm_in_s)
                tick = self.tick(force_look=True)
                if self.on_tick is not None:
                    self.on_tick(tick)
            if once or tick.ended:
                break
            self._sleep(max(0.0, self.config.interval_s - (time.monotonic() - started)))
        if once:  # one check says what its sample found
            self.wait_for_sample()
        return self.verdicts

    @property
    def samplers(self) -> list[Sampler]:
        """The samplers this engine runs, each on its schedule."""
        return [s.sampler for s in self._scheduled]

    def sampling(self) -> bool:
        """Whether a sample is in flight (samples run beside the progress polls)."""
        return any(s.running() for s in self._scheduled)

    def wait_for_sample(self, timeout: float | None = None) -> bool:
        """Wait for the samples in flight, if any; whether none is left in flight."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for s in self._scheduled:
            thread = s.thread
            if thread is not None:
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.sampling()

    def gauges(self) -> list[WatchGauges]:
        """What the sidecar exports on /metrics for the job this engine watches."""
        with self._lock:
            return [
                WatchGauges(
                    job=self.config.job,
                    stalled=self.stalled,
                    verdicts=dict(self.counts),
                    signals=self.signal_gauges,
                )
            ]

    # -- one round ----------------------------------------------------------------------------
    def poll(self, fresh: bool = False) -> tuple[list[tuple[str, RankProgress]], dict[str, str]]:
        """Every node's ranks of the job; ``fresh``: read now, not the nodes' last polls."""
        reads = self.source.progress(self.config.job, fresh=fresh)
        rows: list[tuple[str, RankProgress]] = []
        failed: dict[str, str] = {}
        for read in reads:
            if read.progress is None:
                failed[read.node] = read.error or "no answer"
                continue
            for r in read.progress.ranks:
                if r.job == self.config.job:
                    rows.append((read.node, self._with_last_known(read.node, r)))
        return rows, failed

    def _with_last_known(self, node: str, row: RankProgress) -> RankProgress:
        """A rank whose agent does not answer (stopped, in C holding the GIL) keeps the last step
        the watch saw it make (or its node's count, when later), its age counted from that step
        on its node's clock; when neither ever heard a count, its step is unknown, not 0."""
        if row.agent == "up":
            return row
        known = self.seen.get((node, row.pid))
        if known is not None and (
            known.step > row.step or (known.step == row.step and known.last_step_at > row.last_step_at)
        ):
            row.step = known.step
            row.step_time_s = row.step_time_s or known.step_time_s
            row.last_step_at = known.last_step_at
            if known.last_step_at > 0 and row.polled_at >= known.last_step_at:
                row.last_step_age_s = row.polled_at - known.last_step_at
        if known is not None and row.rank is None:
            row.rank, row.world_size = known.rank, known.world_size
        told = row.step > 0 or row.last_step_at > 0 or (known is not None and not known.step_unknown)
        row.step_unknown = not told
        return row

    def tick(self, force_look: bool = False) -> Tick:
        rows, failed = self.poll()
        now = self.clock()
        live_nodes = {n for n in self.source.nodes() if n not in failed}
        here = {(node, r.pid) for node, r in rows}
        gone = [(node, r) for (node, pid), r in self.seen.items() if (node, pid) not in here and node in live_nodes]
        for node, r in rows:
            self.seen[(node, r.pid)] = r
        if self.seen and not rows and not failed:
            self._set_stalled(False)
            return Tick(0, failed, None, ended=True, note="every rank of the job is gone")
        if rows and all(look.exited(r) for _, r in rows):
            # Only the rows a node keeps a while of ranks that exited: a job that ended (done or
            # crashed) is neither a hang nor progress. The watch waits, saying nothing, until the
            # nodes forget them (it ends) or a launcher starts the ranks again (it goes on).
            self._set_stalled(False)
            self.episode = None
            return Tick(0, failed, None, note="every rank of the job exited")
        if not rows:
            note = "no rank of the job on any node that answered"
            return Tick(0, failed, None, note=note)
        self._maybe_sample(now)
        stall = check_stall([r for _, r in rows], self.config.stall_after_s)
        if not stall.stalled and not force_look:
            tick = Tick(len(rows), failed, stall)
            if self.episode is not None:
                tick.verdict, tick.artifact = self._resumed(rows, failed, stall, now)
            self._set_stalled(False)
            return tick
        if not stall.stalled:  # --once on a job that moves: said, not saved
            ok = self._ok(rows, failed, stall, now)
            if self.on_verdict is not None:
                self.on_verdict(ok, None)
            return Tick(len(rows), failed, stall, verdict=ok)
        self._set_stalled(True)
        if self.episode is None:
            started = now - (stall.age_s or 0.0)
            self.episode = Episode(detected_at=now, started_at=started)
        if now < self.episode.next_look_at and not force_look:
            return Tick(len(rows), failed, stall, note="stalled; looked at already")
        self.episode.confirm_at = None
        verdict, artifact = self._look_and_decide(rows, gone, failed, stall)
        confirm_at = self.episode.confirm_at if self.episode is not None else None
        if verdict is None and confirm_at is not None:
            wait = max(0.0, confirm_at - self.clock())
            note = f"stalled; a hang to be confirmed in {wait:.1f} s"
            return Tick(len(rows), failed, stall, note=note, confirm_in_s=wait)
        return Tick(len(rows), failed, stall, verdict=verdict, artifact=artifact)

    def _set_stalled(self, value: bool) -> None:
        with self._lock:
            self.stalled = value

    # -- the look ---------------------------------------------------------------------------
    def _look_and_decide(
        self,
        rows: list[tuple[str, RankProgress]],
        gone: list[tuple[str, RankProgress]],
        failed: dict[str, str],
        stall: Stall,
    ) -> tuple[Verdict | None, str | None]:
        """One look (:mod:`dynprof.watch.look`): the verdict it says and its artifact, or
        nothing (a decision to confirm, one already said, a job that ended during the look)."""
        assert self.episode is not None
        episode = self.episode
        config = self.config
        sample = look.take(
            self.source, config.job, rows, gone, config.look_interval_s, self.clock, self._sleep, self.poll
        )
        if sample is None:  # every rank exited during the look: the next round says so
            return None, None
        confirm = config.confirm_s if config.confirm_s is not None else stall.stall_after_s / 2
        moving = config.moving_cpu_s
        decision, waited = look.decide(sample, stall, confirm, moving, self._waiting_for)
        hang = look.HangEvidence()
        if decision.kind == "hang":
            decision, hang = look.hang_evidence(
                sample,
                rows,
                decision,
                stall,
                lambda fr: detect.decide(sample.looks, stall, fr, waited, confirm, moving),
                self._flight_recorder,
                self._healthcheck if config.healthcheck else None,
            )
        if decision.kind == "pending":
            episode.confirm_at = sample.looked_at + max(0.0, confirm - (waited or 0.0))
            return None, None
        # Said (or to be said again only if it changes): look again in half a stall time, not
        # every round: each look reads every rank's stacks twice.
        episode.next_look_at = self.clock() + max(config.interval_s, stall.stall_after_s / 2)
        key = look.verdict_key(decision)
        if key == episode.last_key:
            return None, None
        said = look.Said(
            config.job, episode.started_at, episode.detected_at, config.look_interval_s, config.gpu_coredump
        )
        namer = look.kernel_namer(self.source, self._gpu_dumps)
        verdict = look.verdict_of(said, sample, rows, failed, stall, decision, hang, namer, self.clock)
        artifact = self._publish(verdict, sample.second.stacks)
        episode.last_key = key
        episode.verdicts += 1
        return verdict, artifact

    def _waiting_for(self, key: tuple[Any, ...] | None, now: float) -> float | None:
        """Seconds the same ranks have been seen waiting in the same place (None: not waiting)."""
        episode = self.episode
        if episode is None or key is None:
            return None
        if episode.waiting_key != key or episode.waiting_since is None:
            episode.waiting_key, episode.waiting_since = key, now
        return now - episode.waiting_since

    def _healthcheck(self, nodes: list[str]) -> dict[str, Any]:
        try:
            return dict(self.source.healthcheck(nodes, self.config.job))
        except Exception as exc:  # the evidence is best effort: the verdict still comes
            log.warning("dynprof watch: healthcheck failed: %s", exc)
            return {n: {"verdict": "could not run", "error": f"{type(exc).__name__}: {exc}"[:300]} for n in nodes}

    def _flight_recorder(
        self, unanswered: frozenset[tuple[str, int]] = frozenset()
    ) -> tuple[dict[str, Any] | None, str | None]:
        try:
            return self.source.flight_recorder(self.config.job, unanswered)
        except Exception as exc:  # best effort: the stacks decide without it
            log.warning("dynprof watch: reading the flight recorder failed: %s", exc)
            return None, f"reading the flight recorder failed: {type(exc).__name__}: {exc}"[:300]

    # -- the other verdicts ---------------------------------------------------------------------
    def _resumed(
        self, rows: list[tuple[str, RankProgress]], failed: dict[str, str], stall: Stall, now: float
    ) -> tuple[Verdict | None, str | None]:
        episode = self.episode
        self.episode = None
        if episode is None or episode.verdicts == 0:
            return None, None
        lasted = now - episode.started_at
        verdict = Verdict(
            kind="ok",
            job=self.config.job,
            conclusion=f"progress resumed: step {stall.last_step} after {lasted:.0f} s without a step",
            detected_at=episode.detected_at,
            decided_at=now,
            ranks=[rank_row(node, r) for node, r in rows],
            evidence={"stall": {"lasted_s": round(lasted, 3), "started_at": episode.started_at}},
            nodes_unanswered=sorted(failed),
        )
        return verdict, self._publish(verdict, None)

    def _ok(self, rows: list[tuple[str, RankProgress]], failed: dict[str, str], stall: Stall, now: float) -> Verdict:
        """``--once`` on a job that moves: no artifact, no hook."""
        age = f"{stall.age_s:.1f} s ago" if stall.age_s is not None else "unknown"
        verdict = Verdict(
            kind="ok",
            job=self.config.job,
            conclusion=f"{stall.ranks} rank(s) progress: last step {stall.last_step}, {age} "
            f"(stall after {stall.stall_after_s:.0f} s)",
            detected_at=now,
            decided_at=now,
            ranks=[rank_row(node, r) for node, r in rows],
            evidence={"stall": {"age_s": stall.age_s, "stall_after_s": stall.stall_after_s}},
            nodes_unanswered=sorted(failed),
        )
        return verdict

    def _publish(self, verdict: Verdict, stacks: Stacks | None) -> str | None:
        path: str | None = None
        if self.config.save:
            try:
                path = write_verdict(verdict, stacks)
            except errors.DynprofError as exc:
                log.warning("dynprof watch: the verdict could not be saved: %s", exc.message)
        with self._lock:
            self.verdicts.append(verdict)
            self.counts[verdict.kind] = self.counts.get(verdict.kind, 0) + 1
        if self.on_verdict is not None:
            try:
                self.on_verdict(verdict, path)
            except Exception as exc:  # a face's printing or hook must not stop the watch
                log.warning("dynprof watch: on_verdict failed: %s", exc)
        return path

    def _maybe_sample(self, now: float) -> None:
        """Start each sample that is due, on its own thread: the progress polls (and the stall
        detection) go on while the ranks are sampled. None starts during a stall."""
        if self.episode is not None:
            return
        for scheduled in self._scheduled:
            every = scheduled.sampler.every_s
            if not every or now - scheduled.last_at < every:
                continue
            if scheduled.running():  # one at a time; the next is due an interval after this one started
                continue
            scheduled.last_at = now
            scheduled.thread = threading.Thread(
                target=self._sample, args=(scheduled.sampler,), name="dynprof-watch-sample", daemon=True
            )
            scheduled.thread.start()

    def _sample(self, sampler: Sampler) -> None:
        try:
            report: SignalReport | None = sampler.sample(self.config.job)
        except Exception as exc:  # a sampler says its failures; one that raises is logged, the watch goes on
            log.warning("dynprof watch: the %s sample failed: %s", sampler.name, exc)
            return
        if report is None:
            return
        with self._lock:
            self.signal_gauges[sampler.name] = {name: dict(values) for name, values in report.gauges().items()}
        if report.verdict is not None:
            self._publish(report.verdict, None)
        if self.on_sample is not None:
            try:
                self.on_sample(report)
            except Exception as exc:  # a face's printing must not stop the watch
                log.warning("dynprof watch: on_sample failed: %s", exc)


__all__ = ["Episode", "Tick", "WatchConfig", "WatchEngine"]
