"""The memory plan's field findings, fixed at their cause (issue 50, part 4), on tiny CPU models:
recipes that name the modules as the user's code holds them and check that they wrapped what
they name; a job's own checkpointing and activation offloading recognised and said in words;
gradient accumulation measured per micro-batch. Memory on the CPU does not depend on timing;
no test here looks at a clock."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.utils.checkpoint as cp

from collectors.memory.plan.blocks import find_blocks
from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.predict import predict
from collectors.memory.plan.recipes import how_to_apply
from collectors.memory.plan.solve import make_plan
from tests.support.plan_models import real_peak

pytestmark = pytest.mark.usefixtures("eager_process")


class Block(torch.nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, n: int = 4, d: int = 16) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(d) for _ in range(n)])
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Critic(Net):
    pass


class DistributedDataParallel(torch.nn.Module):
    """Stands in for torch's DDP wrapper (same class name, the model as ``module``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *a, **k):
        return self.module(*a, **k)


def counting(model: torch.nn.Module) -> dict[str, int]:
    """How often each ``layers.i.up`` runs (twice per step when its layer is checkpointed)."""
    runs: dict[str, int] = {}
    for name, mod in model.named_modules():
        if name.endswith(".up"):
            runs[name] = 0
            mod.register_forward_hook(lambda m, a, o, name=name: runs.__setitem__(name, runs[name] + 1))
    return runs


def step_of(model: torch.nn.Module, x: torch.Tensor, micro_batches: int = 1):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        for _ in range(micro_batches):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return opt, step


def test_a_ddp_models_blocks_are_named_as_the_users_model_holds_them_and_the_recipe_wraps_them():
    # GIVEN a model wrapped in DDP, measured and planned
    torch.manual_seed(0)
    inner = Net()
    model = DistributedDataParallel(inner)
    opt, step = step_of(model, torch.randn(64, 16))
    assert [n for n, _ in find_blocks([model])] == [f"layers.{i}" for i in range(4)]
    gc.collect()
    m = from_json(measure_step(model, opt, step))
    names = ["layers.1", "layers.3"]

    # WHEN the plan's torch.utils.checkpoint recipe is run as pasted, on the wrapper the loop holds
    runs = counting(inner)
    exec(how_to_apply(m, names)["torch.utils.checkpoint"], {"model": model})
    model(torch.randn(8, 16)).sum().backward()

    # THEN exactly the named layers are recomputed (their first Linear runs twice)
    assert runs == {"layers.0.up": 1, "layers.1.up": 2, "layers.2.up": 1, "layers.3.up": 2}


@pytest.mark.parametrize("recipe", ["torch.utils.checkpoint", "fsdp checkpoint_wrapper"])
def test_a_recipe_that_names_a_module_the_model_lacks_raises_and_says_which(recipe):
    # GIVEN a recipe for a module this model does not have
    model = Net()
    code = how_to_apply(None, ["layers.1", "blocks.9"])[recipe]  # type: ignore[arg-type]

    # WHEN it is run as pasted THEN it raises, naming the module, before wrapping anything
    with pytest.raises(RuntimeError, match=r"Net does not have: \['blocks.9'\]"):
        exec(code, {"model": model, "ds_config": {}, "deepspeed": None})


def test_two_models_are_named_by_class_and_the_recipe_wraps_each_ones_own():
    # GIVEN two models stepped together (a GAN's shape), measured
    torch.manual_seed(0)
    net, critic = Net(), Critic()
    opt = torch.optim.SGD([*net.parameters(), *critic.parameters()], lr=0.01)
    x = torch.randn(32, 16)

    def step() -> None:
        (net(x).sum() + critic(x).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    gc.collect()
    m = from_json(measure_step([net, critic], opt, step))

    # THEN each model's blocks carry its class name, and the notes say why
    assert {b.name for b in m.blocks} >= {"Net:layers.0", "Critic:layers.3"}
    assert any("named by its class (Net:, Critic:)" in n for n in m.notes)
    # AND the recipe, run for both models under their class names, wraps each one's own
    runs_net, runs_critic = counting(net), counting(critic)
    code = how_to_apply(m, ["Net:layers.0", "Critic:layers.2"])["torch.utils.checkpoint"]
    assert "for model in (net, critic,):  # your models" in code
    exec(code, {"net": net, "critic": critic})
    (net(x).sum() + critic(x).sum()).backward()
    assert runs_net == {"layers.0.up": 2, "layers.1.up": 1, "layers.2.up": 1, "layers.3.up": 1}
    assert runs_critic == {"layers.0.up": 1, "layers.1.up": 1, "layers.2.up": 2, "layers.3.up": 1}


@pytest.mark.parametrize("form", ["plan recipe", "reentrant call", "non-reentrant call"])
def test_a_jobs_own_checkpointing_is_recognised_in_any_form(form):
    # GIVEN a model whose layers 1 and 2 the job checkpoints itself
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(64, 16)
    if form == "plan recipe":
        exec(how_to_apply(None, ["layers.1", "layers.2"])["torch.utils.checkpoint"], {"model": model})  # type: ignore[arg-type]
    else:
        reentrant = form == "reentrant call"

        def forward(h: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(model.layers):
                h = cp.checkpoint(layer, h, use_reentrant=reentrant) if i in (1, 2) else layer(h)
            return model.head(h)

        model.forward = forward  # type: ignore[method-assign]
    opt, step = step_of(model, x.requires_grad_(form == "reentrant call"))

    # WHEN its step is measured and planned
    gc.collect()
    m = from_json(measure_step(model, opt, step))

    # THEN those layers are marked checkpointed, said in words, and left out of the plan
    marked = {b.name for b in m.blocks if b.checkpointed}
    assert marked == {"layers.1", "layers.2"}, [(b.name, b.checkpointed, b.saved_bytes) for b in m.blocks]
    assert any("checkpoints layers.1, layers.2 already" in n for n in m.notes), m.notes
    plan = make_plan(m, budget=1)
    assert not set((plan.get("plan") or {}).get("modules", [])) & marked


def test_activation_offloading_is_recognised_and_said():
    # GIVEN a job that offloads its activations to host memory around the forward
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(64, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        with torch.autograd.graph.save_on_cpu():
            loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()

    # WHEN its step is measured
    gc.collect()
    m = from_json(measure_step(model, opt, step))

    # THEN the plan says the activations are offloaded and leaves those blocks out
    assert all(b.checkpointed for b in m.blocks if b.name.startswith("layers."))
    assert any("offloads activations to host memory" in n for n in m.notes), m.notes


def test_gradient_accumulation_is_measured_per_micro_batch():
    # GIVEN a step of four micro-batches before one optimizer step
    torch.manual_seed(0)
    model = Net(n=6, d=32)
    x = torch.randn(256, 32)
    opt, step = step_of(model, x, micro_batches=4)

    # WHEN it is measured
    gc.collect()
    m = from_json(measure_step(model, opt, step))

    # THEN the first micro-batch is measured (each block once) and the notes say so
    assert all(b.calls == 1 for b in m.blocks), [b.calls for b in m.blocks]
    assert all(b.forward_end <= b.backward_start for b in m.blocks)
    assert any("gradient accumulation" in n for n in m.notes)
    # AND checkpointing every layer is predicted as a real accumulation step with them all
    # checkpointed holds at its highest (not "no set reaches the budget")
    every = {b.name for b in m.blocks}
    for names in (set(), every):
        peak = real_peak(model, step, names)
        predicted = predict(m, names)["predicted_peak_bytes"]
        assert abs(peak - predicted) <= 0.01 * peak, (sorted(names), predicted, peak)
