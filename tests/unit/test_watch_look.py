"""The watch's look at a stalled job, in its named parts (dynprof.watch.look): the two samples and
the progress read between them, which ranks are read natively, the decision, the evidence of a
hang and the verdict's frame. The engine's tests (test_watch_engine.py) run the whole loop."""

from __future__ import annotations

from typing import Any

from collectors.stacks import Source, Stacks, merge
from dynprof.watch import look
from dynprof.watch.classify import MOVING_CPU_S
from dynprof.watch.model import Culprit
from dynprof.watch.sources import StacksRead
from dynprof.watch.stall import Stall
from tests.unit.test_watch_detect import ALL_REDUCE, NOW, py, row, stacks

STALL = Stall(stalled=True, age_s=80.0, stall_after_s=60.0, first_step=False, last_step=100, ranks=2)
LOOP = (py("load_batch", "/job/data.py", 7), py("main", "/job/train.py", 99))


class TwoRanks:
    """Two ranks on node n: rank 0 waits in all_reduce, rank 1 parked in its data loading."""

    def __init__(self) -> None:
        self.asked: list[dict[str, list[int]]] = []

    def stacks(self, job: str, native: dict[str, list[int]]) -> StacksRead:
        self.asked.append(native)
        read = Stacks([stacks(0, *ALL_REDUCE), stacks(1, *LOOP)])
        return StacksRead(merge([Source_(read, "n")], by_host=True))


def Source_(read: Stacks, node: str) -> Source:
    from collectors.stacks import Source as StacksSource

    return StacksSource(read, node=node)


def _rows() -> list[tuple[str, Any]]:
    return [("n", row(0)), ("n", row(1))]


def test_a_look_reads_twice_and_natively_the_rank_that_does_not_wait_with_the_others():
    # GIVEN a job whose rank 0 waits in a collective and rank 1 does not
    source = TwoRanks()
    slept: list[float] = []
    polled: list[bool] = []

    def poll(fresh: bool) -> Any:
        polled.append(fresh)
        return [("n", row(0, t=NOW + 3.0)), ("n", row(1, t=NOW + 3.0))], {}

    # WHEN it is looked at
    sample = look.take(source, "j", _rows(), [], 3.0, lambda: NOW, slept.append, poll)
    # THEN the first sample reads plainly, the look waits, the progress is read fresh, and the
    # second sample reads rank 1 natively (it may be the culprit)
    assert sample is not None
    assert source.asked == [{}, {"n": [1001]}] and slept == [3.0] and polled == [True]
    assert sample.native == {"n": [1001]} and [lk.before.rank for lk in sample.looks] == [0, 1]
    assert sample.started_at == sample.looked_at == NOW


def test_a_look_at_a_job_whose_ranks_all_exited_decides_nothing():
    def poll(fresh: bool) -> Any:
        return [("n", row(r, agent="gone", process_state="gone")) for r in (0, 1)], {}

    assert look.take(TwoRanks(), "j", _rows(), [], 0.0, lambda: NOW, lambda s: None, poll) is None


def test_native_reads_skip_stopped_ranks_and_take_the_unresponsive():
    rows = [("n", row(0, agent="unresponsive")), ("n", row(1, process_state="stopped")), ("m", row(2))]
    first = merge([Source(Stacks([stacks(2, *LOOP)]), node="m")], by_host=True)
    # no rank waits with others, and no GPU is behind: only the unresponsive agent is read natively
    assert look.native_reads(rows, first, {}, 3.0) == {"n": [1000]}


def test_the_decision_times_the_waiting_ranks_across_looks():
    source = TwoRanks()
    sample = look.take(source, "j", _rows(), [], 0.0, lambda: NOW, lambda s: None, lambda fresh: (_after_rows(), {}))
    assert sample is not None
    asked: list[tuple[Any, float]] = []

    def waiting_for(key: Any, now: float) -> float:
        asked.append((key, now))
        return 1.0

    decision, waited = look.decide(sample, STALL, 30.0, MOVING_CPU_S, waiting_for)
    # the waiting rank's place is timed from the look's time; rank 1 parked is the culprit
    assert waited == 1.0 and asked and asked[0][1] == NOW
    assert decision.kind == "hang" and [c.rank for c in decision.culprits] == [1]


def _after_rows() -> list[tuple[str, Any]]:
    return [("n", row(0, t=NOW + 3.0)), ("n", row(1, t=NOW + 3.0))]


def test_a_hangs_evidence_reads_the_flight_recorder_and_the_culprits_nodes_health():
    sample = look.take(
        TwoRanks(), "j", _rows(), [], 0.0, lambda: NOW, lambda s: None, lambda fresh: (_after_rows(), {})
    )
    assert sample is not None
    decision, _ = look.decide(sample, STALL, 0.0, MOVING_CPU_S, lambda key, now: 100.0)
    checked: list[list[str]] = []

    def health(nodes: list[str]) -> dict[str, Any]:
        checked.append(nodes)
        return {n: {"verdict": "healthy"} for n in nodes}

    again = []
    decided, got = look.hang_evidence(
        sample,
        _rows(),
        decision,
        STALL,
        lambda fr: again.append(fr) or decision,
        lambda unanswered: ({"process_groups": []}, None),
        health,
    )
    assert decided is decision and again == [{"process_groups": []}]
    assert got.fr_analysis == {"process_groups": []} and got.health == {"n": {"verdict": "healthy"}}
    assert checked == [["n"]]
    # without the healthcheck, none is read
    _, none = look.hang_evidence(
        sample, _rows(), decision, STALL, lambda fr: decision, lambda unanswered: (None, "off"), None
    )
    assert none.health is None and none.fr_note == "off"


def test_a_verdicts_key_is_its_kind_and_culprits():
    class D:
        kind = "hang"
        culprits = [Culprit(rank=None, host="b", where="", why=""), Culprit(rank=3, host="a", where="", why="")]

    assert look.verdict_key(D()) == ("hang", (("a", 3), ("b", -1)))  # type: ignore[arg-type]


def test_exited_and_gpu_behind_read_the_progress_row():
    assert look.exited(None) and look.exited(row(0, agent="gone", process_state="zombie"))
    assert not look.exited(row(0)) and not look.exited(row(0, process_state="gone"))  # an agent that answers
    assert not look.gpu_behind(None, 3.0) and not look.gpu_behind(row(0), 3.0)
    assert look.in_python_collective(stacks(0, *ALL_REDUCE)) and not look.in_python_collective(stacks(1, *LOOP))
    assert not look.in_python_collective(None)
