"""One training step measured for the memory plan, inside the training process.

:class:`StepMeasurement` installs, for one step only, what the plan needs and removes all of
it afterwards:

- a forward pre-hook and a forward hook on each candidate block (the modules a user would wrap
  in a checkpoint, at the finest repeated level: transformer layers, ResNet bottlenecks), which
  time its forward and say which block is running;
- ``torch.autograd.graph.saved_tensors_hooks`` (pushed on the training thread, popped there)
  whose pack hook counts the bytes each block saves for backward and whose unpack hook marks
  where each block's backward begins. Storages are counted once: a storage saved twice, a view
  of a saved storage, and the parameters' storages are not new activations. Autograd keeps the
  tensor itself (with the saving block's index beside it);
- a ``TorchDispatchMode`` (:class:`LiveTensorBytes`) that follows the bytes of live tensor
  storages after every operator, forward, backward and optimizer step, cut into segments at
  each block event: the step's memory timeline.

A storage is *freeable* by checkpointing block B when it was made during B's forward and only
B saved it (not an input of B: a checkpoint keeps its inputs; not a buffer or a table made
before). One that others saved too (the next block, as its input; an operator outside the
blocks) is freed by B's checkpoint only once they are done with it. What no block can free
(the inputs between blocks, what the embedding, the head and the loss save) is the
unrecomputable rest. An input of B that the step lets go before B's backward (nothing saved
it: under CUDA autocast a LayerNorm saves a float32 copy of its bf16 input) is one that B's
checkpoint *keeps*: its death begins a segment, from which the checkpoint would hold it until
B's backward.

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
SCHEMA = 2

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
        if cls in _CHECKPOINT_WRAPPERS or getattr(m, "gradient_checkpointing", False):
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


# -- live tensor bytes ---------------------------------------------------------------------------
_FRESH: dict[Any, tuple[bool, ...]] = {}  # op -> which of its returns are new storages (not views)


def _fresh_returns(func: Any) -> tuple[bool, ...]:
    got = _FRESH.get(func)
    if got is None:
        try:
            got = tuple(r.alias_info is None for r in func._schema.returns)
        except Exception:
            got = ()
        if len(_FRESH) < 100_000:
            _FRESH[func] = got
    return got


_MODE_CLASS: Any = None


def _mode_class() -> Any:
    """The dispatch mode behind :class:`LiveTensorBytes` (defined when first needed: importing
    this module does not import torch)."""
    global _MODE_CLASS
    if _MODE_CLASS is None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class _LiveBytesMode(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
            def __init__(self, meter: LiveTensorBytes) -> None:
                super().__init__()  # type: ignore[no-untyped-call]
                self.meter = meter

            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                meter = self.meter
                if meter.cut:
                    # a storage the caller follows died since the last operator: before this one
                    meter.cut = False
                    on_cut = meter.on_cut
                    if on_cut is not None and meter.active:
                        try:
                            on_cut()
                        except Exception as exc:
                            meter.error = meter.error or f"live bytes: {type(exc).__name__}: {exc}"
                out = func(*args, **(kwargs or {}))
                if meter.active:
                    try:
                        fresh = _fresh_returns(func)
                        if len(fresh) == 1:
                            if fresh[0]:
                                meter._add_any(out)
                        else:
                            for is_new, item in zip(fresh, out if isinstance(out, (tuple, list)) else ()):
                                if is_new:
                                    meter._add_any(item)
                        meter.ops += 1
                        if meter.on_op is not None:
                            meter.on_op(meter.current)
                        elif meter.current > meter.peak:
                            meter.peak = meter.current
                    except Exception as exc:
                        meter.error = meter.error or f"live bytes: {type(exc).__name__}: {exc}"
                return out

        _MODE_CLASS = _LiveBytesMode
        del torch
    return _MODE_CLASS


class LiveTensorBytes:
    """The bytes of tensor storages alive, op by op, while entered (on this thread, and on the
    autograd threads its backward runs on, which inherit the dispatch mode).

    A ``TorchDispatchMode`` sees every operator's outputs after autograd and autocast (the
    backward's and the optimizer's included); each output that is a new storage (not a view,
    not an in-place result: the operator's schema says) is counted until the storage dies (a
    weak reference's callback). ``known`` tensors (parameters, gradients, optimizer state alive
    before) are counted from the start and their deaths too (``zero_grad`` frees gradients).
    What it does not see: memory an operator allocates and frees inside itself (a kernel's
    workspace) and storages made before that are not ``known`` (constant unless freed).
    ``peak`` is the highest ``current`` after any operator; with ``on_op`` the caller gets each
    level instead and keeps its own peak. With ``device``, only storages on that device count.
    Used by the measurement, and as the CPU's "real peak" of a run (scripts/bench_memory_plan.py,
    the tests)."""

    def __init__(
        self, known: Iterable[Any] = (), on_op: Callable[[int], None] | None = None, device: Any = None
    ) -> None:
        self.device = device  # count only storages on this device (None: all)
        self.current = 0
        self.peak = 0
        self.ops = 0
        self.error = ""
        self.on_op = on_op
        self.on_new: Callable[[int, int], None] | None = None  # each storage counted from now: (address, bytes)
        # each counted storage that died: (address, bytes), from the weak reference's callback (the
        # memory may not be released yet: nothing but bookkeeping there); it may set ``cut``, and
        # ``on_cut`` is then called before the next operator (the memory released by then)
        self.on_free: Callable[[int, int], None] | None = None
        self.on_cut: Callable[[], object] | None = None
        self.cut = False
        self.active = False
        self._live: dict[int, Any] = {}
        self._lock = threading.RLock()
        self._mode: Any = None
        for t in known:
            self.add(t)

    def add(self, t: Any) -> None:
        """Count the storage of tensor ``t`` from now until it dies (once, however many views)."""
        import weakref

        try:
            st = t.untyped_storage()
            if self.device is not None and st.device != self.device:
                return
            key = int(st._cdata)
            size = int(st.nbytes())
            address = int(st.data_ptr())
        except Exception:
            return
        if size <= 0:
            return
        with self._lock:
            if key in self._live:
                return

            def gone(_ref: Any, key: int = key, size: int = size, address: int = address) -> None:
                with self._lock:
                    if self._live.pop(key, None) is None:
                        return
                    self.current -= size
                on_free = self.on_free
                if on_free is not None and self.active:
                    try:
                        on_free(address, size)
                    except Exception as exc:
                        self.error = self.error or f"live bytes: {type(exc).__name__}: {exc}"

            self._live[key] = weakref.ref(st, gone)
            self.current += size
            if self.current > self.peak:
                self.peak = self.current
        if self.on_new is not None:
            self.on_new(address, size)

    def counts(self, t: Any) -> bool:
        """Whether the storage of tensor ``t`` is counted now (so its death will be seen)."""
        try:
            key = int(t.untyped_storage()._cdata)
        except Exception:
            return False
        with self._lock:
            return key in self._live

    def _add_any(self, item: Any) -> None:
        if isinstance(item, (list, tuple)):
            for x in item:
                self._add_any(x)
        elif item is not None and hasattr(item, "untyped_storage"):
            self.add(item)

    def __enter__(self) -> LiveTensorBytes:
        self._mode = _mode_class()(self)
        self._mode.__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)

    def close(self) -> None:
        """Stop counting (the weak references go; no callback runs after)."""
        self.active = False
        with self._lock:
            self._live.clear()


def _autocast_nested() -> bool:
    """Whether this thread is inside an autocast context, so its cache of parameter casts is
    alive (it is cleared when the outermost context exits). ``torch.is_autocast_enabled`` does
    not say it: it is false inside autocast's own kernels, which exclude its dispatch key."""
    import torch

    depth = int(torch.autocast_increment_nesting())
    torch.autocast_decrement_nesting()
    return depth > 1


def _is_param_cast(t: Any) -> bool:
    """Whether ``t`` is autocast's copy of a parameter (``_to_copy`` of a leaf that requires
    grad, or a view of one, as ``linear`` saves ``weight.t()``): autocast keeps such casts in
    its cache until its context exits, checkpoint or not."""
    base = getattr(t, "_base", None)
    fn = getattr(t if base is None else base, "grad_fn", None)
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    try:
        nxt = fn.next_functions
        return len(nxt) == 1 and nxt[0][0] is not None and type(nxt[0][0]).__name__ == "AccumulateGrad"
    except Exception:
        return False


MAX_SEGMENTS = 5 * MAX_BLOCKS + 64
MAX_STORAGES = 5_000_000  # storages whose birth and release are kept (then no more: less is freed)
MIN_OWN_SHARE = 0.05  # a block's CPU time is at least this share of its time under the measurement
MAX_LATE = 64  # late-freed groups per block kept (the earliest; the rest count as not freed)
MAX_KEPT = 64  # inputs per block that its checkpoint would keep (the first; see StepMeasurement)


class _Saved:
    """What the saved-tensor hook hands autograd: the tensor, and the block whose forward saved
    it (-1: none), so that backward's first unpack of a block's own tensor marks where that
    block's backward (and a checkpoint's recompute of it) begins."""

    __slots__ = ("measurement", "owner", "tensor")

    def __init__(self, owner: int, tensor: Any, measurement: StepMeasurement) -> None:
        self.owner = owner
        self.tensor = tensor
        self.measurement = measurement

    def __del__(self) -> None:
        # autograd let go of it (its node ran, or the graph is gone)
        try:
            self.measurement._let_go(self.owner, self.tensor)
        except Exception:
            pass


# Beyond this share of the step's highest level, a process peak the step did not raise is not
# this step's (it is noted, and this much is taken as the step's unseen part).
UNTRACKED_CAP = 0.05


class StepMeasurement:
    """Hooks for one step: :meth:`start` before it, :meth:`stop` after it, :meth:`result` then.

    Besides each block's saved bytes and forward time, it records the step's memory *timeline*:
    the live bytes after every operator (:class:`LiveTensorBytes`; on CUDA set right against
    ``memory_allocated`` at every block event), cut into segments at each block's forward
    start, forward end and backward start (the first time backward unpacks a tensor the block
    saved), each segment keeping its highest level, apart for the operators run while autocast
    (and so its cache of parameter casts) is on. With it, :mod:`.plan` predicts the peak of any
    set of checkpointed blocks: a block's freeable bytes are missing from the segments between
    its forward end and its backward start, and its recompute (at its backward start) rises by
    what its forward rose up to its last saved tensor (where a non-reentrant checkpoint stops
    recomputing). Autograd letting go of a tensor that a block saved too (another saver done
    with it) begins a segment as well.

    ``reset_peak`` (the caller's own process only; the agent never does): on CUDA the peak
    statistic is reset at every event, so each segment holds the allocator's own highest level,
    kernels' workspaces included. Without it, what the process's peak holds beyond the highest
    level seen is the measurement's ``untracked_bytes``, which the plan adds everywhere."""

    def __init__(
        self,
        roots: list[Any],
        optimizers: list[Any],
        reset_peak: bool = False,
        clock: Callable[[], float] | None = None,
        time_limit_s: float | None = None,
        on_end: Callable[[str], None] | None = None,
    ) -> None:
        self.roots = roots
        self.clock = clock or time.perf_counter  # the CPU's timer of blocks (CUDA: events)
        self.optimizers = optimizers
        self.reset_peak = reset_peak
        self.blocks = find_blocks(roots)
        self.refused, self.notes = _limits(roots, optimizers, self.blocks)
        compiled = compiled_code()
        if compiled and not self.refused:
            self.refused.append(
                "torch.compile has compiled code in this process ("
                + ", ".join(compiled)
                + "): a measured step changes the hooks and modes that compiled code is guarded on, so it would "
                "be traced again and run other code than the job's own"
            )
        if self.refused:
            compiled_refusal = any("torch.compile" in r for r in self.refused)
            raise MeasurementRefused("; ".join(self.refused), COMPILED_HELP if compiled_refusal else "")
        if not self.blocks:
            raise MeasurementRefused("the model has no blocks to checkpoint (no module with parameters under it)")
        self.skipped = {
            name
            for name, m in self.blocks
            if type(m).__name__ in _CHECKPOINT_WRAPPERS or getattr(m, "gradient_checkpointing", False)
        }
        n = len(self.blocks)
        self._handles: list[Any] = []
        self._hooks_ctx: Any = None
        self._stack: list[int] = []
        self._owners: dict[tuple[int, int], set[int]] = {}  # storage -> blocks that saved it (-1: none)
        self._casts: set[tuple[int, int]] = set()  # saved storages that are autocast's parameter casts
        self._inputs: list[set[tuple[int, int]]] = [set() for _ in self.blocks]
        # a block input's storage -> the blocks that took it, until it dies
        self._input_of: dict[tuple[int, int], set[int]] = {}
        # per block: (segment, bytes, group) of its inputs that died before its backward (a
        # checkpoint of it keeps them until then); group numbers the storage, shared by its blocks
        self._kept: list[list[tuple[int, int, int]]] = [[] for _ in self.blocks]
        self._kept_groups = 0
        self._deaths: list[tuple[int, list[int]]] = []  # (bytes, blocks) died since the last event
        self._fwd: list[float] = [0.0] * n
        self._recompute: list[float] = [0.0] * n
        self._calls: list[int] = [0] * n
        self._first: list[int] = [n] * n  # forward order of first calls
        self._order: list[int] = []
        self._events: list[list[Any]] = [[] for _ in self.blocks]  # CUDA: [start, last save, end] per call
        self._t0: list[float] = [0.0] * n
        self._t0_raw: list[float] = [0.0] * n  # the clock itself at the block's start
        self._last_save: list[Any] = [None] * n
        self._param_keys: set[tuple[int, int]] = set()
        # the timeline: per segment, the highest level of operators run with autocast off / on
        self._plain: list[int] = [0]
        self._cached: list[int] = [0]
        self._hook_s = 0.0
        self._per_op_s = 0.0
        self._offset = 0
        self._calibrated = False
        # The allocator's count, (bytes now, highest since a reset), read at every block event to
        # set the levels right (CUDA's; None on the CPU, where the levels are the live tensor
        # bytes; a test may give another count)
        self.allocator: Callable[[], tuple[int, int]] | None = None
        self._drift = 0  # the most the allocator held beyond the levels seen (they may be low by it)
        self._drift_over = 0  # the most the levels seen held beyond the allocator's count (high by it)
        self.accumulation = False  # the step accumulates gradients: its first micro-batch measured
        self._backward_seen = False
        self._shifted = False
        self._own_packs: list[int] = [0] * n  # tensors each block's forward saved through our hook
        self._packs_at: list[int] = [0] * n
        self._hidden: dict[int, str] = {}  # blocks whose saved tensors another hook took: why
        self._preexisting_bytes = 0  # tensors alive at the start that Python held (not the model's)
        self._amp: Callable[[], bool] = lambda: False
        self._blk_max = 0
        self._fwd_base: list[int] = [0] * n
        self._rise: list[int] = [0] * n
        self._fwd_end: list[int] = [-1] * n
        self._bwd_start: list[int] = [-1] * n
        self._fwd_start: list[int] = [-1] * n
        self._born: dict[tuple[int, int], int] = {}  # storage -> the segment it was made in
        self._saved_born: dict[tuple[int, int], int] = {}  # the same, for the saved ones, read when saved
        # (storage, saver) -> the segment that began when autograd let go of the saver's copy
        self._released: dict[tuple[tuple[int, int], int], int] = {}
        self._bwd_level: list[int] = [0] * n
        self._meter: LiveTensorBytes | None = None
        self._meter_entered = False
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
        # The measured step ends at its optimizer step; one that does not come ends it at the
        # first block forward that shows it (without grad, or past ``time_limit_s``), and
        # ``on_end`` is told why (on the training thread, after every hook is removed).
        self.time_limit_s = time_limit_s
        self.on_end = on_end
        self.ended_early = ""
        self._step_t0 = time.perf_counter()
        # what :meth:`freeze` keeps of the job's objects, as plain numbers
        self._frozen: dict[str, Any] | None = None
        self._ops = 0
        self._classes = [type(m).__name__ for _name, m in self.blocks]
        self._input_shape: list[int] = []  # the first block's first tensor input, when it was first called

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        import torch

        self._thread = threading.get_ident()  # the thread whose hooks these are (stop() checks it)
        known = []
        for root in self.roots:
            for p in root.parameters():
                key = _storage(p)
                if key is not None:
                    self._param_keys.add(key)
                if p.device.type == "cuda":
                    self._device = str(p.device)
                known.append(p)
                if p.grad is not None:
                    known.append(p.grad)
        for opt in self.optimizers:
            for per in list((getattr(opt, "state", {}) or {}).values()):
                if isinstance(per, dict):
                    known.extend(v for v in per.values() if isinstance(v, torch.Tensor))
            for group in getattr(opt, "param_groups", []) or []:
                for p in group.get("params", []) if isinstance(group, dict) else []:
                    known.append(p)
                    if getattr(p, "grad", None) is not None:
                        known.append(p.grad)
        # Every other tensor alive now that Python holds (the previous step's logits and loss
        # kept in the loop's variables, a batch): counted from the start, so that their deaths
        # during the step are seen. Unseen, such a death left the level high by its size until
        # the next block event (a decoder's bf16 logits, kept in a variable across steps, died
        # inside the head-and-loss segment: the step's peak read 1000 MiB high).
        preexisting = live_tensors()
        if self._device.startswith("cuda"):
            self._cuda = torch.cuda
            dev = torch.device(self._device)
            if self.reset_peak:
                torch.cuda.reset_peak_memory_stats(dev)
            self._peak_before = int(torch.cuda.max_memory_allocated(dev))
        if self._cuda is not None and self.allocator is None:
            self.allocator = self._cuda_allocated
        self._amp = _autocast_nested
        if self._cuda is None:
            self._calibrate()
        # on CUDA, the measured device's storages only (the CPU's scalars are not its memory)
        self._meter = LiveTensorBytes(
            known, on_op=self._on_op, device=torch.device(self._device) if self._cuda else None
        )
        before = self._meter.current
        for t in preexisting:
            self._meter.add(t)
        self._preexisting_bytes = self._meter.current - before
        del preexisting  # the meter follows them by weak reference; none is held here
        self._meter.on_new = self._on_new
        self._meter.on_free = self._on_free
        self._meter.on_cut = self._event
        self._plain, self._cached = [0], [0]
        self._recalibrate()
        self._plain = [self._level()]
        for index, (_name, module) in enumerate(self.blocks):
            if _name in self.skipped:
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(index), always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        self._meter.__enter__()
        self._meter_entered = True
        self.started = True
        self._step_t0 = time.perf_counter()

    def stop(self) -> None:
        """Remove every hook; safe to call twice and after a failed start."""
        if self.stopped:
            return
        self.stopped = True
        self.step_s = time.perf_counter() - getattr(self, "_step_t0", time.perf_counter())
        meter = self._meter
        if meter is not None:
            meter.active = False  # from here on the mode only passes operators through
            if self.started:
                self._recalibrate()  # the last segment's peak, where it may be read
        on_thread = threading.get_ident() == self._thread
        ctx, self._hooks_ctx = self._hooks_ctx, None
        entered, self._meter_entered = self._meter_entered, False
        if on_thread:
            self._pop(meter if entered else None, ctx)
        elif entered or ctx is not None:
            # The mode and the hooks are the training thread's (kept per thread): popping them
            # here would pop this thread's. They only pass things through now, and the
            # training thread pops them after its next optimizer step.
            self._pop_later(meter if entered else None, ctx)
        handles, self._handles = self._handles, []
        for h in handles:
            try:
                h.remove()
            except Exception:
                pass
        if meter is not None:
            self.error = self.error or meter.error
            meter.close()

    def _pop(self, meter: LiveTensorBytes | None, ctx: Any) -> None:
        """Pop the dispatch mode and the saved-tensor hooks, on the thread that pushed them,
        each only when it is on top (another pushed after it is left alone)."""
        import torch
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if meter is not None and meter._mode is not None:
            try:
                if _get_current_dispatch_mode() is meter._mode:
                    meter.__exit__(None, None, None)
                else:
                    self.error = self.error or "another dispatch mode was pushed over the measurement's; left"
            except Exception as exc:
                self.error = self.error or f"could not pop the dispatch mode: {exc}"
        if ctx is not None:
            try:
                top = torch._C._autograd._top_saved_tensors_default_hooks(False)
                if top is not None and top[0] == self._pack:
                    ctx.__exit__(None, None, None)
                else:
                    self.error = self.error or "other saved-tensor hooks were pushed over the measurement's; left"
            except Exception as exc:
                self.error = self.error or f"could not pop the saved-tensor hooks: {exc}"

    def _pop_later(self, meter: LiveTensorBytes | None, ctx: Any) -> None:
        handle: list[Any] = []

        def after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if threading.get_ident() != self._thread:
                return
            while handle:
                handle.pop().remove()
            self._pop(meter, ctx)

        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            handle.append(register_optimizer_step_post_hook(after_step))
        except Exception as exc:
            self.error = self.error or f"could not arrange to pop the hooks: {exc}"

    # -- the timeline --------------------------------------------------------------------------
    def _level(self) -> int:
        meter = self._meter
        return self._offset + (meter.current if meter is not None else 0)

    def _recalibrate(self) -> None:
        """On CUDA, set the level right against the allocator's count (what no operator's
        outputs show: persistent workspaces, storages freed that were made before); how far it
        had drifted since the last event is kept (the plan's margin). Where the peak statistic
        may be reset (the caller's own process), the allocator's peak since the last event is
        the closing segment's highest level, kernels' workspaces included, and is reset."""
        if self.allocator is None or self._meter is None:
            return
        try:
            allocated, high = self.allocator()
            offset = allocated - self._meter.current
            if self._calibrated:
                # the allocator holds more than the levels counted: memory no operator returned
                # was made (the levels since the last event may have been low by it); less: a
                # storage the meter did not follow died (they were high by it)
                if offset > self._offset:
                    self._drift = max(self._drift, offset - self._offset)
                else:
                    self._drift_over = max(self._drift_over, self._offset - offset)
            self._calibrated = True
            self._offset = offset
            if self.reset_peak and self._cuda is not None:
                seg = len(self._plain) - 1
                if self._plain[seg] >= self._cached[seg]:
                    self._plain[seg] = max(self._plain[seg], high)
                else:
                    self._cached[seg] = max(self._cached[seg], high)
                self._cuda.reset_peak_memory_stats(self._device)
        except Exception as exc:
            self.error = self.error or f"allocator statistics: {exc}"

    def _cuda_allocated(self) -> tuple[int, int]:
        """The CUDA allocator's count of this device's bytes: (now, highest since its reset)."""
        stats = self._cuda.memory_stats(self._device)
        return int(stats.get("allocated_bytes.all.current", 0)), int(stats.get("allocated_bytes.all.peak", 0))

    def _on_op(self, current: int) -> None:
        level = self._offset + current
        seg = len(self._plain) - 1
        if level > self._plain[seg] or level > self._cached[seg]:  # autocast asked only then
            if self._amp():
                if level > self._cached[seg]:
                    self._cached[seg] = level
            elif level > self._plain[seg]:
                self._plain[seg] = level
        if level > self._blk_max:
            self._blk_max = level

    def _on_new(self, address: int, size: int) -> None:
        if len(self._born) < MAX_STORAGES:
            self._born[(address, size)] = len(self._plain) - 1

    def _on_free(self, address: int, size: int) -> None:
        """A storage died. When it was an input of blocks whose backward has not begun, a
        checkpoint of any of them would have kept it until its backward (a non-reentrant
        checkpoint keeps its inputs to recompute from): a segment begins before the next
        operator (or at the next block event), from which those blocks' checkpoints hold it.
        Called from the storage's weak reference, before its memory is released: the segment
        is not begun here, where the allocator's count still holds it."""
        if self.stopped or not self.started:
            return
        users = self._input_of.pop((address, size), None)
        if not users:
            return
        waiting = sorted(j for j in users if self._bwd_start[j] < 0 and len(self._kept[j]) < MAX_KEPT)
        if waiting and self._meter is not None:
            self._deaths.append((size, waiting))
            self._meter.cut = True

    def _event(self) -> int:
        """A new segment begins (at a block's forward start or end, or backward start, when
        autograd lets go of a tensor a block saved too, before the first operator after a block
        input died): its index."""
        if len(self._plain) >= MAX_SEGMENTS:
            self.error = self.error or "the step has too many block events; its timeline is cut"
        else:
            self._recalibrate()
            level = self._level()
            if self._amp():
                self._plain.append(0)
                self._cached.append(level)
            else:
                self._plain.append(level)
                self._cached.append(0)
        seg = len(self._plain) - 1
        if self._meter is not None:
            self._meter.cut = False
        while self._deaths:
            # block inputs that died since the last event or operator: kept from here
            size, waiting = self._deaths.pop(0)
            group = self._kept_groups
            self._kept_groups += 1
            for j in waiting:
                self._kept[j].append((seg, size, group))
        return seg

    def _stamp(self) -> Any:
        if self._cuda is not None:
            ev = self._cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self._cpu_now()

    def _cpu_now(self) -> float:
        """The CPU clock less what the measurement itself has cost so far (its saved-tensor hook,
        and each operator's trip through the dispatch mode, as calibrated at the start), so that a
        block's time is what it costs without the measurement."""
        ops = self._meter.ops if self._meter is not None else 0
        return self.clock() - self._hook_s - ops * self._per_op_s

    def _calibrate(self) -> None:
        """On the CPU: what one operator's trip through the dispatch mode costs (the median of
        five rounds of 64 small additions, with the mode and without)."""
        import statistics

        import torch

        a = torch.zeros(4)
        rounds = []
        probe = LiveTensorBytes(on_op=lambda current: None)
        for _ in range(5):
            t0 = self.clock()
            for _ in range(64):
                torch.add(a, 1)
            t1 = self.clock()
            with probe:
                for _ in range(64):
                    torch.add(a, 1)
            t2 = self.clock()
            rounds.append(((t2 - t1) - (t1 - t0)) / 64)
        probe.close()
        self._per_op_s = max(0.0, statistics.median(rounds))

    # -- hooks (on the training thread, during the measured step) ----------------------------
    def _pre(self, index: int) -> Callable[..., None]:
        def pre(module: Any, args: Any, kwargs: Any) -> None:
            if self.stopped:
                return
            why = self._not_the_step()
            if why:
                self._end_early(why)
                return
            if self._calls[index] and self._backward_seen and self._next_micro_batch():
                self._end_micro_batch()
                return
            try:
                self._hidden_by(index)
                self._packs_at[index] = self._own_packs[index]
                self._stack.append(index)
                if not self._order:  # the step's first block: its input's shape scales the plan (plan_scale)
                    first = next((a for a in (*args, *kwargs.values()) if _is_tensor(a)), None)
                    self._input_shape = [int(d) for d in first.shape][:8] if first is not None else []
                if not self._calls[index]:
                    self._first[index] = len(self._order)
                    self._order.append(index)
                self._calls[index] += 1
                for a in (*args, *kwargs.values()):
                    key = _storage(a) if _is_tensor(a) else None
                    if key is not None:
                        self._inputs[index].add(key)
                        # followed only where its death will be seen (one the meter counts)
                        meter = self._meter
                        if (
                            key not in self._param_keys
                            and meter is not None
                            and meter.counts(a)
                            and len(self._input_of) < MAX_STORAGES
                        ):
                            self._input_of.setdefault(key, set()).add(index)
                seg = self._event()
                if self._fwd_start[index] < 0:
                    self._fwd_start[index] = seg
                self._fwd_base[index] = self._level()
                self._blk_max = self._fwd_base[index]
                self._last_save[index] = None
                if self._cuda is not None:
                    self._events[index].append([self._stamp(), None, None])
                else:
                    self._t0[index] = self._cpu_now()
                    self._t0_raw[index] = self.clock()
            except Exception as exc:
                self.error = self.error or f"forward pre-hook: {exc}"

        return pre

    def _hidden_by(self, index: int) -> None:
        """Note when block ``index``'s saved tensors will not reach the measurement's hook: other
        saved-tensor hooks are pushed over it (activation offloading, ``save_on_cpu``; a
        checkpoint around the block), or a reentrant checkpoint runs its forward without grad."""
        import torch

        if index in self._hidden:
            return
        if not torch.is_grad_enabled():
            if _in_checkpoint():
                self._hidden[index] = "checkpointed"
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] == self._pack:
            return
        where = f"{getattr(top[0], '__module__', '')}.{getattr(top[0], '__qualname__', '')}"
        if "save_on_cpu" in where or "pack_to_cpu" in where:
            self._hidden[index] = "offloaded"
        elif "checkpoint" in where:
            self._hidden[index] = "checkpointed"
        else:
            self._hidden[index] = f"hooked ({where[-80:]})"

    def _next_micro_batch(self) -> bool:
        """Whether a block forward that runs again after a backward began is the next
        micro-batch of gradient accumulation (not a checkpoint's recompute inside backward)."""
        import torch

        return (
            torch._C._current_graph_task_id() == -1
            and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            and not _in_checkpoint()
        )

    def _end_micro_batch(self) -> None:
        """Gradient accumulation: the step's first micro-batch (its forward and backward) is
        measured; the next one's first block forward ends the measurement here, on the training
        thread. Later micro-batches have the same shapes and hold every gradient from their
        start (:meth:`result` adds the gradients made during the first one to the segments
        before they were made); the optimizer step after the last is not measured."""
        self.accumulation = True
        self.notes.append(
            "gradient accumulation: a block ran forward again after a backward before the optimizer step; the "
            "first micro-batch was measured (its forward and backward) and the others are taken to be like it "
            "with every gradient held from their start. The optimizer step after the last micro-batch is not in "
            "the measurement (its level: parameters, gradients, optimizer state and the optimizer's temporaries)"
        )
        self.stop()
        self.freeze()

    def _not_the_step(self) -> str:
        """Why the forward about to run is not part of the measured step (empty when it is):
        a forward without grad saves nothing for a backward (an evaluation, or the job past its
        last optimizer step), and a step past the time limit is not coming to its end."""
        import torch

        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            # not a checkpoint's recompute in backward, nor a reentrant checkpoint's first
            # forward (which runs without grad by design)
            if torch._C._current_graph_task_id() == -1 and not _in_checkpoint():
                return (
                    "a forward ran without grad before the step's optimizer step (an evaluation, or the job's "
                    "training is over); the measurement was removed"
                )
        if self.time_limit_s is not None and time.perf_counter() - self._step_t0 > self.time_limit_s:
            return (
                f"no optimizer step within {self.time_limit_s:.0f} s of the measured step's start; "
                "the measurement was removed"
            )
        return ""

    def _end_early(self, why: str) -> None:
        """End the measurement from inside a forward pre-hook, on the training thread (torch
        iterates a copy of the hook tables there, so the hooks may be removed)."""
        if self.stopped:
            return
        self.ended_early = why
        self.stop()
        self.release()
        on_end = self.on_end
        if on_end is not None:
            try:
                on_end(why)
            except Exception as exc:
                self.error = self.error or f"ending the measurement: {exc}"

    def _post(self, index: int) -> Callable[..., None]:
        def post(module: Any, args: Any, output: Any) -> None:
            if self.stopped:
                return
            try:
                if self._stack and self._stack[-1] == index:
                    self._stack.pop()
                if self._cuda is not None:
                    if self._events[index]:
                        call = self._events[index][-1]
                        call[1] = self._last_save[index]
                        call[2] = self._stamp()
                else:
                    now = self._cpu_now()
                    own = now - self._t0[index]
                    # What the meter's cost leaves of the block's time, never under a share of
                    # what it took measured: the calibration is noisy on a loaded machine, and
                    # no block is free to recompute.
                    floor = MIN_OWN_SHARE * max(0.0, self.clock() - self._t0_raw[index])
                    self._fwd[index] += max(own, floor)
                    last = self._last_save[index]
                    if last is not None:
                        self._recompute[index] += max(last - self._t0[index], 0.0) if own > floor else floor
                self._fwd_end[index] = self._event()
                if self._own_packs[index] == self._packs_at[index] and index not in self._hidden:
                    # it ran with grad and saved nothing it made through the measurement's hook
                    # (its inputs at most): another saved-tensor hook took its tensors (a
                    # checkpoint inside its forward: the plan's own recipe, torch.utils.checkpoint
                    # called in it)
                    if _grad_output(output):
                        self._hidden[index] = "checkpointed"
            except Exception as exc:
                self.error = self.error or f"forward hook: {exc}"

        return post

    def _pack(self, t: Any) -> Any:
        if self.stopped:
            return t
        entered = self.clock() if self._cuda is None else 0.0
        owner = self._stack[-1] if self._stack else -1
        try:
            self._packs += 1
            if owner >= 0 and _storage(t) not in self._inputs[owner]:
                # made in its forward (a checkpoint saves only the block's inputs)
                self._own_packs[owner] += 1
                # a non-reentrant checkpoint's recompute stops at the block's last save
                rise = self._blk_max - self._fwd_base[owner]
                if rise > self._rise[owner]:
                    self._rise[owner] = rise
                self._last_save[owner] = self._stamp()
            key = _storage(t)
            if key is not None and key not in self._param_keys:
                if key not in self._owners:
                    # its birth, read now while it is alive (its address may serve another later)
                    self._saved_born[key] = self._born.get(key, -1)
                self._owners.setdefault(key, set()).add(owner)
                if owner >= 0 and _is_param_cast(t) and self._amp():
                    import torch

                    if torch.is_autocast_cache_enabled():
                        self._casts.add(key)
        except Exception as exc:
            self.error = self.error or f"pack hook: {exc}"
        if self._cuda is None:
            self._hook_s += self.clock() - entered
        # what autograd keeps is the tensor itself, with the block that saved it beside it
        return _Saved(owner, t, self)

    def _unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Saved):
            return packed
        t = packed.tensor
        if self.stopped:
            return t
        self._backward_seen = True
        if self._backward_alloc < 0 and self._cuda is not None:
            try:
                self._backward_alloc = int(self._cuda.memory_allocated(self._device))
            except Exception:
                self._backward_alloc = 0
        try:
            k = packed.owner
            if k >= 0 and self._bwd_start[k] < 0:
                # the first tensor of this block's own backward: where a checkpoint recomputes it
                self._bwd_start[k] = self._event()
                self._bwd_level[k] = self._level()
        except Exception as exc:
            self.error = self.error or f"unpack hook: {exc}"
        return t

    def _let_go(self, owner: int, t: Any) -> None:
        """Autograd released a tensor that ``owner`` saved. When a block saved it too, the block's
        checkpoint frees it from now on: a segment begins here."""
        if self.stopped or not self.started:
            return
        key = _storage(t)
        owners = self._owners.get(key) if key is not None else None
        if key is None or not owners or not any(o >= 0 and o != owner for o in owners):
            return
        if all(self._bwd_start[o] >= 0 for o in owners if o >= 0):
            return  # every block that saved it is in its backward already
        if len(self._released) < MAX_STORAGES:
            self._released[(key, owner)] = self._event()

    # -- the answer --------------------------------------------------------------------------
    def release(self) -> None:
        """Let go of every reference to the job's objects (its models, blocks, optimizers and the
        meter's tensors), on the training thread, once the hooks are off: what is left is plain
        data and dynprof's own CUDA events."""
        if self._meter is not None:
            self._ops = self._meter.ops
            self._meter = None
        self.roots = []
        self.optimizers = []
        self.blocks = [(name, None) for name, _m in self.blocks]

    def freeze(self) -> None:
        """Read what the answer needs of the job's objects (the parameters', gradients' and
        optimizer state's bytes, each block's class and parameter bytes, the allocator's peak)
        and :meth:`release` them. On the training thread, after :meth:`stop`; :meth:`result`
        then reads plain data only, on any thread."""
        if self._frozen is not None:
            return
        import torch

        seen: set[tuple[int, int]] = set()
        grad_sized: set[int] = set()
        grad_keys: list[tuple[int, int]] = []
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
                        key = _storage(p.grad)
                        if key is not None and len(grad_keys) < MAX_STORAGES:
                            grad_keys.append(key)
                    elif getattr(p, "requires_grad", False) and id(p) not in grad_sized:
                        # zeroed (set to None) since backward: its gradient is as large as it
                        grad_sized.add(id(p))
                        grads += int(p.numel()) * int(p.element_size())
            for per in list((getattr(opt, "state", {}) or {}).values()):
                if isinstance(per, dict):
                    for v in per.values():
                        if isinstance(v, torch.Tensor) and v.dim() > 0:
                            state += count(v)
        for root in self.roots:
            for p in root.parameters():  # parameters no optimizer steps (frozen) hold memory too
                params += count(p)
        frozen: dict[str, Any] = {
            "params": params,
            "grads": grads,
            "state": state,
            "classes": self._classes,
            "block_params": [
                sum(p.numel() * p.element_size() for p in m.parameters()) if m is not None else 0
                for _name, m in self.blocks
            ],
            # what makes two blocks the same work: class and parameters' shapes and types
            "kinds": [block_kind(m) for _name, m in self.blocks],
            "process_peak": 0,
            "grad_keys": grad_keys,
        }
        if self._cuda is not None and not self.reset_peak:
            frozen["process_peak"] = int(torch.cuda.max_memory_allocated(torch.device(self._device)))
        self._frozen = frozen
        self.release()

    def _wait_for_events(self, timeout_s: float = 120.0) -> None:
        """Wait until the GPU has run past every event the measured step recorded (polling:
        a query never blocks), at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        ends = [call[2] for calls in self._events for call in calls if call[2] is not None]
        while not all(ev.query() for ev in ends):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the GPU did not finish the measured step's work within {timeout_s:.0f} s")
            time.sleep(0.01)

    def result(self) -> dict[str, Any]:
        """The measurement's document (:class:`collectors.memory.plan.Measurement`'s JSON).
        Reads only plain data (after :meth:`freeze`, which it calls first where it was not)."""
        self.freeze()
        frozen = self._frozen or {}
        n = len(self.blocks)
        segments = len(self._plain)
        freeable = [0] * n
        saved = [0] * n
        casts = [0] * n
        late: list[dict[int, int]] = [{} for _ in range(n)]
        outside = 0
        activation = 0
        fe = [x if x >= 0 else segments for x in self._fwd_end]
        bs = [x if x >= 0 else segments for x in self._bwd_start]

        def made_in(o: int, key: tuple[int, int]) -> bool:
            # made during block o's forward, so its checkpoint does not keep it (not an input, a
            # buffer, a table made before: those live on whatever is recomputed)
            born = self._saved_born.get(key, -1)
            return o >= 0 and 0 <= self._fwd_start[o] <= born < fe[o] and key not in self._inputs[o]

        for key, owners in self._owners.items():
            size = key[1]
            activation += size
            if len(owners) == 1:
                (owner,) = owners
                if owner >= 0:
                    saved[owner] += size
            makers = [o for o in owners if made_in(o, key)]
            if len(makers) == 1:
                k = makers[0]
                if len(owners) == 1:
                    freeable[k] += size
                    if key in self._casts:
                        casts[k] += size
                    continue
                # others saved it too (a next block as its input, an operator outside the
                # blocks): checkpointing k frees it only once they are done with it
                done = max(self._released.get((key, o), segments) for o in owners if o != k)
                start = max(done, fe[k])
                if start < bs[k]:
                    late[k][start] = late[k].get(start, 0) + size
            outside += size
        if self._cuda is not None:
            self._wait_for_events()
            for i, calls in enumerate(self._events):
                total = recompute = 0.0
                for start, last, end in calls:
                    if end is None:
                        continue
                    total += start.elapsed_time(end) / 1000.0
                    if last is not None:
                        recompute += start.elapsed_time(last) / 1000.0
                self._fwd[i] = total
                self._recompute[i] = recompute
        if self.accumulation and not self._shifted:
            self._shifted = True  # result() may be read twice: the levels are moved once
            # later micro-batches hold from their start the gradients the first one made
            for key in frozen.get("grad_keys") or []:
                born = self._born.get(key, -1)
                for i in range(min(born, segments)):
                    if self._plain[i]:
                        self._plain[i] += key[1]
                    if self._cached[i]:
                        self._cached[i] += key[1]
            # and, in their backward, the incoming gradient of a parameter beside the one held
            # (accumulated into it: the first micro-batch's backward keeps the incoming one)
            sizes = [key[1] for key in frozen.get("grad_keys") or []]
            first = min((b for b in self._bwd_start if b >= 0), default=segments)
            for i in range(first, segments):
                if self._plain[i]:
                    self._plain[i] += max(sizes, default=0)
                if self._cached[i]:
                    self._cached[i] += max(sizes, default=0)
        hidden = {i: why for i, why in self._hidden.items() if 0 <= i < n}
        for why in sorted(set(hidden.values())):
            names = [self.blocks[i][0] for i in sorted(hidden) if hidden[i] == why]
            listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            if why == "offloaded":
                self.notes.append(
                    f"the job offloads activations to host memory (torch.autograd.graph.save_on_cpu) in {listed}: "
                    "their saved tensors are not on the device, the plan sees none of them, and recomputing "
                    "those blocks would save nothing; they are left out of the plan"
                )
            elif why == "checkpointed":
                self.notes.append(
                    f"the job checkpoints {listed} already (a checkpoint's saved-tensor hooks took their tensors, "
                    "or a reentrant checkpoint ran them without grad); they are left out of the plan"
                )
            else:
                self.notes.append(
                    f"other saved-tensor hooks ({why[7:]}) took the saved tensors of {listed}: they are left out "
                    "of the plan"
                )
        fwd_s, recompute_s = shared_costs(
            frozen.get("kinds") or [""] * n,
            self._calls,
            self._fwd,
            [min(r, f) for r, f in zip(self._recompute, self._fwd)],
        )
        params, grads, state = frozen["params"], frozen["grads"], frozen["state"]
        timeline = [[self._plain[i], self._cached[i]] for i in range(segments)]
        tracked_peak = max((max(a, b) for a, b in timeline), default=0)
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "device": self._device,
            "blocks": [
                {
                    "name": name,
                    "class": frozen["classes"][i],
                    "saved_bytes": saved[i],
                    "freeable_bytes": freeable[i],
                    "cast_bytes": casts[i],
                    "forward_s": round(fwd_s[i], 9),
                    "recompute_s": round(recompute_s[i], 9),
                    "measured_forward_s": round(self._fwd[i], 9),
                    "recompute_bytes": max(self._rise[i], freeable[i]),
                    "forward_end": self._fwd_end[i] if self._fwd_end[i] >= 0 else segments,
                    "backward_start": self._bwd_start[i] if self._bwd_start[i] >= 0 else segments,
                    "backward_start_bytes": self._bwd_level[i],
                    # bytes its checkpoint frees from a later segment on (others saved them too)
                    "late_freeable": [[seg, b] for seg, b in sorted(late[i].items())[:MAX_LATE]],
                    # its inputs that died before its backward: its checkpoint keeps them from
                    # that segment through its backward's (group: the storage, shared by blocks)
                    "kept_inputs": [[seg, b, g] for seg, b, g in self._kept[i][:MAX_KEPT]],
                    "calls": self._calls[i],
                    "parameter_bytes": frozen["block_params"][i],
                    "checkpointed": name in self.skipped or i in hidden,
                }
                # in the order of their first forward call (backward runs them in reverse)
                for i, (name, _m) in sorted(enumerate(self.blocks), key=lambda x: (self._first[x[0]], x[0]))
            ],
            "timeline": timeline,
            "activation_bytes": activation,
            "unrecomputable_activation_bytes": outside,
            "parameter_bytes": params,
            "gradient_bytes": grads,
            "optimizer_state_bytes": state,
            "saved_tensors": self._packs,
            "operators": self._meter.ops if self._meter is not None else self._ops,
            "operator_overhead_s": round(self._per_op_s, 9),
            "step_s": round(self.step_s, 6),
            "notes": list(self.notes),
            "error": self.error,
        }
        if self._cuda is not None:
            if self.reset_peak:
                # reset at every event: each segment holds the allocator's own peak in it
                peak = tracked_peak
                source = "torch.cuda.max_memory_allocated during the step, segment by segment"
                untracked = 0
            else:
                process = int(frozen["process_peak"])
                # what the allocator's peak holds beyond the highest level seen after an
                # operator: memory allocated and freed inside one (a kernel's workspace)
                untracked = max(0, process - tracked_peak)
                if process > self._peak_before:
                    source = "torch.cuda.max_memory_allocated during the step"
                else:
                    source = "the step's levels and the process's torch.cuda.max_memory_allocated (the step did not raise it)"
                if untracked > UNTRACKED_CAP * tracked_peak:
                    doc["notes"].append(
                        f"the process's peak ({process} bytes) is {untracked} bytes above this step's highest level: "
                        "it was set outside this step (a larger batch, an evaluation?); the plan uses this step's levels"
                    )
                    untracked = int(UNTRACKED_CAP * tracked_peak)
                peak = tracked_peak + untracked
                doc["process_peak_bytes"] = process
            doc["peak_bytes"] = peak
            doc["peak_source"] = source
            doc["allocated_at_backward_bytes"] = max(self._backward_alloc, 0)
            doc["temporary_bytes"] = max(0, peak - params - grads - state - activation)
            doc["untracked_bytes"] = untracked
            # how far the levels followed op by op fell short of the allocator's count between
            # two events (memory no operator returned): the plan's margin; and how far they went
            # over it (a death not seen: the levels were high, the plan on the safe side)
            doc["drift_bytes"] = self._drift
            doc["drift_over_bytes"] = self._drift_over
        else:
            doc["peak_bytes"] = tracked_peak
            doc["peak_source"] = "live tensor bytes after each operator (CPU)"
            doc["temporary_bytes"] = max(0, tracked_peak - params - grads - state - activation)
            doc["untracked_bytes"] = 0
            doc["drift_bytes"] = self._drift  # none unless a count was given (a test's)
            doc["drift_over_bytes"] = self._drift_over
        doc["preexisting_bytes"] = self._preexisting_bytes
        doc["input_shape"] = list(self._input_shape)
        return doc


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


def shared_costs(
    kinds: list[str], calls: list[int], forward_s: list[float], recompute_s: list[float]
) -> tuple[list[float], list[float]]:
    """Each block's forward and recompute seconds, the same for equal blocks (same kind, same
    calls): the median of theirs. One block's time in one step is one sample of a noisy clock
    (a CPU's other load, a GPU's clocks); equal blocks do the same work, so their median is the
    better estimate of each, and two plans of one job no longer differ by which of equal blocks
    happened to be timed high (seen: +36.6 ms and then +49.0 ms for the same budget)."""
    import statistics

    groups: dict[tuple[str, int], list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind:
            groups.setdefault((kind, calls[i]), []).append(i)
    fwd, rec = list(forward_s), list(recompute_s)
    for members in groups.values():
        if len(members) < 2:
            continue
        f = statistics.median(forward_s[i] for i in members)
        r = statistics.median(recompute_s[i] for i in members)
        for i in members:
            fwd[i], rec[i] = f, min(r, f)
    return fwd, rec


def _in_checkpoint(depth: int = 48) -> bool:
    """Whether an activation-checkpointing function is on the calling thread's stack
    (``torch.utils.checkpoint``, DeepSpeed's ``checkpointing.py``: a file named so)."""
    import os
    import sys

    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        if "checkpoint" in os.path.basename(frame.f_code.co_filename):
            return True
        frame = frame.f_back  # type: ignore[assignment]
        depth -= 1
    return False


def _grad_output(output: Any) -> bool:
    """Whether a block's output (a tensor, or a tuple or list or dict holding some) requires grad."""
    if isinstance(output, dict):
        output = list(output.values())
    items = output if isinstance(output, (list, tuple)) else [output]
    return any(getattr(x, "requires_grad", False) for x in items[:64])


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def measure_step(
    model: Any,
    optimizer: Any,
    step: Callable[[], Any],
    reset_peak: bool = False,
    overhead_of: float | None = None,
    clock: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Run ``step()`` once with the measurement's hooks and return the measurement's document.

    ``model`` is an ``nn.Module`` or a list of them, ``optimizer`` an optimizer or a list.
    ``reset_peak`` resets the CUDA peak statistic first (the caller's own process only: the
    agent never does). ``overhead_of``: a typical step's seconds, to report the measured
    step's extra cost against. Raises :class:`MeasurementRefused` when the step cannot be
    measured right; every hook is removed whether the step raises or not. ``clock`` times the
    blocks on the CPU (``time.perf_counter`` unless given; a benchmark on a shared machine may
    pass ``time.process_time``)."""
    roots = list(model) if isinstance(model, (list, tuple)) else [model]
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    m = StepMeasurement(roots, optimizers, reset_peak=reset_peak, clock=clock)
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
