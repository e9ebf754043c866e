"""The memory plan: its solver against brute force, its measurement against hand-computed
saved-tensor bytes, its clean-up, its decoder against hostile documents."""

from __future__ import annotations

import copy
import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from collectors.memory.advice import advise
from collectors.memory.plan import from_json, make_plan, predict, solve
from collectors.memory.plan_capture import MeasurementRefused, find_blocks, find_models, measure_step
from dynprof.errors import ArtifactError

F32 = 4


def brute_force(items, need, relief):
    """Every subset's cost whose peak comes down by ``need``, by the rule written out again:
    at backward's start the chosen blocks are gone; at each chosen block's recompute, the
    chosen ones before it are still gone and the blocks after it are done with."""
    out = []
    useful = [i for i, (b, _) in enumerate(items) if b > 0]  # a block that frees nothing is never worth it
    for r in range(len(useful) + 1):
        for subset in itertools.combinations(useful, r):
            at_start = sum(items[i][0] for i in subset)
            at_recompute = [sum(items[j][0] for j in subset if j < k) + relief[k] for k in subset]
            if min([at_start, *at_recompute]) >= need:
                out.append(sum(items[i][1] for i in subset))
    return sorted(out)


def test_the_solver_matches_brute_force_on_random_instances():
    # GIVEN 400 random instances of up to 9 blocks (bytes, seconds, relief) and a need
    rng = random.Random(28)
    compared = 0
    for _ in range(400):
        n = rng.randint(1, 9)
        items = [(rng.randint(0, 60), round(rng.uniform(0.01, 3.0), 3)) for _ in range(n)]
        relief = [rng.randint(-20, 200) for _ in range(n)]
        need = rng.randint(1, 250)
        # WHEN the DP solves it
        got, exact = solve(items, need, relief)
        want = brute_force(items, need, relief)
        # THEN it is exact, finds the cheapest set and the same runners-up costs, or says none
        assert exact
        if not want:
            assert got == []
            continue
        compared += 1
        assert [round(c.cost, 9) for c in got] == [round(c, 9) for c in want[: len(got)]]
        assert len(got) == min(4, len(want))
        for c in got:
            assert c.saved >= need
            assert c.freed == sum(items[i][0] for i in c.blocks)
    assert compared > 100


class Block(torch.nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, h)
        self.r = torch.nn.ReLU()
        self.b = torch.nn.Linear(h, d)

    def forward(self, x):
        return self.b(self.r(self.a(x)))


class MLP(torch.nn.Module):
    def __init__(self, d: int = 4, h: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(d, h) for _ in range(n)])
        self.head = torch.nn.Linear(d, 2)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def train_step(model, opt, x):
    def step():
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def test_the_measurement_counts_what_each_block_saves_by_hand():
    # GIVEN an MLP of 3 blocks Linear(4,16) -> ReLU -> Linear(16,4), a head, batch 3, float32
    torch.manual_seed(0)
    batch, d, h = 3, 4, 16
    model = MLP(d, h)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(batch, d)

    # WHEN one step is measured
    doc = measure_step(model, opt, train_step(model, opt, x))

    # THEN each block saved its input (3x4) and the ReLU's output (3x16, read again by the
    # second Linear: one storage, counted once); only the ReLU's output is freeable (the input
    # stays, a checkpoint keeps it), and parameters are not activations
    assert [b["name"] for b in doc["blocks"]] == ["blocks.0", "blocks.1", "blocks.2"]
    for b in doc["blocks"]:
        assert b["saved_bytes"] == batch * (d + h) * F32
        assert b["freeable_bytes"] == batch * h * F32
        assert b["calls"] == 1
    # the rest: 3 block inputs, the head's input, square's input (the head's 3x2 output)
    assert doc["unrecomputable_activation_bytes"] == (3 * batch * d + batch * d + batch * 2) * F32
    assert doc["activation_bytes"] == doc["unrecomputable_activation_bytes"] + 3 * batch * h * F32
    params = sum(p.numel() for p in model.parameters()) * F32
    assert doc["parameter_bytes"] == params
    assert doc["gradient_bytes"] == params
    assert doc["optimizer_state_bytes"] == 2 * params  # Adam's exp_avg and exp_avg_sq
    assert doc["peak_bytes"] == 4 * params + doc["activation_bytes"]


def hook_state(model):
    return (
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        torch._C._autograd._top_saved_tensors_default_hooks(False),
        torch.is_grad_enabled(),
        torch.are_deterministic_algorithms_enabled(),
    )


def test_no_hook_mode_or_setting_is_left_after_the_step_even_when_it_raises():
    # GIVEN a model, and its hooks and autograd state before
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_state(model)
    x = torch.randn(2, 4)

    # WHEN a step is measured, and another whose step raises in the middle of backward
    measure_step(model, opt, train_step(model, opt, x))
    after_ok = hook_state(model)

    def failing():
        model(x).sum().backward()
        raise RuntimeError("the job's own failure")

    with pytest.raises(RuntimeError, match="the job's own failure"):
        measure_step(model, opt, failing)

    # THEN no forward hook, no saved-tensor hook and no autograd setting differs from before
    assert after_ok == before
    assert hook_state(model) == before
    assert before[1] is None


def test_the_plan_meets_the_budget_or_says_it_cannot():
    # GIVEN a measured MLP step
    model = MLP(8, 64, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = from_json(measure_step(model, opt, train_step(model, opt, torch.randn(32, 8))))
    for b in m.blocks:
        b.forward_s = 0.001  # alike blocks, alike times (the measured ones jitter on a busy machine)
    block = 32 * 64 * F32

    # WHEN asked to save two blocks' worth, for a budget under the floor, and for the peak itself
    two = make_plan(m, save=2 * block)
    floor = make_plan(m, budget=m.peak_bytes - 6 * block)
    easy = make_plan(m, budget=m.peak_bytes)

    # THEN two blocks do it, any two but the last: each recomputes when the blocks after it are
    # done with, while the last block's recompute would bring its bytes back at backward's start
    assert two["status"] == "fits"
    for p in [two["plan"], *two["runners_up"]]:
        assert len(p["modules"]) == 2 and "blocks.5" not in p["modules"], p
        assert p["predicted_peak_bytes"] == m.peak_bytes - 2 * block
    assert len(two["runners_up"]) == 3
    assert predict(m, set(two["plan"]["modules"]))["predicted_peak_bytes"] == two["plan"]["predicted_peak_bytes"]
    assert all("blocks." in n for n in two["plan"]["modules"])
    assert "torch.utils.checkpoint" in two["apply"] and "check_fn" in two["apply"]["fsdp checkpoint_wrapper"]
    # AND freeing all six blocks cannot go under the floor (peak - 5 blocks): the answer says so
    assert floor["status"] == "unreachable" and floor["plan"] is None
    assert floor["floor_bytes"] == m.peak_bytes - 5 * block
    options = " ".join(o["option"] for o in floor["beyond"])
    assert "ZeRO" in options and "offload" in options and "micro-batch" in options
    # AND a budget at the peak needs nothing
    assert easy["status"] == "fits-already" and easy["plan"]["modules"] == []


def test_the_models_are_found_from_the_optimizers_parameters():
    # GIVEN a model inside a wrapper, and another model the optimizer does not step
    inner = MLP()
    wrapper = torch.nn.Sequential(inner)
    other = MLP()  # noqa: F841 (alive, not stepped)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)

    # WHEN the models are looked up
    roots = find_models([opt])

    # THEN the outermost module holding those parameters is found, with its blocks
    assert roots == [wrapper]
    assert [n for n, _ in find_blocks(roots)] == ["0.blocks.0", "0.blocks.1", "0.blocks.2"]


def test_a_compiled_model_is_refused_with_the_reason():
    # GIVEN a model wrapped by torch.compile (not run: wrapping is enough)
    model = MLP()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    # WHEN a step is measured THEN the measurement refuses, naming torch.compile
    with pytest.raises(MeasurementRefused, match=r"torch\.compile"):
        measure_step(compiled, opt, lambda: None)


def test_an_already_checkpointed_block_is_left_out_and_said():
    # GIVEN an MLP whose first block says it is checkpointed (as Hugging Face marks its layers)
    model = MLP()
    model.blocks[0].gradient_checkpointing = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    # WHEN measured and planned
    doc = measure_step(model, opt, train_step(model, opt, torch.randn(3, 4)))
    plan = make_plan(from_json(doc), save=1)

    # THEN that block is marked and never chosen, and a note says so
    assert {b["name"]: b["checkpointed"] for b in doc["blocks"]} == {
        "blocks.0": True,
        "blocks.1": False,
        "blocks.2": False,
    }
    assert any("blocks.0 is already checkpointed" in n for n in doc["notes"])
    assert "blocks.0" not in plan["plan"]["modules"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema=2), "schema"),
        (lambda d: d.update(peak_bytes=-1), "peak_bytes"),
        (lambda d: d.update(peak_bytes="1"), "peak_bytes"),
        (lambda d: d.update(blocks="x"), "blocks"),
        (lambda d: d.update(blocks=[{}] * 5000), "blocks"),
        (lambda d: d["blocks"][0].update(forward_s=float("nan")), "forward_s"),
        (lambda d: d["blocks"][0].update(freeable_bytes=True), "freeable_bytes"),
        (lambda d: d.update(notes=[1]), "notes"),
    ],
)
def test_the_decoder_refuses_hostile_measurements(mutate, message):
    # GIVEN a real measurement's document, spoiled one way
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step(model, opt, train_step(model, opt, torch.randn(3, 4)))
    mutate(doc)
    # WHEN decoded THEN it is an ArtifactError naming the field
    with pytest.raises(ArtifactError, match=message):
        from_json(doc)


OOM_SUMMARY = Path(__file__).resolve().parent.parent / "data" / "memory_oom_artifact" / "summary.json"


def activations_oom(measurement, limit):
    """The real OOM artifact's summary, with an attribution where activations are the largest
    part, the device's memory ``limit`` and (if any) the last measured step."""
    s = copy.deepcopy(json.loads(OOM_SUMMARY.read_text()))
    s["attribution"] = {
        "optimizers": 1,
        "parameters_bytes": 0,
        "gradients_bytes": 0,
        "optimizer_state_bytes": 0,
        "frame_tensors_bytes": 0,
        "frame_tensors": [],
    }
    s["failing_allocation"] = {**(s.get("failing_allocation") or {}), "device_limit_bytes": limit}
    if measurement is not None:
        s["memory_plan_measurement"] = measurement
    return {a["rule"]: a for a in advise(s)}


def test_an_oom_dominated_by_activations_carries_the_last_plan_or_says_there_is_none():
    # GIVEN a measured step, and a device whose 90 % lies two blocks under that step's peak
    model = MLP(8, 64, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step(model, opt, train_step(model, opt, torch.randn(32, 8)))
    m = from_json(doc)
    budget = m.peak_bytes - 2 * 32 * 64 * F32
    limit = budget * 10 // 9 + 1
    expected = make_plan(m, budget=limit * 9 // 10)["plan"]

    # WHEN an OOM's advice is made with that measurement, and without one
    with_plan = activations_oom(doc, limit)["activations"]["advice"]
    without = activations_oom(None, limit)["activations"]["advice"]

    # THEN the first names the plan's modules and its predicted peak; the second says how to get one
    assert f"checkpoint {len(expected['modules'])} module(s)" in with_plan
    assert all(name in with_plan for name in expected["modules"])
    assert "dynprof memory plan --json" in with_plan
    assert "no step of this process was measured" in without and "dynprof memory plan --pid PID" in without
