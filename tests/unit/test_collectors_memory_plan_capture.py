"""collectors.memory.plan_capture: one training step measured for the memory plan, in-process
on CPU tensors: the blocks found in a model, what refuses a measurement, the live-bytes meter,
the hooks' clean-up and the measurement's document.

(The measurement's arithmetic against hand-computed bytes and its clean-up when the step
raises or is stopped from another thread: test_collectors_memory_plan.py; the predicted peak
against the real one: test_memory_plan_prediction.py, test_memory_plan_kept_inputs.py.)
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from collectors.memory import plan_capture as pc
from collectors.memory.plan_capture import (
    SCHEMA,
    LiveTensorBytes,
    MeasurementRefused,
    StepMeasurement,
    find_blocks,
    find_models,
    measure_step,
)

pytestmark = pytest.mark.usefixtures("eager_process")

F32 = 4


class Block(torch.nn.Module):
    def __init__(self, d: int = 4, h: int = 8) -> None:
        super().__init__()
        self.a = torch.nn.Linear(d, h)
        self.b = torch.nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Stack(torch.nn.Module):
    """Blocks in a ModuleList, run in ``order`` (each index as often as it appears)."""

    def __init__(self, n: int = 3, order: list[int] | None = None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block() for _ in range(n)])
        self.head = torch.nn.Linear(4, 2)
        self.order = order if order is not None else list(range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.layers[i](x)
        return self.head(x)


def step_of(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> Any:
    def step() -> None:
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    return step


def names(blocks: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in blocks]


# -- the blocks ------------------------------------------------------------------------------------
def test_the_blocks_are_the_children_of_a_repeated_container():
    assert names(find_blocks([Stack(3)])) == ["layers.0", "layers.1", "layers.2"]


def test_a_stage_of_blocks_is_replaced_by_the_blocks_inside_it():
    # a ResNet's shape: stages (Sequential) of bottlenecks; a stage of one bottleneck gives it
    model = torch.nn.Module()
    model.stem = torch.nn.Linear(4, 4)
    model.stages = torch.nn.Sequential(
        torch.nn.Sequential(Block(), Block()),
        torch.nn.Sequential(Block()),
        torch.nn.Sequential(Block(), Block(), Block()),
    )
    assert names(find_blocks([model])) == [
        "stages.0.0",
        "stages.0.1",
        "stages.1.0",
        "stages.2.0",
        "stages.2.1",
        "stages.2.2",
    ]


def test_without_a_repeated_container_the_children_with_parameters_are_the_blocks():
    model = torch.nn.Module()
    model.encoder = Block()
    model.act = torch.nn.ReLU()  # no parameters: not a block
    model.decoder = torch.nn.Linear(4, 4)
    assert names(find_blocks([model])) == ["encoder", "decoder"]


def test_children_without_submodules_or_parameters_do_not_make_a_container_repeated():
    model = torch.nn.Module()
    # Linears have no submodules, ReLUs no parameters: not blocks, so nothing here is repeated
    model.seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    model.one = torch.nn.ModuleList([Block()])  # one block is not a repeated container
    assert names(find_blocks([model])) == ["seq", "one"]


def test_several_models_are_named_apart_and_a_shared_block_is_found_once():
    shared = Block()
    a = Stack(2)
    a.layers.append(shared)
    b = Stack(2)
    b.layers.append(shared)
    assert names(find_blocks([a, b])) == [
        "Stack:layers.0",
        "Stack:layers.1",
        "Stack:layers.2",
        "Stack#2:layers.0",
        "Stack#2:layers.1",
    ]


def test_the_blocks_are_bounded(monkeypatch):
    monkeypatch.setattr(pc, "MAX_BLOCKS", 2)
    assert names(find_blocks([Stack(5)])) == ["layers.0", "layers.1"]


def test_the_models_are_the_outermost_modules_holding_the_optimizers_parameters(monkeypatch):
    model = Stack(2)
    frozen = Stack(2)  # alive, not stepped
    opt = torch.optim.SGD(model.layers[0].parameters(), lr=0.1)

    class Odd:
        param_groups = ["not a dict", {"params": [torch.zeros(1)]}]

    # the process's objects, as the garbage collector lists them
    objects = [*frozen.modules(), "text", *model.modules()]
    monkeypatch.setattr(gc, "get_objects", lambda: objects)
    assert find_models([opt, Odd(), object()]) == [model]  # a child is never a root
    # the search stops at its bound of modules: here before the model itself
    assert find_models([opt], limit=len(list(frozen.modules()))) == []


# -- what refuses a measurement, what it notes --------------------------------------------------------
def test_a_model_sharded_by_fsdp_is_refused():
    class FullyShardedDataParallel(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

    model = FullyShardedDataParallel(Stack())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(MeasurementRefused, match="module FullyShardedDataParallel is sharded by FSDP"):
        StepMeasurement([model], [opt])


@pytest.mark.parametrize(
    ("mark", "said"),
    [
        (lambda p: setattr(p, "ds_id", 3), "sharded (Parameter, DeepSpeed ZeRO)"),
        (None, "sharded (DTensor)"),
    ],
)
def test_sharded_parameters_are_refused(mark, said):
    model = Stack()
    if mark is not None:
        params = list(model.parameters())
        mark(params[0])
    else:

        class DTensor(torch.nn.Parameter):
            pass

        params = [DTensor(torch.zeros(2))]
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(MeasurementRefused) as refused:
        StepMeasurement([model], [opt])
    assert said in str(refused.value)
    assert "cannot be told apart from here" in str(refused.value)


def test_a_model_without_blocks_is_refused():
    lone = torch.nn.Linear(4, 4)
    with pytest.raises(MeasurementRefused, match="the model has no blocks to checkpoint"):
        StepMeasurement([lone], [torch.optim.SGD(lone.parameters(), lr=0.1)])


def test_checkpointed_blocks_several_models_and_optimizers_are_noted():
    class CheckpointWrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    a, b = Stack(2), Stack(2)
    a.layers[1] = CheckpointWrapper()
    opts = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    m = StepMeasurement([a, b], opts)
    assert m.skipped == {"Stack:layers.1"}
    assert m.notes == [
        "block Stack:layers.1 is already checkpointed; it is left out of the plan",
        "2 models hold the optimizers' parameters; their blocks are planned together, each named by its "
        "class (Stack:, Stack#2:): the plan cannot know your names for them",
        "2 optimizers: their parameters, gradients and state are added up",
    ]


# -- storages ------------------------------------------------------------------------------------------
def test_a_storage_is_its_address_and_size_else_the_object_s_identity():
    t = torch.zeros(10)
    assert pc._storage(t) == (t.untyped_storage().data_ptr(), 40)
    assert pc._storage(t[2:5]) == pc._storage(t)  # a view is its base's storage

    class Sized:
        def numel(self) -> int:
            return 3

        def element_size(self) -> int:
            return 2

    odd = Sized()
    assert pc._storage(odd) == (id(odd), 6)
    assert pc._storage(object()) is None


def test_an_operator_s_schema_says_which_returns_are_new_storages():
    assert pc._fresh_returns(torch.ops.aten.add.Tensor) == (True,)
    assert pc._fresh_returns(torch.ops.aten.view.default) == (False,)
    assert pc._fresh_returns(torch.ops.aten.add_.Tensor) == (False,)  # in place: its input
    assert pc._fresh_returns(torch.ops.aten.var_mean.correction) == (True, True)
    assert pc._fresh_returns(object()) == ()


# -- the live-bytes meter ------------------------------------------------------------------------------
def test_a_storage_is_counted_once_until_it_dies():
    meter = LiveTensorBytes()
    freed: list[tuple[int, int]] = []
    new: list[tuple[int, int]] = []
    meter.on_free = lambda address, size: freed.append((address, size))
    meter.on_new = lambda address, size: new.append((address, size))
    t = torch.zeros(100)
    address = t.untyped_storage().data_ptr()
    meter.add(t)
    meter.add(t[10:])  # a view: the same storage
    meter.add(torch.zeros(0))  # nothing to count
    meter.add("not a tensor")
    assert meter.current == meter.peak == 400 and meter.counts(t) and meter.counts(t[:1])
    assert new == [(address, 400)]
    meter.active = True  # deaths are told only while it is entered
    del t
    gc.collect()
    assert meter.current == 0 and meter.peak == 400
    assert freed == [(address, 400)]
    assert not meter.counts("not a tensor")


def test_known_tensors_are_counted_from_the_start_and_others_from_their_making():
    weight = torch.zeros(256)
    with LiveTensorBytes([weight]) as meter:
        assert meter.current == 1024 and meter.active
        a = torch.ones(64)  # 256 B, new
        b = a.view(8, 8)  # a view: nothing new
        c = torch.add(a, 1)  # 256 B more
        pair = torch.var_mean(torch.ones(4, 4), dim=0)  # two returns of 16 B; the 64 B input dies
        assert b is not None and c is not None and pair is not None
        assert meter.current == 1024 + 256 + 256 + 16 + 16
        assert meter.peak == 1024 + 256 + 256 + 64 + 16 + 16
        assert meter.ops >= 4
    assert not meter.active and _get_current_dispatch_mode() is None
    assert meter.peak >= meter.current


def test_with_on_op_the_caller_gets_each_level_and_keeps_its_own_peak():
    levels: list[int] = []
    with LiveTensorBytes(on_op=levels.append) as meter:
        x = torch.ones(10)
        y = x * 2
        del x
        assert y is not None
    assert levels == [40, 80]
    assert meter.peak == 80  # add() itself still raises it
    meter.close()


def test_a_cut_calls_the_caller_before_the_next_operator_and_its_failure_is_kept():
    calls: list[int] = []
    with LiveTensorBytes() as meter:
        meter.on_cut = lambda: calls.append(meter.current)
        meter.cut = True
        torch.ones(3)
        assert calls == [0] and not meter.cut
        torch.ones(3)
        assert calls == [0]  # once per cut

        def broken() -> None:
            raise ValueError("no")

        meter.on_cut = broken
        meter.cut = True
        torch.ones(3)  # the operator still runs
    assert meter.error == "live bytes: ValueError: no"


def test_only_the_device_s_storages_are_counted():
    meter = LiveTensorBytes(device=torch.device("meta"))
    meter.add(torch.zeros(10))
    assert meter.current == 0
    meter.add(torch.zeros(10, device="meta"))  # a meta storage has no bytes
    assert meter.current == 0


def test_closing_forgets_every_storage_and_no_death_is_told_after():
    freed: list[int] = []
    meter = LiveTensorBytes()
    meter.on_free = lambda address, size: freed.append(size)
    with meter:
        t = torch.ones(50)
    meter.close()
    del t
    gc.collect()
    assert freed == [] and not meter.counts(torch.ones(1))


def test_nested_outputs_are_walked():
    meter = LiveTensorBytes()
    held = [torch.zeros(2), (torch.zeros(3), None), "x"]
    meter._add_any(held)
    assert meter.current == 20


# -- autocast --------------------------------------------------------------------------------------------
def test_autocast_is_seen_nested_only_inside_its_context():
    assert not pc._autocast_nested()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pc._autocast_nested()
    assert not pc._autocast_nested()


def test_a_parameter_s_autocast_copy_is_told_from_other_tensors():
    linear = torch.nn.Linear(4, 4)
    seen: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(pc._is_param_cast(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            linear(torch.randn(2, 4, requires_grad=True) * 1)
    # linear saves its input's cast (of a non-leaf) and the weight's cast (a parameter's)
    assert True in seen and False in seen
    assert not pc._is_param_cast(torch.zeros(2))
    x = torch.randn(4, requires_grad=True)
    assert not pc._is_param_cast((x * 2).to(torch.bfloat16))  # a copy of a non-leaf


# -- the measurement ---------------------------------------------------------------------------------------
def test_the_document_of_a_cpu_step():
    torch.manual_seed(0)
    model = Stack(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_of(model, opt, torch.randn(5, 4))
    doc = measure_step(model, opt, step, overhead_of=0.25)
    assert doc["schema"] == SCHEMA and doc["device"] == "cpu" and doc["error"] == ""
    assert doc["typical_step_s"] == 0.25 and doc["step_s"] > 0
    assert doc["peak_source"] == "live tensor bytes after each operator (CPU)"
    assert doc["untracked_bytes"] == 0 and doc["drift_bytes"] == 0
    assert doc["peak_bytes"] == max(max(seg) for seg in doc["timeline"])
    assert doc["saved_tensors"] > 0 and doc["operators"] > 0
    params = sum(p.numel() for p in model.parameters()) * F32
    assert doc["parameter_bytes"] == params
    # zero_grad set the gradients to None after backward: each is counted at its parameter's size
    assert doc["gradient_bytes"] == params and doc["optimizer_state_bytes"] == 0
    for b in doc["blocks"]:
        assert b["class"] == "Block" and b["calls"] == 1 and not b["checkpointed"]
        assert b["parameter_bytes"] == (4 * 8 + 8 + 8 * 4 + 4) * F32
        assert b["forward_s"] > 0 and 0 <= b["recompute_s"] <= b["forward_s"]
        # each block's forward ends before its backward starts, both inside the timeline
        assert b["forward_end"] < b["backward_start"] < len(doc["timeline"])
        assert b["saved_bytes"] >= b["freeable_bytes"] > 0
        assert b["recompute_bytes"] >= b["freeable_bytes"]
    # backward runs the blocks in reverse
    starts = [b["backward_start"] for b in doc["blocks"]]
    assert starts == sorted(starts, reverse=True)


def test_the_blocks_are_listed_in_the_order_of_their_first_call():
    # GIVEN blocks registered 0, 1, 2 and run 2, 0, 2, 1 (block 2 twice, weights shared)
    model = Stack(3, order=[2, 0, 2, 1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step([model], [opt], step_of(model, opt, torch.randn(2, 4)))
    assert [(b["name"], b["calls"]) for b in doc["blocks"]] == [("layers.2", 2), ("layers.0", 1), ("layers.1", 1)]


def test_optimizer_state_and_frozen_parameters_are_counted():
    model = Stack(2)
    for p in model.head.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    step = step_of(model, opt, torch.randn(2, 4))
    step()  # Adam's state exists
    doc = measure_step(model, opt, step)
    stepped = sum(p.numel() for p in model.parameters() if p.requires_grad) * F32
    frozen = sum(p.numel() for p in model.head.parameters()) * F32
    assert doc["parameter_bytes"] == stepped + frozen
    assert doc["gradient_bytes"] == stepped
    assert doc["optimizer_state_bytes"] == 2 * stepped  # exp_avg, exp_avg_sq (the step counters are scalars)


def test_the_given_clock_times_the_blocks():
    ticks = iter(range(10**9))
    calls = []

    def clock() -> float:
        calls.append(1)
        return float(next(ticks))

    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = measure_step(model, opt, step_of(model, opt, torch.randn(2, 4)), clock=clock)
    assert len(calls) > 10
    assert all(b["forward_s"] >= 1 for b in doc["blocks"])  # at least one tick each


def test_a_hook_that_fails_is_reported_and_the_step_runs_on(monkeypatch):
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    real_event = StepMeasurement._event

    def event(self: StepMeasurement) -> int:
        if self._stack:
            raise RuntimeError("event lost")
        return real_event(self)

    monkeypatch.setattr(StepMeasurement, "_event", event)
    doc = measure_step(model, opt, step_of(model, opt, torch.randn(2, 4)))
    assert doc["error"] == "forward pre-hook: event lost"
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the step ran
    assert _get_current_dispatch_mode() is None
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_stop_is_safe_twice_and_before_start_and_hooks_pass_through_after():
    model = Stack(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = StepMeasurement([model], [opt])
    m.stop()
    m.stop()
    assert m.stopped and m.error == "" and not m.started
    # stopped: what autograd hands the hooks goes through untouched
    t = torch.ones(2)
    assert m._pack(t) is t
    assert m._unpack(t) is t
    m2 = StepMeasurement([model], [opt])
    saved = pc._Saved(0, t, m2)
    m2.stopped = True
    assert m2._unpack(saved) is t


def test_a_saved_tensor_let_go_after_the_measurement_is_ignored(monkeypatch):
    model = Stack(2)
    m = StepMeasurement([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    saved = pc._Saved(0, torch.ones(2), m)
    del saved  # not started: nothing recorded, nothing raised
    assert m._released == {}

    class Broken:
        def _let_go(self, owner: int, tensor: Any) -> None:
            raise RuntimeError("gone")

    escaped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", escaped.append)
    pc._Saved(0, torch.ones(1), Broken())  # type: ignore[arg-type]
    gc.collect()
    assert escaped == []  # its failure stays in __del__


def test_an_already_checkpointed_block_gets_no_hooks():
    model = Stack(3)
    model.layers[1].gradient_checkpointing = True
    m = StepMeasurement([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    m.start()
    try:
        assert len(model.layers[1]._forward_pre_hooks) == 0
        assert len(model.layers[0]._forward_pre_hooks) == 1 and len(model.layers[2]._forward_hooks) == 1
    finally:
        m.stop()
    assert all(len(b._forward_pre_hooks) == len(b._forward_hooks) == 0 for b in model.layers)


def test_the_module_imports_no_torch_until_asked():
    # the agent loads it into every job; torch is imported by what needs it, when it runs
    source = sys.modules[pc.__name__].__file__
    assert source is not None
    top = [line for line in open(source).read().splitlines() if line.startswith(("import ", "from "))]
    assert not any("torch" in line for line in top)
