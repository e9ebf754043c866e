"""The memory plan applied inside the training process: the chosen blocks' forward recomputed
in backward (``dynprof run --checkpoint``), checked against the plan, and taken back.

Everything here runs on the training thread, at a step boundary (dynprof/agent/_mem_apply.py
drives it): the job's modules are touched there only, never from the agent's threads.

- :func:`wrap` replaces a block's ``forward`` on the instance with one that calls the original
  through non-reentrant ``torch.utils.checkpoint`` (the same operators run again in backward,
  the RNG state restored: the job's losses are unchanged, bit for bit on a deterministic loop),
  and returns what takes it back (:meth:`Wrapped.undo`).
- :func:`why_not_wrap` says, in words, why a block must not be wrapped: it is already
  checkpointed (any form dynprof knows: FSDP's ``checkpoint_wrapper``, Hugging Face's
  ``gradient_checkpointing``, DeepSpeed's or dynprof's own forward), compiled by
  ``torch.compile``, or its model keeps a cache that a recompute would fill twice.
- :class:`StepPeak` reads one step's real peak: on CUDA the allocator's highest count during
  the step where it rose past the process's earlier peak (read, never reset), and always the
  live tensor bytes after every operator (:class:`~.meter.LiveTensorBytes`), the scale
  the plan predicts on.
- :func:`auto_budget` is the budget of ``--checkpoint auto``: the device's memory (or the
  process's cap) less a margin.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from collectors.memory.plan.blocks import CHECKPOINT_CLASSES, find_blocks, live_tensors
from collectors.memory.plan.budget import parse_budget
from collectors.memory.plan.meter import LiveTensorBytes
from dynprof import errors

# ``--checkpoint auto`` plans for this share of the device's memory (or of the process's cap): the
# rest is for the CUDA context, the allocator's cached blocks that fragmentation leaves unused,
# and NCCL's buffers, none of which the allocated-bytes peak counts.
AUTO_FRACTION = 0.90
ENV = "DYNPROF_CHECKPOINT"  # the job's request: a budget or auto (set by `dynprof run --checkpoint`)
MAX_SPEC = 64
MARK = "__dynprof_checkpoint__"  # set on the forward dynprof put in place


def parse_spec(text: str) -> str:
    """``auto``, a size (``40G``) or a percentage of the measured peak (``60%``), checked;
    raises ValueError with the reason."""
    spec = text.strip()
    if not spec or len(spec) > MAX_SPEC:
        raise ValueError(f"not a budget: {spec[:MAX_SPEC]!r}")
    if spec.lower() == "auto":
        return "auto"
    try:
        parse_budget(spec)
    except errors.DynprofError as exc:
        raise ValueError(exc.message) from None
    return spec


@dataclass
class Wrapped:
    """One block whose forward dynprof replaced; :meth:`undo` puts the original back."""

    name: str
    module: Any  # a weak reference to the block
    forward: Any  # the forward dynprof put in place
    had_own: bool  # the instance had its own ``forward`` attribute before (a framework's wrapper)
    previous: Any  # that attribute, put back by undo

    def undo(self) -> bool:
        """Put the block's forward back; False when the block is gone or its forward is no
        longer dynprof's (someone replaced it since: left as it is)."""
        module = self.module()
        if module is None or module.__dict__.get("forward") is not self.forward:
            return False
        if self.had_own:
            module.forward = self.previous
        else:
            del module.forward
        self.previous = None
        return True


def why_not_wrap(name: str, module: Any, root: Any = None) -> str:
    """Why ``module`` (named ``name``) must not be wrapped, in words; ``""`` when it may."""
    cls = type(module).__name__
    forward = module.__dict__.get("forward")
    if forward is not None and getattr(forward, MARK, False):
        return f"block {name} is already checkpointed by dynprof"
    if cls in CHECKPOINT_CLASSES or any(c.__name__ in CHECKPOINT_CLASSES for c in type(module).__mro__):
        return f"block {name} is already checkpointed ({cls}): a second checkpoint would recompute it twice"
    if getattr(module, "gradient_checkpointing", False):
        return f"block {name} is already checkpointed by its framework (gradient_checkpointing is on)"
    if forward is not None and (
        "checkpoint" in str(getattr(forward, "__qualname__", "")).lower()
        or "checkpoint" in getattr(getattr(forward, "__code__", None), "co_names", ())
    ):
        # the plan's own recipe, DeepSpeed's: a forward that calls a checkpoint function
        return f"block {name} is already checkpointed: its forward calls a checkpoint"
    if (
        cls == "OptimizedModule"
        or hasattr(module, "_orig_mod")
        or module.__dict__.get("_compiled_call_impl") is not None
        or (forward is not None and hasattr(forward, "_torchdynamo_orig_callable"))
    ):
        return (
            f"block {name} is inside a torch.compile region: a checkpoint added to it would make torch.compile "
            "trace it again, and the job would run other code than its own"
        )
    config = getattr(root, "config", None)
    if config is not None and getattr(config, "use_cache", False) and getattr(root, "training", True):
        return (
            f"block {name}: the model's config has use_cache=True, so a recompute of the block would add its keys "
            "and values to the cache a second time; train with use_cache=False (model.config.use_cache = False)"
        )
    return ""


def wrap(name: str, module: Any) -> Wrapped:
    """Make ``module``'s forward run through non-reentrant ``torch.utils.checkpoint``. Without
    grad (an evaluation), the original forward runs as it is."""
    import torch
    from torch.utils.checkpoint import checkpoint

    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    inner = module.forward  # the bound method, or the framework's own instance attribute

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    setattr(forward, MARK, True)
    forward.__qualname__ = f"dynprof_checkpoint({name})"
    module.forward = forward
    return Wrapped(name, weakref.ref(module), forward, had_own, previous)


def blocks_by_name(roots: list[Any]) -> dict[str, tuple[Any, Any]]:
    """The plan's candidate blocks of ``roots`` by the names the measurement gave them:
    name -> (module, its root)."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, module in find_blocks(roots):
        root = roots[0] if len(roots) == 1 else _root_of(name, roots)
        out[name] = (module, root)
    return out


def _root_of(name: str, roots: list[Any]) -> Any:
    head = name.split(".", 1)[0]
    if head.startswith("model") and head[5:].isdigit() and int(head[5:]) < len(roots):
        return roots[int(head[5:])]
    return None


class StepPeak:
    """One step's peak, read between two step boundaries on the training thread:
    :meth:`start` at the first, :meth:`stop` at the second (both on the training thread).

    ``bytes`` is the live tensor bytes' highest level (parameters, gradients and optimizer
    state counted from the start, as the measurement counts them); on CUDA, where the
    allocator's own peak statistic rose during the step past what it held before, that figure
    instead (``source`` says which). The job's peak statistic is never reset."""

    def __init__(self, known: Iterable[Any], device: str) -> None:
        import torch

        self.device = device
        self._dev = torch.device(device) if device.startswith("cuda") else None
        self.meter = LiveTensorBytes(known, device=self._dev)
        self.before = 0
        self.bytes = 0
        self.source = "live tensor bytes"
        self.error = ""

    def start(self) -> None:
        import torch

        if self._dev is not None:
            self.before = int(torch.cuda.max_memory_allocated(self._dev))
        self.meter.__enter__()

    def stop(self) -> None:
        import torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        meter = self.meter
        if meter._mode is not None and _get_current_dispatch_mode() is meter._mode:
            meter.__exit__(None, None, None)
        else:  # another mode was pushed over it: it only passes operators through from here
            meter.active = False
        self.bytes = meter.peak
        self.error = meter.error
        meter.close()
        if self._dev is not None:
            after = int(torch.cuda.max_memory_allocated(self._dev))
            if after > self.before:
                self.bytes, self.source = after, "the allocator's peak during the step"


def known_tensors(roots: Iterable[Any], optimizers: Iterable[Any]) -> list[Any]:
    """What lives before a step: the models' parameters and gradients, the optimizers' state,
    and every other tensor Python holds (counted from the start as the measurement counts them,
    so the verified peak is read as the predicted one was). On the training thread."""
    import torch

    out: list[Any] = []
    for root in roots:
        for p in root.parameters():
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for opt in optimizers:
        for per in list((getattr(opt, "state", {}) or {}).values()):
            if isinstance(per, dict):
                out.extend(v for v in per.values() if isinstance(v, torch.Tensor))
    out.extend(live_tensors())
    return out


def auto_budget(device: str, host_limit: Callable[[], int] | None = None) -> tuple[int, str]:
    """The budget of ``--checkpoint auto`` on ``device``: (bytes, how it was found)."""
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        total = int(torch.cuda.get_device_properties(dev).total_memory)
        fraction = 1.0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is not None:
            try:
                fraction = float(getter(dev))
            except Exception:
                fraction = 1.0
        cap = int(total * min(max(fraction, 0.0), 1.0))
        where = f"{device}'s memory" if fraction >= 1.0 else f"the process's cap ({fraction:g} of {device}'s memory)"
        return int(cap * AUTO_FRACTION), f"{AUTO_FRACTION:.0%} of {where}"
    limit = host_limit() if host_limit is not None else 0
    return int(limit * AUTO_FRACTION), f"{AUTO_FRACTION:.0%} of the host memory limit"
