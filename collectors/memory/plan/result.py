"""The measured step's answer: what :class:`collectors.memory.plan.capture.StepMeasurement`
keeps of the job's objects once the step is over (:meth:`StepResult.freeze`, on the training
thread) and the measurement's document made from plain data (:meth:`StepResult.result`, read as
:class:`collectors.memory.plan.measurement.Measurement`), in named parts: each block's saved,
freeable and later-freed bytes, its GPU times, the levels of later micro-batches, the notes on
blocks whose tensors another hook took, the blocks' entries and the peak.
Imports no torch until asked.
"""

from __future__ import annotations

import time
from typing import Any

from collectors.memory.plan.blocks import block_kind
from collectors.memory.plan.measurement import MAX_KEPT, MAX_LATE, SCHEMA
from collectors.memory.plan.meter import LiveTensorBytes, _storage
from collectors.memory.plan.timeline import MAX_STORAGES

# Beyond this share of the step's highest level, a process peak the step did not raise is not
# this step's (it is noted, and this much is taken as the step's unseen part).
UNTRACKED_CAP = 0.05


class StepResult:
    """The answer's part of :class:`~collectors.memory.plan.capture.StepMeasurement`."""

    # set by StepMeasurement.__init__ and its hooks
    roots: list[Any]
    optimizers: list[Any]
    blocks: list[tuple[str, Any]]
    notes: list[str]
    skipped: set[str]
    reset_peak: bool
    accumulation: bool
    step_s: float
    error: str
    # each block's median forward seconds per call in plain steps (.timing), and how many steps
    timed: dict[str, float] | None
    timed_steps: int
    _meter: LiveTensorBytes | None
    _cuda: Any
    _device: str
    _frozen: dict[str, Any] | None
    _ops: int
    _classes: list[str]
    _events: list[list[Any]]
    _owners: dict[tuple[int, int], set[int]]
    _casts: set[tuple[int, int]]
    _inputs: list[set[tuple[int, int]]]
    _saved_born: dict[tuple[int, int], int]
    _released: dict[tuple[tuple[int, int], int], int]
    _dropped: set[tuple[int, int]]
    _born: dict[tuple[int, int], int]
    _fwd_start: list[int]
    _fwd_end: list[int]
    _bwd_start: list[int]
    _bwd_level: list[int]
    _rise: list[int]
    _fwd: list[float]
    _recompute: list[float]
    _calls: list[int]
    _first: list[int]
    _kept: list[list[tuple[int, int, int]]]
    _hidden: dict[int, str]
    _plain: list[int]
    _cached: list[int]
    _shifted: bool
    _packs: int
    _per_op_s: float
    _peak_before: int
    _backward_alloc: int
    _drift: int
    _drift_over: int
    _preexisting_bytes: int
    _input_shape: list[int]

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
        """The measurement's document (:class:`collectors.memory.plan.measurement.Measurement`'s
        JSON). Reads only plain data (after :meth:`freeze`, which it calls first where it was not)."""
        self.freeze()
        frozen = self._frozen or {}
        n = len(self.blocks)
        segments = len(self._plain)
        saved, freeable, casts, late, activation, outside = self._saved_bytes(segments)
        if self._cuda is not None:
            self._gpu_times()
        if self.accumulation and not self._shifted:
            self._shifted = True  # result() may be read twice: the levels are moved once
            self._hold_later_micro_batches(frozen, segments)
        hidden = {i: why for i, why in self._hidden.items() if 0 <= i < n}
        self._note_hidden(hidden)
        params, grads, state = frozen["params"], frozen["grads"], frozen["state"]
        timeline = [[self._plain[i], self._cached[i]] for i in range(segments)]
        tracked_peak = max((max(a, b) for a, b in timeline), default=0)
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "device": self._device,
            "blocks": self._block_docs(frozen, segments, saved, freeable, casts, late, hidden),
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
            # the plain steps whose median timed the blocks' forward (0: the measured step did)
            "timed_steps": self.timed_steps if self.timed else 0,
            "notes": list(self.notes),
            "error": self.error,
        }
        self._peak_fields(doc, frozen, tracked_peak, params + grads + state + activation)
        doc["preexisting_bytes"] = self._preexisting_bytes
        doc["input_shape"] = list(self._input_shape)
        return doc

    def _saved_bytes(self, segments: int) -> tuple[list[int], list[int], list[int], list[dict[int, int]], int, int]:
        """Per block: the bytes only it saved, those its checkpoint frees (made in its forward,
        saved by it alone), of those autocast's parameter casts, and (segment -> bytes) those it
        frees once the others that saved them too are done with them; then all the saved bytes,
        and those no block can free."""
        n = len(self.blocks)
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
            if len(makers) == 1 and key in self._dropped:
                # its only saver's graph branch was dropped before that block's backward: the
                # step does not hold it then, a checkpoint frees nothing of it
                outside += size
                continue
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
        return saved, freeable, casts, late, activation, outside

    def _gpu_times(self) -> None:
        """On CUDA: each block's forward and recompute seconds, from its events (once the GPU
        has run past them)."""
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

    def _plain_times(self) -> tuple[list[float], list[float]]:
        """Each block's forward and recompute seconds in the step. Where the plain steps before
        the measured one timed the block (:mod:`.timing`: ``timed``, its median seconds per
        call), its forward is that per call times its calls in the measured step, and its
        recompute the same share of it as in the measured step (a non-reentrant checkpoint
        recomputes up to the block's last saved tensor); else the measured step's own."""
        timed = self.timed or {}
        fwd = list(self._fwd)
        rec = [min(r, f) for r, f in zip(self._recompute, self._fwd)]
        for i, (name, _m) in enumerate(self.blocks):
            per_call = timed.get(name)
            if per_call is None or not self._calls[i]:
                continue
            share = rec[i] / fwd[i] if fwd[i] > 0 else 1.0
            fwd[i] = per_call * self._calls[i]
            rec[i] = share * fwd[i]
        return fwd, rec

    def _hold_later_micro_batches(self, frozen: dict[str, Any], segments: int) -> None:
        """Gradient accumulation: the levels of the micro-batches after the measured one."""
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

    def _note_hidden(self, hidden: dict[int, str]) -> None:
        """A note for each reason blocks' saved tensors did not reach the measurement."""
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

    def _block_docs(
        self,
        frozen: dict[str, Any],
        segments: int,
        saved: list[int],
        freeable: list[int],
        casts: list[int],
        late: list[dict[int, int]],
        hidden: dict[int, str],
    ) -> list[dict[str, Any]]:
        """The blocks' entries, in the order of their first forward call."""
        n = len(self.blocks)
        fwd, rec = self._plain_times()
        fwd_s, recompute_s = shared_costs(frozen.get("kinds") or [""] * n, self._calls, fwd, rec)
        return [
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
        ]

    def _peak_fields(self, doc: dict[str, Any], frozen: dict[str, Any], tracked_peak: int, counted: int) -> None:
        """The peak, its source and its unseen part into ``doc`` (``counted``: parameters,
        gradients, optimizer state and activations; the rest of the peak is temporaries)."""
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
            doc["temporary_bytes"] = max(0, peak - counted)
            doc["untracked_bytes"] = untracked
            # how far the levels followed op by op fell short of the allocator's count between
            # two events (memory no operator returned): the plan's margin; and how far they went
            # over it (a death not seen: the levels were high, the plan on the safe side)
            doc["drift_bytes"] = self._drift
            doc["drift_over_bytes"] = self._drift_over
        else:
            doc["peak_bytes"] = tracked_peak
            doc["peak_source"] = "live tensor bytes after each operator (CPU)"
            doc["temporary_bytes"] = max(0, tracked_peak - counted)
            doc["untracked_bytes"] = 0
            doc["drift_bytes"] = self._drift  # none unless a count was given (a test's)
            doc["drift_over_bytes"] = self._drift_over


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
