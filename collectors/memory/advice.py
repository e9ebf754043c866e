"""What a memory report says beyond the snapshot's figures: what to do about them.

* :func:`size_classes` groups a snapshot's blocks by pool and size class, for reports without
  allocation stacks.
* :func:`advise` turns the summary's figures into advice, each with the number that triggered it.

Who holds the memory (parameters, gradients, optimizer state, the failing frames' tensors) is
found in the training process at OOM: :func:`collectors.memory.capture.job_attribution`.
"""

from __future__ import annotations

from typing import Any

from collectors.memory.plan.measurement import from_json
from collectors.memory.plan.scale import MAX_SIZE_FACTOR, blocks_text, input_shape, scale, tokens_factor
from collectors.memory.plan.solve import make_plan

SIZE_CLASSES = (
    ("< 1 MiB", 1 << 20),
    ("1-16 MiB", 16 << 20),
    ("16-256 MiB", 256 << 20),
    ("256 MiB-2 GiB", 2 << 30),
    (">= 2 GiB", 1 << 62),
)

# Advice thresholds (fractions of the failing device's memory unless said otherwise).
FRAGMENTED_FREE = 0.10  # cached free memory at least this much of the device ...
FRAGMENTATION = 0.5  # ... and this fragmented
OTHERS_HOLD = 0.10  # memory held outside this process's allocator
OPTIMIZER_DOMINATES = 0.35  # optimizer state's share of allocated memory
GRADIENTS_DOMINATE = 0.25
SITE_DOMINATES = 0.40  # one allocation site's share of allocated memory
ACTIVATIONS_DOMINATE = 0.50  # what is neither parameters, gradients, optimizer state nor held by frames
FRAME_DOMINATES = 0.25  # one local of the failing frames (a tensor, or a list of them)


def size_classes(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """Blocks per device, pool (small/large segments), state (allocated/free) and size class:
    a picture of who holds memory even where no stacks were recorded."""
    table: dict[tuple[int, str, str, str], dict[str, Any]] = {}
    for seg in snapshot.get("segments", []) or []:
        device = int(seg.get("device", 0) or 0)
        pool = "small" if seg.get("segment_type") == "small" else "large"
        for block in seg.get("blocks", []) or []:
            size = int(block.get("size", 0) or 0)
            state = "allocated" if block.get("state") == "active_allocated" else "free"
            label = next(name for name, limit in SIZE_CLASSES if size < limit)
            row = table.setdefault(
                (device, pool, state, label),
                {"device": device, "pool": pool, "state": state, "size_class": label, "blocks": 0, "bytes": 0},
            )
            row["blocks"] += 1
            row["bytes"] += size
    order = {name: i for i, (name, _) in enumerate(SIZE_CLASSES)}
    return sorted(table.values(), key=lambda r: (r["device"], r["pool"], r["state"], order[r["size_class"]]))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def advise(summary: dict[str, Any]) -> list[dict[str, str]]:
    """Advice from a memory summary: each item has ``rule``, ``reason`` (the figures that
    triggered it) and ``advice``. Nothing is advised without its number."""
    out: list[dict[str, str]] = []
    oom = summary.get("failing_allocation") or summary.get("oom") or {}
    devices = {int(d.get("device", 0)): d for d in summary.get("devices", []) or []}
    failing = int(oom.get("device", next(iter(devices), 0)) or 0)
    d = devices.get(failing, {})
    limit = int(oom.get("device_limit_bytes", 0) or 0)
    device_free = int(oom.get("device_free_bytes", 0) or 0)
    requested = int(oom.get("requested_bytes", 0) or 0)
    reserved = int(d.get("reserved_bytes", 0) or 0)
    allocated = int(d.get("allocated_bytes", 0) or 0)
    inactive = int(d.get("inactive_bytes", 0) or 0)
    largest_free = int(d.get("largest_inactive_block", 0) or 0)
    frag = float(d.get("fragmentation", 0.0) or 0.0)
    scale = limit or reserved

    if (
        scale
        and inactive >= FRAGMENTED_FREE * scale
        and frag >= FRAGMENTATION
        and (not requested or largest_free < requested)
    ):
        need = f", the request was {_gib(requested)}" if requested else ""
        out.append(
            {
                "rule": "fragmentation",
                "reason": f"{_gib(inactive)} of cached memory is free on cuda:{failing} "
                f"({inactive / scale * 100:.0f} % of the device) but in pieces: the largest is {_gib(largest_free)}"
                f"{need} (fragmentation {frag:.2f})",
                "advice": "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so that segments grow "
                "in place instead of leaving gaps between fixed-size ones",
            }
        )
    elif scale and inactive >= FRAGMENTED_FREE * scale and requested and largest_free >= requested:
        out.append(
            {
                "rule": "cache",
                "reason": f"{_gib(inactive)} is cached but unallocated on cuda:{failing}, and its largest free "
                f"block ({_gib(largest_free)}) could hold the {_gib(requested)} request: the cache is held "
                "by another stream or pool",
                "advice": "allocations on side streams keep their blocks until those streams sync; call "
                "torch.cuda.empty_cache() between phases that use different streams or memory pools "
                "(e.g. CUDA graphs), or give a side stream's tensors record_stream",
            }
        )
    if limit and reserved and device_free >= 0:
        elsewhere = limit - reserved - device_free
        if elsewhere >= OTHERS_HOLD * limit:
            out.append(
                {
                    "rule": "held-elsewhere",
                    "reason": f"{_gib(elsewhere)} of cuda:{failing}'s {_gib(limit)} is held outside this process's "
                    f"caching allocator (device {_gib(limit)} - reserved {_gib(reserved)} - free {_gib(device_free)})",
                    "advice": "another process on this GPU, or memory this process took outside PyTorch's "
                    "allocator (CUDA context, NCCL buffers, cuBLAS workspaces, other libraries): check "
                    "nvidia-smi for other processes; NCCL_BUFFSIZE and TORCH_NCCL_AVOID_RECORD_STREAMS=1 "
                    "trim NCCL's share",
                }
            )
    attribution = summary.get("attribution") or {}
    total_allocated = int((summary.get("totals") or {}).get("allocated_bytes", allocated) or 0)
    if attribution and total_allocated:
        state_b = int(attribution.get("optimizer_state_bytes", 0) or 0)
        grads_b = int(attribution.get("gradients_bytes", 0) or 0)
        params_b = int(attribution.get("parameters_bytes", 0) or 0)
        if state_b >= OPTIMIZER_DOMINATES * total_allocated:
            out.append(
                {
                    "rule": "optimizer-state",
                    "reason": f"optimizer state holds {_gib(state_b)}, {state_b / total_allocated * 100:.0f} % "
                    f"of the {_gib(total_allocated)} allocated",
                    "advice": "shard optimizer state across ranks (FSDP, ZeRO-1/2), keep it in lower precision "
                    "(8-bit or bf16 optimizers), or offload it to the CPU",
                }
            )
        if grads_b >= GRADIENTS_DOMINATE * total_allocated:
            out.append(
                {
                    "rule": "gradients",
                    "reason": f"gradients hold {_gib(grads_b)}, {grads_b / total_allocated * 100:.0f} % of "
                    f"the {_gib(total_allocated)} allocated",
                    "advice": "shard gradients (FSDP, ZeRO-2), reduce them in bf16, and free them after each "
                    "step (zero_grad(set_to_none=True))",
                }
            )
        held = [t for t in attribution.get("frame_tensors") or [] if isinstance(t, dict)]
        frame_b = int(attribution.get("frame_tensors_bytes", 0) or 0)
        if held and int(held[0].get("bytes", 0)) >= FRAME_DOMINATES * total_allocated:
            top_held = held[0]
            many = f" ({top_held.get('tensors')} tensors)" if int(top_held.get("tensors", 1) or 1) > 1 else ""
            out.append(
                {
                    "rule": "held-by-frame",
                    "reason": f"`{top_held.get('name')}`{many} in {top_held.get('frame')} holds "
                    f"{_gib(int(top_held['bytes']))}, {int(top_held['bytes']) / total_allocated * 100:.0f} % of "
                    f"the {_gib(total_allocated)} allocated",
                    "advice": "check whether it must stay alive: a list that grows every step (losses or "
                    "outputs kept without .item() or .detach().cpu()) is a leak",
                }
            )
        rest = total_allocated - params_b - grads_b - state_b - frame_b
        if attribution.get("optimizers") and rest >= ACTIVATIONS_DOMINATE * total_allocated:
            out.append(
                {
                    "rule": "activations",
                    "reason": f"{_gib(rest)} ({rest / total_allocated * 100:.0f} %) of the allocated memory is "
                    "neither parameters, gradients, optimizer state nor held by the failing frames' locals: "
                    "activations and temporaries",
                    "advice": "use activation checkpointing, a smaller micro-batch (with gradient "
                    "accumulation), or a shorter sequence length; " + _plan_advice(summary),
                }
            )
    sites = [s for s in summary.get("top_sites", []) or [] if s.get("site") and not str(s["site"]).startswith("(")]
    if sites and total_allocated:
        top = sites[0]
        if int(top.get("bytes", 0)) >= SITE_DOMINATES * total_allocated:
            out.append(
                {
                    "rule": "site",
                    "reason": f"one allocation site holds {_gib(top['bytes'])} in {top.get('blocks')} blocks, "
                    f"{int(top['bytes']) / total_allocated * 100:.0f} % of the allocated memory: {top['site']}",
                    "advice": f"start at {top['site']}: what it allocates, and whether it is freed",
                }
            )
    return out


PLAN_MAX_BLOCKS = 512  # an OOM's advice plans over at most this many blocks (the DP runs in the job)


def _plan_advice(summary: dict[str, Any]) -> str:
    """What the memory plan of the last measured step says for the failing device's memory
    (``summary["memory_plan_measurement"]``, the agent's latest ``dynprof memory plan``), or
    how to get one. Never raises: advice is written inside the job at its OOM."""
    doc = summary.get("memory_plan_measurement")
    if not isinstance(doc, dict):
        return (
            "no step of this process was measured for a plan: run `dynprof memory plan --pid PID "
            "--budget SIZE` on the next run to learn which layers to recompute"
        )
    try:
        m = from_json(doc)
        if len(m.blocks) > PLAN_MAX_BLOCKS:
            return f"the last measured step has {len(m.blocks)} blocks; run `dynprof memory plan` for its plan"
        limit = int((summary.get("failing_allocation") or {}).get("device_limit_bytes") or 0)
        if limit <= 0:
            return "the last measured step's plan needs the device's memory, which the OOM did not give"
        budget = limit * 9 // 10
        scaled = _scaled_to_failing_step(summary, doc, m)
        if scaled is not None:
            return scaled[1] + _scaled_plan_text(scaled[0], budget)
        plan = make_plan(m, budget=budget)
        chosen = plan.get("plan")
        if plan["status"] == "fits-already":
            return (
                f"the last measured step's peak ({_gib(m.peak_bytes)}) is under 90 % of the device: the step that "
                "failed holds more (a longer sequence, a larger batch?); measure one like it with `dynprof memory plan`"
            )
        if plan["status"] == "unreachable" or not chosen:
            return (
                f"the last measured step (peak {_gib(m.peak_bytes)}) cannot fit in {_gib(budget)} (90 % of the "
                f"device) by recomputation: its floor is {_gib(plan['floor_bytes'])}; shard the optimizer state "
                "or reduce the micro-batch (`dynprof memory plan --budget SIZE` lists the options)"
            )
        names = ", ".join(chosen["modules"][:8]) + (" ..." if len(chosen["modules"]) > 8 else "")
        return (
            f"the plan from the last measured step (peak {_gib(m.peak_bytes)}): checkpoint "
            f"{len(chosen['modules'])} module(s) ({names}) for a predicted peak of "
            f"{_gib(chosen['predicted_peak_bytes'])}, under {_gib(budget)} (90 % of the device), "
            f"+{chosen['added_step_s'] * 1000:.1f} ms a step; `dynprof memory plan --json` has how to apply it"
        )
    except Exception as exc:
        return f"the last measured step's plan could not be made ({type(exc).__name__})"


def _scaled_to_failing_step(summary: dict[str, Any], doc: dict[str, Any], m: Any) -> tuple[Any, str] | None:
    """The last measured step scaled to the failing step's tokens, where the failing frames hold
    tensors of more tokens than the measured step's first block took (a larger batch or a longer
    sequence): (the scaled measurement, what it says of the sizes); None otherwise."""
    shape = input_shape(doc)
    held = ((summary.get("attribution") or {}).get("frame_tensors")) or []
    factor = tokens_factor(shape, held if isinstance(held, list) else [])
    if factor is None or factor <= 1.05 or factor > MAX_SIZE_FACTOR:
        return None
    failing = next(
        (
            t["shape"]
            for t in held
            if isinstance(t, dict) and isinstance(t.get("shape"), list) and len(t["shape"]) == len(shape)
        ),
        None,
    )
    dims = " x ".join(str(d) for d in (failing or [])[:-1])
    base = " x ".join(str(d) for d in shape[:-1])
    return scale(m, factor), (
        f"the failing step holds {factor:g}x the tokens of the last measured step ({dims} against {base}); "
        "scaled to it, "
    )


def _scaled_plan_text(m: Any, budget: int) -> str:
    plan = make_plan(m, budget=budget)
    chosen = plan.get("plan")
    if plan["status"] == "fits-already":
        return f"its peak would be {_gib(m.peak_bytes)}, under {_gib(budget)} (90 % of the device): measure it"
    if plan["status"] == "unreachable" or not chosen:
        return (
            f"its peak would be {_gib(m.peak_bytes)}, and no recomputation fits it in {_gib(budget)} (90 % of the "
            f"device): the floor is {_gib(plan['floor_bytes'])}; reduce the micro-batch or shard the optimizer state"
        )
    step = m.typical_step_s or m.step_s
    frac = f", +{chosen['added_step_s'] / step * 100:.0f} % step time" if step else ""
    return (
        f"its peak would be {_gib(m.peak_bytes)}; it fits {_gib(budget)} (90 % of the device) with "
        f"{blocks_text(chosen['modules'])} recomputed (predicted {_gib(chosen['predicted_peak_bytes'])}{frac}); "
        "`dynprof run --checkpoint auto` applies it"
    )
