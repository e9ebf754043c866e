"""collectors.memory.plan.blocks: the blocks found in a model, the models under the optimizers,
and what refuses a measurement or is noted by it."""

from __future__ import annotations

import gc

import pytest
import torch

from collectors.memory.plan import blocks as plan_blocks
from collectors.memory.plan.blocks import MeasurementRefused, find_blocks, find_models
from collectors.memory.plan.capture import StepMeasurement
from tests.unit._plan_models import Block, Stack, names

pytestmark = pytest.mark.usefixtures("eager_process")


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
    monkeypatch.setattr(plan_blocks, "MAX_BLOCKS", 2)
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
