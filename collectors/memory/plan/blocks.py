"""The model as the memory plan's measurement sees it: its candidate blocks (:func:`find_blocks`),
the models under the optimizers (:func:`find_models`), what makes two blocks the same work
(:func:`block_kind`), and why a step cannot be measured right (:func:`_limits`,
:func:`compiled_code`: :class:`MeasurementRefused`). Imports no torch until asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from collectors.memory.plan.measurement import MAX_BLOCKS

MAX_MODULES = 1_000_000

# Module classes whose instances are already checkpointed (FSDP's checkpoint_wrapper, fairscale's,
# DeepSpeed's pipeline module's wrapper): their saved tensors are not seen, nor are they wrapped again.
CHECKPOINT_CLASSES = ("CheckpointWrapper", "CheckpointModule", "CheckpointFunction")


def find_blocks(roots: Iterable[Any]) -> list[tuple[str, Any]]:
    """The candidate blocks of ``roots``: (qualified name, module), outermost first.

    A block is a child of a ``ModuleList`` or ``Sequential`` that has submodules itself and
    owns parameters, in a container of two such children or more (transformer layers, ViT
    encoder layers). A block that is itself such a container (a ResNet stage: a ``Sequential``
    of bottlenecks) is replaced by the blocks inside it, at the finest level a user would wrap
    (``layer3.0`` .. ``layer3.5``; a container of one block gives that block); a block's own
    descendants are not candidates, so the plan's blocks are disjoint. With none found, the
    roots' direct children that own parameters are the blocks."""
    import torch

    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def has_params(m: Any) -> bool:
        return any(True for _ in m.parameters())

    def is_block(child: Any) -> bool:
        return any(True for _ in child.children()) and has_params(child)

    def add(qual: str, block: Any, depth: int) -> None:
        inner = [(n, c) for n, c in block.named_children() if is_block(c)] if isinstance(block, containers) else []
        if inner and depth <= 64:
            # a container of blocks: the blocks inside it are the units to wrap
            for name, child in inner:
                if id(child) not in seen:
                    seen.add(id(child))
                    add(f"{qual}.{name}", child, depth + 1)
            return
        if len(out) < MAX_BLOCKS:
            out.append((qual, block))

    def walk(prefix: str, m: Any, depth: int) -> None:
        if len(out) >= MAX_BLOCKS or depth > 64 or id(m) in seen:
            return
        seen.add(id(m))
        repeated = isinstance(m, containers) and sum(1 for c in m.children() if is_block(c)) >= 2
        for name, child in m.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            if repeated and is_block(child) and id(child) not in seen:
                seen.add(id(child))
                add(qual, child, depth + 1)
                if len(out) >= MAX_BLOCKS:
                    return
            else:
                walk(qual, child, depth + 1)

    roots = [unwrapped(r) for r in roots]
    prefixes = model_prefixes(roots)
    for root, prefix in zip(roots, prefixes):
        walk(prefix, root, 0)
    if not out:
        for root, prefix in zip(roots, prefixes):
            for name, child in root.named_children():
                if has_params(child):
                    out.append((prefix + name, child))
    # a model's own name is ``Class:``; its blocks' names go on from there without a dot
    return [(name.replace(":.", ":", 1), m) for name, m in out]


WRAPPERS = ("DistributedDataParallel", "DataParallel", "OptimizedModule")


def unwrapped(model: Any, depth: int = 8) -> Any:
    """The model as the user's code built it: DDP's (and DataParallel's) ``module`` and
    torch.compile's ``_orig_mod`` taken off, so that the plan names its modules as the user's
    ``model.named_modules()`` does."""
    while depth > 0 and type(model).__name__ in WRAPPERS:
        inner = model.__dict__.get("_modules", {}).get("_orig_mod") or model.__dict__.get("_modules", {}).get("module")
        if inner is None:
            break
        model, depth = inner, depth - 1
    return model


def model_prefixes(roots: list[Any]) -> list[str]:
    """Each model's prefix in the plan's names: none for one model; with several, its class name
    and a colon (``Generator:layers.0``; a second of the same class ``Generator#2:``). The
    variable that holds a model is not knowable from here: its class is."""
    if len(roots) <= 1:
        return [""] * len(roots)
    seen: dict[str, int] = {}
    out = []
    for root in roots:
        cls = type(root).__name__
        seen[cls] = seen.get(cls, 0) + 1
        out.append(f"{cls}:" if seen[cls] == 1 else f"{cls}#{seen[cls]}:")
    return out


def find_models(optimizers: Iterable[Any], limit: int = MAX_MODULES) -> list[Any]:
    """The outermost ``nn.Module`` objects of this process that hold the optimizers' parameters
    (found through the garbage collector's objects, once, when a plan is asked for)."""
    import gc

    import torch

    params: set[int] = set()
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []) or []:
            for p in group.get("params", []) if isinstance(group, dict) else []:
                params.add(id(p))
    modules = []
    module_type = torch.nn.Module
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read
        if issubclass(type(obj), module_type):
            modules.append(obj)
            if len(modules) >= limit:
                break
    children: set[int] = set()
    for m in modules:
        for c in m.children():
            children.add(id(c))
    roots = []
    for m in modules:
        if id(m) in children:
            continue
        if any(id(p) in params for p in m.parameters()):
            roots.append(m)
    return roots


def live_tensors(limit: int = MAX_MODULES) -> list[Any]:
    """The tensors alive in this process that Python holds (the garbage collector's objects,
    once, on the training thread): a loop's variables, a batch, the previous step's outputs.
    Tensors held by C++ alone (a retained autograd graph) are not among them."""
    import gc

    import torch

    out = []
    kinds = (torch.Tensor, torch.nn.Parameter)  # not subclasses: a wrapper's storage is not its memory
    for obj in gc.get_objects():
        # type(), not isinstance(): some objects warn when their __class__ is read
        if type(obj) in kinds and not obj.is_meta:
            out.append(obj)
            if len(out) >= limit:
                break
    return out


def _limits(roots: list[Any], optimizers: list[Any], blocks: list[tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """(reasons the measurement would be wrong: refuse, notes on what is left out of the plan)."""
    refuse: list[str] = []
    notes: list[str] = []
    for root in roots:
        for name, m in root.named_modules():
            cls = type(m).__name__
            forward = m.__dict__.get("forward")  # an instance attribute: torch.compile(m.forward)?
            if (
                cls == "OptimizedModule"
                or hasattr(m, "_orig_mod")
                or m.__dict__.get("_compiled_call_impl") is not None  # m.compile(), in place
                or (forward is not None and hasattr(forward, "_torchdynamo_orig_callable"))
            ):
                refuse.append(
                    f"module {name or type(root).__name__} is compiled with torch.compile: its blocks' forward "
                    "hooks and saved tensors are not seen inside the compiled graph, and hooks added to it would "
                    "make torch.compile trace it again (other code than the job's own)"
                )
                break
            if cls in ("FullyShardedDataParallel", "FSDPModule") or cls.startswith("FSDP"):
                refuse.append(
                    f"module {name or cls} is sharded by FSDP: the gathered parameters would be counted as activations"
                )
                break
    for opt in optimizers:
        for group in getattr(opt, "param_groups", []) or []:
            for p in group.get("params", []) if isinstance(group, dict) else []:
                if hasattr(p, "ds_id") or type(p).__name__ in ("FlatParameter", "DTensor"):
                    refuse.append(
                        f"the optimizer's parameters are sharded ({type(p).__name__}"
                        f"{', DeepSpeed ZeRO' if hasattr(p, 'ds_id') else ''}): parameter, gradient and "
                        "activation bytes of one rank cannot be told apart from here"
                    )
                    break
            if refuse:
                break
    for name, m in blocks:
        cls = type(m).__name__
        if cls in CHECKPOINT_CLASSES or getattr(m, "gradient_checkpointing", False):
            notes.append(f"block {name} is already checkpointed; it is left out of the plan")
    if len(roots) > 1:
        named = ", ".join(model_prefixes([unwrapped(r) for r in roots])[:8])
        notes.append(
            f"{len(roots)} models hold the optimizers' parameters; their blocks are planned together, each named by "
            f"its class ({named}): the plan cannot know your names for them"
        )
    if len(optimizers) > 1:
        notes.append(f"{len(optimizers)} optimizers: their parameters, gradients and state are added up")
    return refuse, notes


class MeasurementRefused(Exception):
    """The step cannot be measured right (compiled, sharded): the reason, for the user, and
    what to do instead (``help``, empty for the caller's default)."""

    def __init__(self, message: str, help: str = "") -> None:
        super().__init__(message)
        self.help = help


COMPILED_HELP = (
    "Plan from an eager run of the same model: start it with TORCHDYNAMO_DISABLE=1 (or without its "
    "torch.compile calls) for a few steps and ask there; the plan's blocks are the same modules."
)


def compiled_code(limit: int = 3) -> list[str]:
    """The code objects torch.compile has compiled in this process (``name (file:line)``, at
    most ``limit``), empty when it compiled none.

    Why a measured step must not run where any exist: compiled code is guarded on the state it
    was traced under (a module's hook tables, the dispatch modes and saved-tensor hooks in
    force). The measurement changes all three for one step, so compiled code that the step
    reaches would fail its guards and be traced again with the measurement's hooks inside, or
    fall back to other code: the step would run other kernels than the job's own and its losses
    could change from then on (seen: 241 of 300 losses differed after a model compiled in
    place). Eager code is unaffected: the hooks only observe. Read from dynamo's own record of
    the code it has compiled (a list of weak references, read on the training thread)."""
    import sys

    convert = sys.modules.get("torch._dynamo.convert_frame")
    tracker = getattr(convert, "input_codes", None)
    seen = getattr(tracker, "seen", None)
    if not isinstance(seen, list):
        return []
    out: list[str] = []
    for ref in list(seen):
        code = ref() if callable(ref) else None
        if code is None:
            continue
        name = str(getattr(code, "co_name", "?"))
        where = f"{getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', 0)}"
        out.append(f"{name} ({where})")
        if len(out) >= limit:
            break
    return out


def block_kind(m: Any) -> str:
    """What makes two blocks the same work: the class and the parameters' shapes and types (a
    short digest; empty for a block no longer held)."""
    if m is None:
        return ""
    import hashlib

    h = hashlib.sha1(type(m).__qualname__.encode(), usedforsecurity=False)
    for name, p in m.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
