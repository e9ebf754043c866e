"""dynprof/job/budget.py: what one command keeps of all its nodes' answers together: each node
sure of its floor, the rest a pool drawn on while it lasts, what a dropped answer drew given
back; one node at a time, an equal share; the manifests held at once, to their own total."""

from __future__ import annotations

from dynprof.job.budget import TOTAL_MANIFEST_BYTES, AnswerBudget, ManifestBudget
from dynprof.nodes import Node


def test_a_big_node_may_draw_past_its_equal_share_while_the_pool_lasts():
    # GIVEN a total of 1000 bytes for 4 nodes: each is sure of 125, and 500 are a pool
    budget = AnswerBudget(4, total_bytes=1000, total_values=1000)
    small, big, late = budget.share(), budget.share(), budget.share()
    # WHEN a small node keeps 100 and a big one 600
    assert small.take_bytes(100)
    assert big.take_bytes(600)
    # THEN a third may still keep its floor, but not more than the pool has left
    assert late.take_bytes(125) and not late.take_bytes(100)
    # and what a dropped answer drew goes back to the pool
    big.release()
    assert late.take_bytes(100)


def test_requests_for_one_node_at_a_time_keep_an_equal_share():
    # GIVEN requests made one node at a time for a caller holding 8 answers together
    budget = AnswerBudget(8, total_bytes=800, total_values=80, pooled=False)
    share = budget.share()
    # THEN each may keep 1/8 of the total, and no more
    assert share.take_bytes(100) and not share.take_bytes(1)
    assert share.take_values(10) and not share.take_values(1)


def test_the_manifests_held_at_once_share_their_own_total_and_a_cut_says_so():
    budget = ManifestBudget(4)
    share = budget.share()
    assert share.take_bytes(TOTAL_MANIFEST_BYTES // 8)
    reason = budget.reason("bytes", Node("n1", 8787))
    assert reason.startswith("cut: the artifact manifests this command holds at once")
    share.done()


def test_an_answer_read_is_kept_and_one_that_failed_gives_back_what_it_drew():
    budget = AnswerBudget(2, total_bytes=1000, total_values=100)
    kept, failed = budget.share(), budget.share()
    with kept.holding():
        assert kept.take_bytes(700) and kept.take_values(10)
    assert (budget.held_bytes, budget.held_values) == (700, 10)
    try:
        with failed.holding():
            assert failed.take_bytes(300)
            raise ValueError("not JSON")
    except ValueError:
        pass
    # nothing of the failed answer is counted, and the pool it drew on is whole again
    assert (budget.held_bytes, budget.held_values) == (700, 10)
    assert (failed.bytes, failed.values) == (0, 0)
    kept.done()
    assert (budget.held_bytes, budget.held_values) == (0, 0)
