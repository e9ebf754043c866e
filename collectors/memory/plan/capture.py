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

A storage is *freeable* by checkpointing block B when it was made during B's forward, only B
saved it (not an input of B: a checkpoint keeps its inputs; not a buffer or a table made
before), and autograd still held it when B's backward began: one whose graph branch the step
dropped before then (a router's scores read only by argmax) is not held by the step, so B's
checkpoint frees nothing of it. One that others saved too (the next block, as its input; an operator outside the
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
from collections.abc import Callable
from typing import Any

from collectors.memory.plan.blocks import (
    CHECKPOINT_CLASSES,
    COMPILED_HELP,
    MeasurementRefused,
    _limits,
    compiled_code,
    find_blocks,
    live_tensors,
)
from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.meter import LiveTensorBytes, _autocast_nested, _is_param_cast, _storage
from collectors.memory.plan.result import StepResult
from collectors.memory.plan.solve import make_plan
from collectors.memory.plan.timeline import MAX_STORAGES, StepTimeline
from collectors.memory.plan.timing import (
    BlockTimer,
    apply_timer,
    in_checkpoint,
    not_the_step,
    on_cuda,
    remove_hooks,
)

MIN_OWN_SHARE = 0.05  # a block's CPU time is at least this share of its time under the measurement


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


class StepMeasurement(StepTimeline, StepResult):
    """Hooks for one step: :meth:`start` before it, :meth:`stop` after it, :meth:`result` then.

    Besides each block's saved bytes and forward time, it records the step's memory *timeline*:
    the live bytes after every operator (:class:`LiveTensorBytes`; on CUDA set right against
    ``memory_allocated`` at every block event), cut into segments at each block's forward
    start, forward end and backward start (the first time backward unpacks a tensor the block
    saved), each segment keeping its highest level, apart for the operators run while autocast
    (and so its cache of parameter casts) is on. With it, :mod:`.predict` predicts the peak of any
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
            if type(m).__name__ in CHECKPOINT_CLASSES or getattr(m, "gradient_checkpointing", False)
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
        # storage -> the copies autograd holds of it (a storage saved twice is held twice)
        self._holds: dict[tuple[int, int], int] = {}
        # storages a block alone saved that autograd let go of before that block's backward (the
        # graph branch was dropped: an output only a non-differentiable operator read, such as a
        # router's scores under argmax): the step does not hold them, so a checkpoint frees nothing
        self._dropped: set[tuple[int, int]] = set()
        self._bwd_level: list[int] = [0] * n
        self._meter: LiveTensorBytes | None = None
        self._meter_entered = False
        self._cuda: Any = None
        self._device = "cpu"
        self._peak_before = 0
        self._packs = 0
        self._backward_alloc = -1
        self.step_s = 0.0
        self.timed: dict[str, float] | None = None  # set by the caller from a BlockTimer (.timing)
        self.timed_steps = 0
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
        remove_hooks(handles)
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
                if not self._order:  # the step's first block: its input's shape scales the plan (.scale)
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
            if in_checkpoint():
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
            and not in_checkpoint()
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
        """Why the forward about to run is not part of the measured step (empty when it is)."""
        return not_the_step(self._step_t0, self.time_limit_s, "of the measured step's start", "the measurement")

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
                self._holds[key] = self._holds.get(key, 0) + 1
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
        if key is not None and key in self._holds:
            self._holds[key] -= 1
            if (
                self._holds[key] <= 0
                and owners == {owner}
                and owner >= 0
                and self._bwd_start[owner] < 0
                and len(self._dropped) < MAX_STORAGES
            ):
                self._dropped.add(key)
        if key is None or not owners or not any(o >= 0 and o != owner for o in owners):
            return
        if all(self._bwd_start[o] >= 0 for o in owners if o >= 0):
            return  # every block that saved it is in its backward already
        if len(self._released) < MAX_STORAGES:
            self._released[(key, owner)] = self._event()


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
    timed_steps: int = 0,
) -> dict[str, Any]:
    """Run ``step()`` ``timed_steps`` times with only the blocks' timer (:mod:`.timing`), then
    once with the measurement's hooks, and return the measurement's document.

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
    timer = BlockTimer(m.blocks, cuda=on_cuda(m.blocks), clock=clock) if timed_steps else None
    if timer is not None:
        try:
            timer.start()
            for _ in range(timed_steps):
                step()
                timer.boundary()
        finally:
            timer.stop()
        apply_timer(m, timer)
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


def plan_step(
    model: Any,
    optimizer: Any,
    step: Callable[[], Any],
    budget: int | None = None,
    save: int | None = None,
    reset_peak: bool = False,
) -> dict[str, Any]:
    """In-process: measure one ``step()`` and plan for ``budget`` (bytes) or ``save`` (bytes)."""
    return make_plan(from_json(measure_step(model, optimizer, step, reset_peak=reset_peak)), budget=budget, save=save)
