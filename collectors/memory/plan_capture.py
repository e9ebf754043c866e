"""One training step measured for the memory plan, inside the training process.

:class:`StepMeasurement` installs, for one step only, what the plan needs and removes all of
it afterwards:

- a forward pre-hook and a forward hook on each candidate block (the modules a user would wrap
  in a checkpoint: the children of a ``ModuleList``/``Sequential`` that are themselves modules
  with submodules, such as transformer layers and ResNet blocks), which time its forward and
  say which block is running;
- ``torch.autograd.graph.saved_tensors_hooks`` (pushed on the training thread, popped there)
  whose pack hook counts the bytes each block saves for backward. Storages are counted once:
  a storage saved twice, a view of a saved storage, and the parameters' storages are not new
  activations. The pack hook returns the tensor itself, so autograd keeps what it would have
  kept.

A storage is *freeable* by checkpointing block B when every save of it happened inside B's
forward and it is not one of B's inputs (a checkpoint keeps its inputs). What no block can
free (the inputs between blocks, what the embedding, the head and the loss save) is the
unrecomputable rest.

Nothing here runs unless a plan is asked for; :func:`measure_step` is the in-process entry
point (a model, an optimizer and a callable that runs one step), the agent drives the same
class from its step hook. Everything is caught: a failure ends the measurement and is
reported, never raised into the job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

MAX_BLOCKS = 4096
MAX_MODULES = 1_000_000
SCHEMA = 1

# Module classes whose instances are already checkpointed: their saved tensors are not seen.
_CHECKPOINT_WRAPPERS = ("CheckpointWrapper", "CheckpointModule", "CheckpointFunction")


def _storage(t: Any) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
        return int(s.data_ptr()), int(s.nbytes())
    except Exception:
        try:
            return id(t), int(t.numel()) * int(t.element_size())
        except Exception:
            return None


def find_blocks(roots: Iterable[Any]) -> list[tuple[str, Any]]:
    """The candidate blocks of ``roots``: (qualified name, module), outermost first.

    A block is a child of a ``ModuleList`` or ``Sequential`` that has submodules itself and
    owns parameters, in a container of two such children or more; a block's own descendants are not candidates (the plan's blocks are
    disjoint). With none found, the roots' direct children that own parameters are the blocks."""
    import torch

    containers = (torch.nn.ModuleList, torch.nn.Sequential)
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def has_params(m: Any) -> bool:
        return any(True for _ in m.parameters())

    def walk(prefix: str, m: Any, depth: int) -> None:
        if len(out) >= MAX_BLOCKS or depth > 64 or id(m) in seen:
            return
        seen.add(id(m))

        def is_block(child: Any) -> bool:
            return any(True for _ in child.children()) and has_params(child)

        repeated = isinstance(m, containers) and sum(1 for c in m.children() if is_block(c)) >= 2
        for name, child in m.named_children():
            qual = f"{prefix}.{name}" if prefix else name
            if repeated and is_block(child) and id(child) not in seen:
                seen.add(id(child))
                out.append((qual, child))
                if len(out) >= MAX_BLOCKS:
                    return
            else:
                walk(qual, child, depth + 1)

    roots = list(roots)
    for i, root in enumerate(roots):
        walk("" if len(roots) == 1 else f"model{i}", root, 0)
    if not out:
        for i, root in enumerate(roots):
            for name, child in root.named_children():
                if has_params(child):
                    out.append((name if len(roots) == 1 else f"model{i}.{name}", child))
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


def _limits(roots: list[Any], optimizers: list[Any], blocks: list[tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """(reasons the measurement would be wrong: refuse, notes on what is left out of the plan)."""
    refuse: list[str] = []
    notes: list[str] = []
    for root in roots:
        for name, m in root.named_modules():
            cls = type(m).__name__
            if cls == "OptimizedModule" or hasattr(m, "_orig_mod"):
                refuse.append(
                    f"module {name or type(root).__name__} is compiled with torch.compile: its blocks' forward "
                    "hooks and saved tensors are not seen inside the compiled graph"
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
        if cls in _CHECKPOINT_WRAPPERS or getattr(m, "gradient_checkpointing", False):
            notes.append(f"block {name} is already checkpointed; it is left out of the plan")
    if len(roots) > 1:
        notes.append(f"{len(roots)} models hold the optimizers' parameters; their blocks are planned together")
    if len(optimizers) > 1:
        notes.append(f"{len(optimizers)} optimizers: their parameters, gradients and state are added up")
    return refuse, notes


class MeasurementRefused(Exception):
    """The step cannot be measured right (compiled, sharded): the reason, for the user."""


class StepMeasurement:
    """Hooks for one step: :meth:`start` before it, :meth:`stop` after it, :meth:`result` then."""

    def __init__(self, roots: list[Any], optimizers: list[Any], reset_peak: bool = False) -> None:
        self.roots = roots
        self.optimizers = optimizers
        self.reset_peak = reset_peak
        self.blocks = find_blocks(roots)
        self.refused, self.notes = _limits(roots, optimizers, self.blocks)
        if self.refused:
            raise MeasurementRefused("; ".join(self.refused))
        if not self.blocks:
            raise MeasurementRefused("the model has no blocks to checkpoint (no module with parameters under it)")
        self.skipped = {
            name
            for name, m in self.blocks
            if type(m).__name__ in _CHECKPOINT_WRAPPERS or getattr(m, "gradient_checkpointing", False)
        }
        self._handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._stack: list[int] = []
        self._owners: dict[tuple[int, int], set[int]] = {}  # storage -> blocks that saved it (-1: none)
        self._inputs: list[set[tuple[int, int]]] = [set() for _ in self.blocks]
        self._fwd: list[float] = [0.0] * len(self.blocks)
        self._calls: list[int] = [0] * len(self.blocks)
        self._first: list[int] = [len(self.blocks)] * len(self.blocks)  # forward order of first calls
        self._order: list[int] = []
        self._events: list[list[Any]] = [[] for _ in self.blocks]
        self._t0: list[float] = [0.0] * len(self.blocks)
        self._param_keys: set[tuple[int, int]] = set()
        self._cuda: Any = None
        self._device = "cpu"
        self._peak_before = 0
        self._packs = 0
        self._backward_alloc = -1
        self.step_s = 0.0
        self._thread = 0
        self.error = ""
        self.started = False
        self.stopped = False

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        import torch

        for root in self.roots:
            for p in root.parameters():
                key = _storage(p)
                if key is not None:
                    self._param_keys.add(key)
                if p.device.type == "cuda":
                    self._device = str(p.device)
        if self._device.startswith("cuda"):
            self._cuda = torch.cuda
            dev = torch.device(self._device)
            if self.reset_peak:
                torch.cuda.reset_peak_memory_stats(dev)
            self._peak_before = int(torch.cuda.max_memory_allocated(dev))
        for index, (_name, module) in enumerate(self.blocks):
            if _name in self.skipped:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(index), always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        self._thread = threading.get_ident()
        self.started = True
        self._step_t0 = time.perf_counter()

    def stop(self) -> None:
        """Remove every hook; safe to call twice and after a failed start."""
        if self.stopped:
            return
        self.stopped = True
        self.step_s = time.perf_counter() - getattr(self, "_step_t0", time.perf_counter())
        ctx, self._hooks_ctx = self._hooks_ctx, None
        if ctx is not None and threading.get_ident() != self._thread:
            # The hooks are the training thread's (autograd keeps them per thread): popping
            # here would pop another thread's. They stop counting (self.stopped) instead.
            ctx = None
        if ctx is not None:
            try:
                ctx.__exit__(None, None, None)
            except Exception as exc:
                self.error = self.error or f"could not pop the saved-tensor hooks: {exc}"
        handles, self._handles = self._handles, []
        for h in handles:
            try:
                h.remove()
            except Exception:
                pass

    # -- hooks (on the training thread, during the measured step) ----------------------------
    def _pre(self, index: int) -> Callable[..., None]:
        def pre(module: Any, args: Any, kwargs: Any) -> None:
            try:
                self._stack.append(index)
                if not self._calls[index]:
                    self._first[index] = len(self._order)
                    self._order.append(index)
                self._calls[index] += 1
                for a in (*args, *kwargs.values()):
                    key = _storage(a) if _is_tensor(a) else None
                    if key is not None:
                        self._inputs[index].add(key)
                if self._cuda is not None:
                    ev = self._cuda.Event(enable_timing=True)
                    ev.record()
                    self._events[index].append(ev)
                else:
                    self._t0[index] = time.perf_counter()
            except Exception as exc:
                self.error = self.error or f"forward pre-hook: {exc}"

        return pre

    def _post(self, index: int) -> Callable[..., None]:
        def post(module: Any, args: Any, output: Any) -> None:
            try:
                if self._stack and self._stack[-1] == index:
                    self._stack.pop()
                if self._cuda is not None:
                    ev = self._cuda.Event(enable_timing=True)
                    ev.record()
                    self._events[index].append(ev)
                else:
                    self._fwd[index] += time.perf_counter() - self._t0[index]
            except Exception as exc:
                self.error = self.error or f"forward hook: {exc}"

        return post

    def _pack(self, t: Any) -> Any:
        if self.stopped:
            return t
        try:
            self._packs += 1
            key = _storage(t)
            if key is not None and key not in self._param_keys:
                owner = self._stack[-1] if self._stack else -1
                self._owners.setdefault(key, set()).add(owner)
        except Exception as exc:
            self.error = self.error or f"pack hook: {exc}"
        return t

    def _unpack(self, t: Any) -> Any:
        if self._backward_alloc < 0 and self._cuda is not None:
            try:
                self._backward_alloc = int(self._cuda.memory_allocated(self._device))
            except Exception:
                self._backward_alloc = 0
        return t

    # -- the answer --------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        """The measurement's document (:class:`collectors.memory.plan.Measurement`'s JSON)."""
        import torch

        n = len(self.blocks)
        freeable = [0] * n
        saved = [0] * n
        outside = 0
        activation = 0
        for key, owners in self._owners.items():
            size = key[1]
            activation += size
            if len(owners) == 1:
                (owner,) = owners
                if owner >= 0:
                    saved[owner] += size
                    if key not in self._inputs[owner]:
                        freeable[owner] += size
                        continue
            outside += size
        if self._cuda is not None:
            for i, evs in enumerate(self._events):
                total = 0.0
                for a, b in zip(evs[0::2], evs[1::2]):
                    b.synchronize()
                    total += a.elapsed_time(b) / 1000.0
                self._fwd[i] = total
        seen: set[tuple[int, int]] = set()
        grad_sized: set[tuple[str, int]] = set()
        params = grads = state = 0

        def count(t: Any) -> int:
            key = _storage(t)
            if key is None or key in seen:
                return 0
            seen.add(key)
            return key[1]

        for opt in self.optimizers:
            for group in getattr(opt, "param_groups", []) or []:
                for p in group.get("params", []) if isinstance(group, dict) else []:
                    params += count(p)
                    if p.grad is not None:
                        grads += count(p.grad)
                    elif getattr(p, "requires_grad", False) and ("grad", id(p)) not in grad_sized:
                        # zeroed (set to None) since backward: its gradient is as large as it
                        grad_sized.add(("grad", id(p)))
                        grads += int(p.numel()) * int(p.element_size())
            for per in list((getattr(opt, "state", {}) or {}).values()):
                if isinstance(per, dict):
                    for v in per.values():
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            state += count(v)
        for root in self.roots:
            for p in root.parameters():  # parameters no optimizer steps (frozen) hold memory too
                params += count(p)
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "device": self._device,
            "blocks": [
                {
                    "name": name,
                    "class": type(m).__name__,
                    "saved_bytes": saved[i],
                    "freeable_bytes": freeable[i],
                    "forward_s": round(self._fwd[i], 9),
                    "calls": self._calls[i],
                    "parameter_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
                    "checkpointed": name in self.skipped,
                }
                # in the order of their first forward call (backward runs them in reverse)
                for i, (name, m) in sorted(enumerate(self.blocks), key=lambda x: (self._first[x[0]], x[0]))
            ],
            "activation_bytes": activation,
            "unrecomputable_activation_bytes": outside,
            "parameter_bytes": params,
            "gradient_bytes": grads,
            "optimizer_state_bytes": state,
            "saved_tensors": self._packs,
            "step_s": round(self.step_s, 6),
            "notes": list(self.notes),
            "error": self.error,
        }
        if self._cuda is not None:
            dev = torch.device(self._device)
            peak = int(torch.cuda.max_memory_allocated(dev))
            doc["peak_bytes"] = peak
            doc["peak_source"] = (
                "torch.cuda.max_memory_allocated during the step"
                if self.reset_peak or peak > self._peak_before
                else "torch.cuda.max_memory_allocated of the process (the step did not raise it)"
            )
            doc["allocated_at_backward_bytes"] = max(self._backward_alloc, 0)
            doc["temporary_bytes"] = max(0, peak - params - grads - state - activation)
        else:
            doc["peak_bytes"] = params + grads + state + activation
            doc["peak_source"] = "parameters + gradients + optimizer state + saved-tensor bytes (CPU)"
            doc["peak_includes_gradients"] = True
            doc["temporary_bytes"] = 0
        return doc


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def measure_step(
    model: Any, optimizer: Any, step: Callable[[], Any], reset_peak: bool = False, overhead_of: float | None = None
) -> dict[str, Any]:
    """Run ``step()`` once with the measurement's hooks and return the measurement's document.

    ``model`` is an ``nn.Module`` or a list of them, ``optimizer`` an optimizer or a list.
    ``reset_peak`` resets the CUDA peak statistic first (the caller's own process only: the
    agent never does). ``overhead_of``: a typical step's seconds, to report the measured
    step's extra cost against. Raises :class:`MeasurementRefused` when the step cannot be
    measured right; every hook is removed whether the step raises or not."""
    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    m = StepMeasurement(roots, optimizers, reset_peak=reset_peak)
    try:
        m.start()
        step()
        if m._cuda is not None:
            m._cuda.synchronize(m._device)
    finally:
        m.stop()
    doc = m.result()
    if overhead_of is not None:
        doc["typical_step_s"] = round(overhead_of, 6)
    return doc
