"""The memory plan's "how to apply it" recipes, run: each one (torch.utils.checkpoint,
FSDP's checkpoint_wrapper, Hugging Face's gradient checkpointing restricted to the chosen
layers) is executed on a tiny random-init Hugging Face Llama, exactly as a user would paste
it, and must checkpoint the chosen layers and no other, without changing the loss or the
gradients. A checkpointed layer's inner modules run twice per step (the forward, then the
recompute in backward, which stops early after the last saved tensor it needs: so the probe is
the first projection, not the last); the others run once."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from collectors.memory.plan.capture import measure_step
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.recipes import how_to_apply
from collectors.memory.plan.solve import make_plan

pytestmark = pytest.mark.usefixtures("eager_process")

transformers = pytest.importorskip("transformers")

LAYERS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.train()
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))


def _step(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = _batch()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _runs_per_layer(model: torch.nn.Module, inner: list[torch.nn.Module]) -> list[int]:
    counts = [0] * len(inner)
    hooks = [
        m.register_forward_hook(lambda *_a, i=i: counts.__setitem__(i, counts[i] + 1)) for i, m in enumerate(inner)
    ]
    try:
        _step(model)
    finally:
        for h in hooks:
            h.remove()
    return counts


@pytest.fixture(scope="module")
def chosen_and_recipes():
    # GIVEN a plan measured on the model's real step, for a budget half-way down to its floor
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        ids = _batch()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists: its first step's is not the peak the plan is for
    import collectors.memory.plan.capture as capture

    with pytest.MonkeyPatch.context() as mp:
        # as eager_process does (a module's fixture sees none of the tests' monkeypatches): other
        # tests of this worker run torch.compile in-process
        mp.setattr(capture, "compiled_code", lambda limit=3: [])
        doc = measure_step(model, opt, step)
    measurement = from_json(doc)
    layers = [b.name for b in measurement.blocks]
    assert layers == [f"model.layers.{i}" for i in range(LAYERS)], layers
    # half-way between the peak and the least any set of layers reaches
    floor = make_plan(measurement, save=1)["floor_bytes"]
    plan = make_plan(measurement, budget=(measurement.peak_bytes + floor) // 2)
    chosen = plan["plan"]["modules"]
    assert 0 < len(chosen) < LAYERS, plan["plan"]
    assert plan["apply"] == how_to_apply(measurement, chosen)
    return chosen, plan["apply"]


@pytest.mark.parametrize("recipe", ["torch.utils.checkpoint", "fsdp checkpoint_wrapper", "hugging face"])
def test_each_recipe_checkpoints_the_chosen_layers_and_no_other(chosen_and_recipes, recipe):
    chosen, recipes = chosen_and_recipes
    plain = _model()
    want_loss, want_grads = _step(plain)
    # WHEN the recipe is pasted into a fresh copy of the job's model
    model = _model()
    inner = [layer.self_attn.q_proj for layer in model.model.layers]  # the same objects once wrapped
    exec(recipes[recipe], {"model": model})
    # THEN exactly the chosen layers recompute in backward
    runs = _runs_per_layer(model, inner)
    want = [2 if f"model.layers.{i}" in chosen else 1 for i in range(LAYERS)]
    assert runs == want, (recipe, chosen, runs)
    # AND the step computes the same loss and gradients (the parameters keep their names)
    loss, grads = _step(model)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    renamed = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in grads.items()}
    assert renamed.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(renamed[name], g, rtol=1e-5, atol=1e-6)


def _deepspeed_stand_in() -> tuple[types.ModuleType, list[object]]:
    """A stand-in for ``deepspeed`` where it is not installed: ``checkpointing.configure`` records
    its config, ``checkpointing.checkpoint`` is reentrant and passes keyword arguments on as
    positional ones, as DeepSpeed's does (0.19.8, read and run: its reentrant function gave the
    same loss and gradients as this test's plain step with use_cache=False)."""
    configured: list[object] = []

    def checkpoint(function, *args, **kwargs):  # type: ignore[no-untyped-def]
        keys, count = tuple(kwargs), len(args)

        def run(*all_args):  # type: ignore[no-untyped-def]
            return function(*all_args[:count], **dict(zip(keys, all_args[count:])))

        return torch.utils.checkpoint.checkpoint(run, *args, *kwargs.values(), use_reentrant=True)

    checkpointing = types.SimpleNamespace(
        configure=lambda mpu, deepspeed_config=None: configured.append(deepspeed_config), checkpoint=checkpoint
    )
    return types.ModuleType("deepspeed"), [checkpointing, configured]


def test_the_deepspeed_recipe_checkpoints_the_chosen_layers_with_the_users_config(chosen_and_recipes, monkeypatch):
    chosen, recipes = chosen_and_recipes
    recipe = recipes["deepspeed"]
    # GIVEN DeepSpeed (a stand-in with its reentrant checkpoint) and the user's config
    module, (checkpointing, configured) = _deepspeed_stand_in()
    module.checkpointing = checkpointing  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", module)
    ds_config = {"activation_checkpointing": {"partition_activations": False}}
    plain = _model()
    plain.config.use_cache = False
    want_loss, want_grads = _step(plain)
    # WHEN the recipe is pasted, the model trained as it says (use_cache=False)
    assert "use_cache=False" in recipe
    model = _model()
    model.config.use_cache = False
    inner = [layer.self_attn.q_proj for layer in model.model.layers]
    exec(recipe, {"model": model, "ds_config": ds_config})
    # THEN DeepSpeed's checkpointing is configured from the user's config
    assert configured == [ds_config]
    # AND exactly the chosen layers recompute, with the same loss and gradients
    runs = _runs_per_layer(model, inner)
    assert runs == [2 if f"model.layers.{i}" in chosen else 1 for i in range(LAYERS)], (chosen, runs)
    loss, grads = _step(model)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)
