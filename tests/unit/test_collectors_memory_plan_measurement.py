"""The memory plan's measurement: a measured step against hand-computed saved-tensor bytes, its
clean-up, what ends it early, its decoder against hostile documents. (The predicted peak and the
solver against brute force: test_collectors_memory_plan_predict.py, _solve.py.)"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from collectors.memory.advice import advise
from collectors.memory.plan.blocks import MeasurementRefused, find_blocks, find_models, live_tensors
from collectors.memory.plan.capture import StepMeasurement, measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.meter import LiveTensorBytes
from collectors.memory.plan.predict import margin_bytes, predict
from collectors.memory.plan.solve import make_plan
from dynprof.errors import ArtifactError
from tests.support.oom import activations_oom
from tests.support.plan_models import checkpoint_modules

pytestmark = pytest.mark.usefixtures("eager_process")

F32 = 4


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


def test_a_block_is_never_free_to_recompute_when_the_meters_cost_is_overestimated(monkeypatch):
    # GIVEN a measurement whose calibration says each operator's trip through the meter costs far
    # more than it does (a loaded machine: the calibration rounds and the step run at other speeds)
    from collectors.memory.plan import capture as plan_capture

    def overestimated(self) -> None:
        self._per_op_s = 1.0

    monkeypatch.setattr(plan_capture.StepMeasurement, "_calibrate", overestimated)
    torch.manual_seed(0)
    model = MLP(4, 16)
    opt = torch.optim.Adam(model.parameters())
    step = train_step(model, opt, torch.randn(3, 4))
    step()
    # WHEN one step is measured
    gc.collect()  # the garbage of earlier tests is not this step's
    doc = measure_step(model, opt, step)
    # THEN every block still has a forward and a recompute time above 0 (at least a share of what
    # it took measured), never 0: a plan would take it as free to recompute
    for b in doc["blocks"]:
        assert b["forward_s"] > 0 and b["recompute_s"] > 0, b


def test_the_measurement_counts_what_each_block_saves_by_hand():
    # GIVEN an MLP of 3 blocks Linear(4,16) -> ReLU -> Linear(16,4), a head, batch 3, float32
    torch.manual_seed(0)
    batch, d, h = 3, 4, 16
    model = MLP(d, h)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(batch, d)
    step = train_step(model, opt, x)
    step()  # Adam's state exists

    # WHEN one step is measured
    gc.collect()  # the garbage of earlier tests is not this step's
    doc = measure_step(model, opt, step)

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
    # AND its peak is the step's live tensor bytes: the same step, run again under a meter alone
    with LiveTensorBytes(known(model, opt)) as live:
        step()
    assert doc["peak_bytes"] == live.peak > 4 * params
    assert doc["untracked_bytes"] == 0 and doc["drift_bytes"] == 0 and doc["timeline"]


def known(model, opt):
    """What lives before a step: parameters, gradients, optimizer state, and every other tensor
    Python holds (the batch, the last step's outputs), as the measurement counts them."""
    gc.collect()
    out = [*model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for per in opt.state.values():
        out += [v for v in per.values() if isinstance(v, torch.Tensor)]
    return out + live_tensors()


def checkpointed(model, names):
    """The torch.utils.checkpoint recipe, as the plan prints it (non-reentrant)."""
    checkpoint_modules(model, names)
    return model


def hook_state(model):
    return (
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        torch._C._autograd._top_saved_tensors_default_hooks(False),
        _get_current_dispatch_mode(),
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

    # THEN no forward hook, no saved-tensor hook, no dispatch mode and no autograd setting
    # differs from before
    assert after_ok == before
    assert hook_state(model) == before
    assert before[1] is None and before[2] is None


def test_hooks_stopped_from_another_thread_are_popped_by_the_training_thread_after_its_next_step():
    # GIVEN a measurement started on this (the training) thread, its step run
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_state(model)
    m = StepMeasurement([model], [opt])
    m.start()
    model(torch.randn(2, 4)).sum().backward()

    # WHEN another thread stops it (the agent's own thread, at its exit)
    other = threading.Thread(target=m.stop)
    other.start()
    other.join()
    left = hook_state(model)
    opt.step()

    # THEN its dispatch mode and saved-tensor hooks stay on this thread, passing things through,
    # until this thread's next optimizer step pops them
    assert left[2] is not None and left[1] is not None and left[0] == before[0]
    assert hook_state(model) == before
    assert m.error == ""


def test_the_plan_meets_the_budget_or_says_it_cannot():
    # GIVEN a measured step of an MLP of 6 blocks (batch 32, hidden 64)
    torch.manual_seed(0)
    model = MLP(8, 64, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train_step(model, opt, torch.randn(32, 8))
    step()
    gc.collect()  # the garbage of earlier tests is not this step's
    m = from_json(measure_step(model, opt, step))
    for b in m.blocks:
        b.forward_s = b.recompute_s = 0.001  # alike blocks, alike times (measured ones jitter on a busy machine)
    block = 32 * 64 * F32

    # WHEN asked for a budget two blocks' worth under the peak, under its floor, and at the peak
    budget = m.peak_bytes - 2 * block
    two = make_plan(m, budget=budget)
    floor = make_plan(m, budget=two["floor_bytes"] - 1)
    easy = make_plan(m, budget=m.peak_bytes)

    # THEN blocks are chosen whose predicted peak is under the budget less the margin, the
    # runners-up too, each as predict() says
    assert two["status"] == "fits" and two["margin_bytes"] == margin_bytes(m) > 0
    for p in [two["plan"], *two["runners_up"]]:
        assert p["predicted_peak_bytes"] <= budget - two["margin_bytes"], p
        assert predict(m, set(p["modules"]))["predicted_peak_bytes"] == p["predicted_peak_bytes"]
    assert len(two["runners_up"]) == 3
    assert all("blocks." in n for n in two["plan"]["modules"])
    assert "torch.utils.checkpoint" in two["apply"] and "check_fn" in two["apply"]["fsdp checkpoint_wrapper"]
    # AND checkpointed as the recipe says, the real step's peak is the predicted one, under the budget
    checkpointed(model, set(two["plan"]["modules"]))
    step()
    with LiveTensorBytes(known(model, opt)) as live:
        step()
    assert live.peak == two["plan"]["predicted_peak_bytes"] <= budget
    # AND a budget under the floor (the least any set reaches) is answered with the options beyond
    assert floor["status"] == "unreachable" and floor["plan"] is None
    assert floor["floor_bytes"] < budget
    options = " ".join(o["option"] for o in floor["beyond"])
    assert "ZeRO" in options and "offload" in options and "micro-batch" in options
    # AND a budget at the peak needs nothing
    assert easy["status"] == "fits-already" and easy["plan"]["modules"] == []


def test_a_measurement_of_the_first_schema_is_planned_by_the_rule_it_was_made_for():
    # GIVEN a schema-1 measurement (no timeline): 4 blocks of 80 freeable bytes, a CPU peak
    block = {"class": "Block", "saved_bytes": 100, "freeable_bytes": 80, "forward_s": 0.01, "parameter_bytes": 10}
    doc = {
        "schema": 1,
        "device": "cpu",
        "blocks": [{"name": f"blocks.{i}", **block} for i in range(4)],
        "peak_bytes": 1000,
        "peak_source": "parameters + gradients + optimizer state + saved-tensor bytes (CPU)",
        "activation_bytes": 400,
        "unrecomputable_activation_bytes": 80,
        "parameter_bytes": 100,
        "gradient_bytes": 100,
        "optimizer_state_bytes": 200,
        "peak_includes_gradients": True,
    }

    # WHEN it is read and sets of blocks are predicted
    m = from_json(doc)

    def peak(*blocks):
        return predict(m, {f"blocks.{i}" for i in blocks})["predicted_peak_bytes"]

    # THEN the peak comes down by min(F(S), min over k of F(S before k) + the blocks after k)
    assert peak() == 1000
    assert peak(0, 1) == 1000 - 160
    assert peak(3) == 1000  # the last block recomputes first, with all its bytes back
    assert peak(2, 3) == 1000 - 80
    assert peak(0, 1, 2, 3) == 1000 - 240


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


@pytest.mark.parametrize("form", ["root in place", "block in place", "block forward"])
def test_every_form_of_a_module_compiled_in_place_is_refused(form):
    # GIVEN a model compiled in place (model.compile(), or per block: the regional recipe), or a
    # block whose forward is a compiled function; none of them run yet
    model = MLP()
    if form == "root in place":
        model.compile()
    elif form == "block in place":
        for block in model.blocks:
            block.compile()
    else:
        model.blocks[1].forward = torch.compile(model.blocks[1].forward)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    # WHEN a step is measured THEN the measurement refuses before any hook, naming torch.compile
    with pytest.raises(MeasurementRefused, match=r"compiled with torch\.compile") as refused:
        measure_step(model, opt, lambda: None)
    assert "TORCHDYNAMO_DISABLE=1" in refused.value.help
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_a_process_that_ran_compiled_code_is_refused_naming_the_code(monkeypatch, eager_process):
    # GIVEN an eager model in a process where torch.compile compiled a function (its loss, say)
    import collectors.memory.plan.capture as capture

    monkeypatch.setattr(capture, "compiled_code", eager_process)  # dynamo's own record, here
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def compiled_loss_of_this_test(y):
        return (y * y).mean()

    compiled_loss_of_this_test(torch.randn(3))

    # WHEN a step is measured THEN it refuses, naming the compiled code and where it is
    assert any("compiled_loss_of_this_test" in c for c in eager_process(limit=100))
    with pytest.raises(MeasurementRefused, match=r"torch\.compile has compiled code in this process"):
        measure_step(model, opt, lambda: None)


def test_a_forward_without_grad_ends_the_measurement_at_once_and_says_why():
    # GIVEN a measurement armed on a training thread (the job's last step is behind it)
    from collectors.memory.plan.capture import StepMeasurement

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ended: list[str] = []
    m = StepMeasurement([model], [opt], on_end=ended.append)
    m.start()
    # WHEN the job evaluates (forwards without grad) instead of training
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(2, 4))
    # THEN the first forward ended it: no hook, no mode, no saved-tensor hooks left, and why
    assert len(ended) == 1 and "a forward ran without grad" in ended[0]
    assert all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in model.modules())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    # AND its references to the job's model and optimizer are gone
    assert m.roots == [] and m.optimizers == [] and all(b is None for _n, b in m.blocks)


def test_a_reentrant_checkpoint_forward_without_grad_is_part_of_the_step():
    # GIVEN a job whose step checkpoints a block the reentrant way (its forward runs without grad)
    import torch.utils.checkpoint as cp

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4, requires_grad=True)

    def step():
        h = cp.checkpoint(model.blocks[0], x, use_reentrant=True)
        for block in model.blocks[1:]:
            h = block(h)
        h.sum().backward()
        opt.step()

    # WHEN measured THEN the step is measured whole (not ended as an evaluation)
    gc.collect()  # the garbage of earlier tests is not this step's
    doc = measure_step(model, opt, step)
    assert not doc["error"], doc["error"]
    assert all(b["calls"] >= 1 for b in doc["blocks"][1:])


def test_a_step_past_its_time_limit_ends_at_the_next_block_forward():
    # GIVEN a measurement whose step may last 0 s (any forward after the start is past it)
    from collectors.memory.plan.capture import StepMeasurement

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ended: list[str] = []
    m = StepMeasurement([model], [opt], time_limit_s=0.0, on_end=ended.append)
    m.start()
    # WHEN a training forward runs
    model(torch.randn(2, 4)).sum().backward()
    # THEN the measurement ended there, and says it was the time
    assert len(ended) == 1 and "no optimizer step within 0 s" in ended[0]
    assert all(not mod._forward_pre_hooks and not mod._forward_hooks for mod in model.modules())


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
    assert plan["candidates"] == 2 and "blocks.0" not in (plan["plan"] or {}).get("modules", [])


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema=3), "schema"),
        (lambda d: d.update(timeline=[[1, 2, 3]]), "timeline"),
        (lambda d: d.update(timeline=[[0, -1]]), "timeline"),
        (lambda d: d.update(timeline=[[0, 0]] * 30_000), "timeline"),
        (lambda d: d["blocks"][0].update(late_freeable=[[0, "1"]]), "late_freeable"),
        (lambda d: d["blocks"][0].update(late_freeable=[[0, 1]] * 65), "late_freeable"),
        (lambda d: d["blocks"][0].update(kept_inputs=[[0, 1]]), "kept_inputs"),
        (lambda d: d["blocks"][0].update(kept_inputs=[[0, -1, 0]]), "kept_inputs"),
        (lambda d: d["blocks"][0].update(kept_inputs=[[0, 1, 0]] * 65), "kept_inputs"),
        (lambda d: d["blocks"][0].update(backward_start=-3), "backward_start"),
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


def advice_of_activations_oom(measurement, limit):
    """The advice on the real OOM artifact made one of activations (tests/support/oom.py), by rule."""
    return {a["rule"]: a for a in advise(activations_oom(measurement, limit))}


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
    with_plan = advice_of_activations_oom(doc, limit)["activations"]["advice"]
    without = advice_of_activations_oom(None, limit)["activations"]["advice"]

    # THEN the first names the plan's modules and its predicted peak; the second says how to get one
    assert f"checkpoint {len(expected['modules'])} module(s)" in with_plan
    assert all(name in with_plan for name in expected["modules"])
    assert "dynprof memory plan --json" in with_plan
    assert "no step of this process was measured" in without and "dynprof memory plan --pid PID" in without
