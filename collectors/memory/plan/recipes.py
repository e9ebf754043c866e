"""How to apply a memory plan: the chosen modules checkpointed in the usual frameworks
(``torch.utils.checkpoint``, FSDP's ``checkpoint_wrapper``, Hugging Face, DeepSpeed), as code
the user pastes (:func:`how_to_apply`)."""

from __future__ import annotations

from collectors.memory.plan.measurement import MAX_BLOCKS, Measurement

# The recipes' common part: the chosen modules of one model as the user's code holds it (DDP's
# ``module``, torch.compile's ``_orig_mod`` taken off), checked to exist: a name that matches
# nothing raises, never wraps nothing silently.
_CHOSEN = (
    "def chosen_modules(model):\n"
    "    # the model as your code built it: DDP's .module and torch.compile's ._orig_mod taken off\n"
    "    while type(model).__name__ in ('DistributedDataParallel', 'DataParallel', 'OptimizedModule'):\n"
    "        model = model._orig_mod if hasattr(model, '_orig_mod') else model.module\n"
    "    names = {names}\n"
    "    found = {{n: m for n, m in model.named_modules() if n in names}}\n"
    "    if set(found) != names:\n"
    "        raise RuntimeError(f'the memory plan names modules that {{type(model).__name__}} does not have: '\n"
    "                           f'{{sorted(names - set(found))}}')\n"
    "    return found\n"
)


def _models(modules: list[str]) -> dict[str, list[str]]:
    """The chosen modules by model: ``{"": names}`` for one model, else by each model's class
    name (``Class:path``: the plan cannot know the user's variable names for them)."""
    out: dict[str, list[str]] = {}
    for name in modules[:MAX_BLOCKS]:
        model, sep, path = name.partition(":")
        out.setdefault(model if sep else "", []).append(path if sep else name)
    return out


def _variable(cls: str) -> str:
    """A variable name for a model of class ``cls`` (``Discriminator`` -> ``discriminator``)."""
    out = "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(cls))
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in out).split("#")[0]
    return out if out and out.isidentifier() else "model"


def _recipe(modules: list[str], head: str, per_model: str) -> str:
    """``head``, the chosen-modules check, and ``per_model`` (which uses ``model``) run for each
    model the modules belong to."""
    by_model = _models(modules)
    if list(by_model) in ([""], []):
        names = "{" + ", ".join(repr(n) for n in by_model.get("", [])) + "}" if by_model else "set()"
        return head + "CHECKPOINT = " + names + "\n" + _CHOSEN.format(names="CHECKPOINT") + per_model
    table = ", ".join(f"{cls!r}: {{" + ", ".join(repr(n) for n in names) + "}" for cls, names in by_model.items())
    variables = ", ".join(_variable(cls.split("#")[0]) for cls in by_model)
    body = "\n".join("    " + line for line in per_model.rstrip("\n").splitlines())
    return (
        head
        + "# each model's modules under its class name (the plan cannot know your names for the models)\n"
        + f"CHECKPOINT = {{{table}}}\n"
        + _CHOSEN.format(names="CHECKPOINT[type(model).__name__]").replace(
            "    names = CHECKPOINT[type(model).__name__]", "    names = CHECKPOINT.get(type(model).__name__, set())"
        )
        + f"for model in ({variables},):  # your models\n"
        + body
        + "\n"
    )


def how_to_apply(m: Measurement, modules: list[str]) -> dict[str, str]:
    """How to checkpoint exactly ``modules`` in the usual frameworks. Each recipe names the
    modules as the user's code holds the model (unwrapped from DDP and torch.compile; with
    several models, each by its class name) and raises when a name matches nothing."""
    return {
        "torch.utils.checkpoint": _recipe(
            modules,
            "import torch.utils.checkpoint as cp\n",
            "for name, mod in chosen_modules(model).items():\n"
            "    fwd = mod.forward\n"
            "    mod.forward = lambda *a, _f=fwd, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)\n"
            "# (a Hugging Face model: train it with use_cache=False, or its KV cache keeps what each recompute makes)\n",
        ),
        "fsdp checkpoint_wrapper": _recipe(
            modules,
            "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (\n"
            "    apply_activation_checkpointing, checkpoint_wrapper)\n",
            "ids = {id(m) for m in chosen_modules(model).values()}\n"
            "apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,\n"
            "                               check_fn=lambda m, ids=ids: id(m) in ids)\n",
        ),
        "hugging face": _recipe(
            modules,
            "# Enabling checkpointing checkpoints every layer. Where the layers are\n"
            "# GradientCheckpointingLayer (recent transformers), enable it, then turn it off\n"
            "# on the layers not chosen; elsewhere, leave it off and wrap the chosen layers as with\n"
            "# torch.utils.checkpoint above.\n",
            "keep = set(chosen_modules(model).values())\n"
            "if hasattr(model, 'activation_checkpointing_enable'):  # transformers 5.x\n"
            "    model.activation_checkpointing_enable({'use_reentrant': False})\n"
            "else:\n"
            "    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})\n"
            "for name, mod in model.named_modules():\n"
            "    layer = any(c.__name__ == 'GradientCheckpointingLayer' for c in type(mod).__mro__)\n"
            "    if layer and mod not in keep:\n"
            "        mod.gradient_checkpointing = False\n",
        ),
        "deepspeed": _recipe(
            modules,
            "# After deepspeed.initialize (or deepspeed.init_distributed); ds_config is your DeepSpeed\n"
            "# config (a dict or its path), whose activation_checkpointing section this reads, e.g.\n"
            '# "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false}.\n'
            "# DeepSpeed's checkpoint is reentrant: a Hugging Face model must train with use_cache=False\n"
            "# (its recompute would read the KV cache its forward filled: wrong gradients).\n"
            "import deepspeed\n"
            "deepspeed.checkpointing.configure(None, deepspeed_config=ds_config)\n",
            "for name, mod in chosen_modules(model).items():\n"
            "    fwd = mod.forward\n"
            "    mod.forward = lambda *a, _f=fwd, **k: deepspeed.checkpointing.checkpoint(_f, *a, **k)\n",
        ),
    }
