"""One memory plan for a job's identical ranks: which ranks' measured steps agree, the
measurement their plan is made from (the highest peak's bytes, the slowest rank's times), each
rank's own figures, and how a rank that differs is said."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from collectors.memory.collect import MemoryPlanRequest, job_plans
from collectors.memory.plan import ranks as plan_ranks
from collectors.memory.plan.blocks import MAX_MODULES
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.predict import predict


def _model() -> torch.nn.Module:
    """An input layer, 4 blocks (Linear 32 -> 128, GELU, Linear 128 -> 32) and a head."""

    def block() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))

    return torch.nn.Sequential(
        torch.nn.Linear(32, 32),
        torch.nn.Sequential(*(block() for _ in range(4))),
        torch.nn.Linear(32, 1),
    )


def _measure(batch: int, seed: int = 0) -> dict[str, Any]:
    """A real measured step of :func:`_model` on ``batch`` rows."""
    import collectors.memory.plan.capture as capture

    torch.manual_seed(seed)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(batch, 32), torch.randn(batch, 1)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(capture, "compiled_code", lambda limit=3: [])  # as eager_process does
        # the tensors other tests of this worker still hold are not this rank's: its measured
        # bytes are the model's and the step's alone (a CI run counted another test's leftovers
        # in one rank and not the other)
        mp.setattr(capture, "live_tensors", lambda limit=MAX_MODULES: [])
        return capture.measure_step(model, opt, step)


@pytest.fixture(scope="module")
def steps() -> dict[str, dict[str, Any]]:
    """Two ranks' steps of the same shapes (other data), and one of twice the batch."""
    return {"r0": _measure(64), "r1": _measure(64, seed=1), "big": _measure(128)}


def _member(rank: int, doc: dict[str, Any]) -> plan_ranks.Member:
    return plan_ranks.member({"rank": rank, "pid": 100 + rank}, doc)


def _timed(doc: dict[str, Any], block_s: float) -> dict[str, Any]:
    """``doc`` with every block's forward and recompute taking ``block_s`` and the step ten times
    that: the measured times of a loaded machine made fixed, so that which rank is slower is known."""
    out = copy.deepcopy(doc)
    for b in out["blocks"]:
        b["forward_s"] = block_s
        if b.get("recompute_s") is not None:
            b["recompute_s"] = block_s
    out["step_s"] = 10 * block_s
    out["typical_step_s"] = None
    return out


def test_ranks_of_the_same_shapes_agree_and_their_plan_takes_the_slowest_rank_s_times(steps):
    # GIVEN two ranks' real measured steps of the same shapes, rank 1's blocks and step 3x slower
    r0, r1 = _member(0, _timed(steps["r0"], 0.001)), _member(1, _timed(steps["r1"], 0.003))

    # WHEN the job's ranks are grouped and their group's measurement merged
    groups = plan_ranks.group("j", [r1, r0])
    (g,) = groups
    doc, highest, slowest = plan_ranks.merged(g)

    # THEN they agree: one group, in rank order, differing from nothing
    assert plan_ranks.differences(r0.measurement, r1.measurement) == []
    assert g.ranks == [0, 1] and g.differs_from == [] and g.how == []
    # AND the merged measurement holds the same bytes and rank 1's times, block by block
    m = from_json(doc)
    assert slowest.rank == 1 and m.peak_bytes == highest.measurement.peak_bytes
    assert [b.name for b in m.blocks] == ["1.0", "1.1", "1.2", "1.3"]
    assert [b.seconds for b in m.blocks] == [b.seconds for b in r1.measurement.blocks]
    assert m.step_s == r1.measurement.step_s > r0.measurement.step_s
    # AND each rank's figures are its own: its measured peak, and the plan's peak on its own step
    figures = plan_ranks.rank_figures(g, ["1.0", "1.1"])
    assert [f["rank"] for f in figures] == [0, 1] and [f["pid"] for f in figures] == [100, 101]
    for f, mem in zip(figures, (r0, r1)):
        own = predict(mem.measurement, {"1.0", "1.1"})
        assert f["peak_bytes"] == mem.measurement.peak_bytes
        assert f["predicted_peak_bytes"] == own["predicted_peak_bytes"] < f["peak_bytes"]
        assert f["added_step_s"] == own["added_step_s"]


def test_a_rank_with_twice_the_batch_gets_its_own_group_that_says_how_it_differs(steps):
    # GIVEN ranks 0 and 2 of one shape and rank 1 with twice the batch
    r0, r1, r2 = _member(0, steps["r0"]), _member(1, steps["big"]), _member(2, steps["r1"])

    # WHEN grouped
    first, second = plan_ranks.group("j", [r2, r1, r0])

    # THEN ranks 0 and 2 are one group; rank 1 its own, saying its input and peak against rank 0's
    assert first.ranks == [0, 2] and first.how == []
    assert second.ranks == [1] and second.differs_from == [0, 2]
    assert second.how[0] == "first block input [128, 32] against [64, 32]"
    assert second.how[1].startswith("peak ") and "(+" in second.how[1], second.how
    assert len(second.how) <= plan_ranks.MAX_SAID


def test_blocks_and_figures_that_differ_are_named():
    # GIVEN a crafted measurement and copies with a block renamed, one block fewer, more gradients
    base = {
        "schema": 1,
        "device": "cuda:0",
        "blocks": [
            {"name": f"layers.{i}", "class": "Layer", "saved_bytes": 1000, "freeable_bytes": 800, "forward_s": 0.01}
            for i in range(3)
        ],
        "peak_bytes": 10_000,
        "peak_source": "allocator",
        "activation_bytes": 3000,
        "unrecomputable_activation_bytes": 600,
        "parameter_bytes": 2000,
        "gradient_bytes": 2000,
        "optimizer_state_bytes": 4000,
    }
    renamed, fewer, grads, other_gpu, bigger_block = (copy.deepcopy(base) for _ in range(5))
    renamed["blocks"][1]["name"] = "layers.1.attn"
    fewer["blocks"].pop()
    grads["gradient_bytes"] = 2200
    other_gpu["device"] = "cuda:3"
    bigger_block["blocks"][2]["freeable_bytes"] = 900

    # WHEN each is compared with the base
    def how(doc: dict[str, Any]) -> list[str]:
        return plan_ranks.differences(from_json(base), from_json(doc))

    # THEN each difference is said in words; another GPU of the same kind is no difference
    assert how(renamed) == ["block 1 is layers.1.attn (Layer) against layers.1 (Layer)"]
    assert how(fewer) == ["2 blocks against 3"]
    assert how(grads) == ["gradients 2.1 KiB against 2.0 KiB (+10 %)"]
    assert how(other_gpu) == []
    assert how(bigger_block) == ["layers.2's freeable bytes 900 B against 800 B (+12 %)"]


def test_job_plans_plan_each_job_of_two_ranks_once_and_leave_single_processes_alone(steps):
    # GIVEN job j's two agreeing ranks, job k's one rank, and a process of no job
    rows = [
        ({"pid": 11, "rank": 0, "job": "j"}, _timed(steps["r0"], 0.001)),
        ({"pid": 12, "rank": 1, "job": "j"}, _timed(steps["r1"], 0.002)),
        ({"pid": 21, "rank": 0, "job": "k"}, steps["big"]),
        ({"pid": 31, "rank": None, "job": None}, steps["big"]),
    ]
    notes: list[str] = []

    # WHEN the job plans are made for a budget of 80 % of the peak
    (entry,) = job_plans(MemoryPlanRequest(all=True, budget="80%"), rows, notes)

    # THEN job j has one plan for its ranks 0 and 1, timed by rank 1, with each rank's figures
    assert notes == []
    assert entry["job"] == "j" and entry["ranks"] == [0, 1] and entry["pids"] == [11, 12]
    assert entry["times_of"] == {"rank": 1, "pid": 12} and entry["differs_from"] == [] and entry["how"] == []
    plan = entry["plan"]
    assert plan["status"] == "fits" and plan["plan"]["modules"], plan
    assert plan["measurement"]["step_s"] == 0.02
    figures = entry["rank_figures"]
    assert [f["pid"] for f in figures] == [11, 12]
    assert all(f["predicted_peak_bytes"] <= plan["budget_bytes"] for f in figures), (figures, plan["budget_bytes"])


def test_ranks_are_said_in_runs():
    assert plan_ranks.ranks_text([0, 1, 2, 3, 5]) == "ranks 0-3, 5"
    assert plan_ranks.ranks_text([2]) == "rank 2"
    assert plan_ranks.ranks_text([1, None]) == "ranks 1, -"
