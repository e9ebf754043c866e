"""What runs in the training process: take a CUDA memory snapshot and write it as an artifact.

Capture runs inside the training process, possibly at the moment CUDA memory is exhausted:
it makes no CUDA allocation (the snapshot and the statistics are host-side copies of the
allocator's state), queries free/total only for devices that already have a context, and streams
the pickle to disk.

The agent loads this module (and :mod:`collectors.memory.policy`) into every job, so it imports
nothing else of the package at load time: never the untrusted unpickler (``reader``) nor the
renderers, which a job never needs. The summary and its advice, which ``summary.json`` holds,
are imported by :func:`capture` itself, at the first snapshot a process takes.

Three parts:

* :func:`thread_stack`: the Python stack of the failing (or the training) thread.
* :func:`job_attribution` runs at OOM, on the failing thread (the allocator's observer):
  totals of the parameters, gradients and optimizer state of the job's optimizers, and the
  CUDA tensors the failing frames hold in their locals. It reads tensor metadata only
  (``untyped_storage().nbytes()``, ``data_ptr()``): no CUDA call, no allocation on the device,
  bounded work (``MAX_TENSORS``), and it never raises.
* :func:`capture`: the snapshot, the allocator's statistics and the artifact's files.
"""

from __future__ import annotations

import pickle
import time
import traceback
from typing import Any

from collectors.memory import KIND, MEMORY_SUMMARY_FILE, SNAPSHOT_FILE, STACK_FILE, SUMMARY_FILE

PICKLE_PROTOCOL = 4  # what torch's own _dump_snapshot writes on Python 3.8-3.13; the web viewer reads it

MAX_TENSORS = 200_000  # tensors looked at, in all
MAX_FRAMES = 40
MAX_CONTAINER = 4096  # items of a list/tuple/dict local looked into


def _storage_key(t: Any) -> tuple[int, int, int] | None:
    try:
        if not getattr(t, "is_cuda", False):
            return None
        storage = t.untyped_storage()
        return (int(t.device.index or 0), int(storage.data_ptr()), int(storage.nbytes()))
    except Exception:
        return None


def job_attribution(frame: Any, optimizers: list[Any]) -> dict[str, Any]:
    """Bytes held by the optimizers' parameters, gradients and state, and by the tensors in
    the locals of ``frame`` and its callers (each storage counted once, in the first place
    it is found: parameters and their gradients, optimizer state, then frames)."""
    t0 = time.perf_counter()
    seen: set[tuple[int, int]] = set()
    looked = 0
    out: dict[str, Any] = {
        "optimizers": len(optimizers),
        "parameters_bytes": 0,
        "gradients_bytes": 0,
        "optimizer_state_bytes": 0,
        "frame_tensors_bytes": 0,
        "frame_tensors": [],
        "complete": True,
    }

    def count(t: Any) -> int:
        nonlocal looked
        looked += 1
        key = _storage_key(t)
        if key is None or key[:2] in seen:
            return 0
        seen.add(key[:2])
        return key[2]

    try:
        import torch

        tensor_type = torch.Tensor
        for opt in optimizers:
            for group in getattr(opt, "param_groups", []) or []:
                for p in group.get("params", []) if isinstance(group, dict) else []:
                    if looked > MAX_TENSORS:
                        break
                    if isinstance(p, tensor_type):
                        out["parameters_bytes"] += count(p)
                        g = getattr(p, "grad", None)
                        if isinstance(g, tensor_type):
                            out["gradients_bytes"] += count(g)
            state = getattr(opt, "state", {}) or {}
            for per_param in list(state.values())[:MAX_TENSORS]:
                if looked > MAX_TENSORS:
                    break
                if isinstance(per_param, dict):
                    for v in per_param.values():
                        if isinstance(v, tensor_type):
                            out["optimizer_state_bytes"] += count(v)
        found: dict[tuple[str, str], dict[str, Any]] = {}  # (frame, local name) -> its tensors
        f, depth = frame, 0
        while f is not None and depth < MAX_FRAMES and looked <= MAX_TENSORS:
            where = f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})"
            for name, value in list(f.f_locals.items()):
                if isinstance(value, tensor_type):
                    items: list[Any] = [value]
                elif isinstance(value, (list, tuple)):
                    items = list(value[:MAX_CONTAINER])
                elif isinstance(value, dict):
                    items = list(value.values())[:MAX_CONTAINER]
                else:
                    continue
                for t in items:
                    if not isinstance(t, tensor_type):
                        continue
                    size = count(t)
                    if not size:
                        continue
                    entry = found.setdefault(
                        (where, name),
                        {
                            "name": name if value is t else f"{name} ({type(value).__name__} of tensors)",
                            "frame": where,
                            "bytes": 0,
                            "tensors": 0,
                            "shape": list(t.shape)[:8],
                            "dtype": str(t.dtype).replace("torch.", ""),
                        },
                    )
                    entry["bytes"] += size
                    entry["tensors"] += 1
            f, depth = f.f_back, depth + 1
        ranked = sorted(found.values(), key=lambda e: e["bytes"], reverse=True)
        out["frame_tensors_bytes"] = sum(e["bytes"] for e in ranked)
        out["frame_tensors"] = ranked[:10]
        out["complete"] = looked <= MAX_TENSORS
    except Exception as exc:  # at OOM: report what was found, never fail the capture
        out["complete"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"[:200]
    out["tensors_looked_at"] = looked
    out["took_s"] = round(time.perf_counter() - t0, 4)
    return out


def thread_stack(frame: Any = None, ident: int | None = None, name: str | None = None, limit: int = 60) -> str:
    """The Python stack of the calling thread (or of ``frame``, running in thread ``ident``),
    innermost last."""
    import sys
    import threading

    frame = frame if frame is not None else sys._getframe(1)
    if ident is None:
        ident, name = threading.get_ident(), threading.current_thread().name
    head = f'Thread {ident} "{name or "?"}" (most recent call last):\n'
    return head + "".join(traceback.format_stack(frame, limit=limit))


def _device_stats(torch: Any, index: int) -> dict[str, Any]:
    stats = torch.cuda.memory_stats(index)

    def get(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    return {
        "allocated_bytes": get("allocated_bytes.all.current"),
        "reserved_bytes": get("reserved_bytes.all.current"),
        "active_bytes": get("active_bytes.all.current"),
        "inactive_split_bytes": get("inactive_split_bytes.all.current"),
        "peak_allocated_bytes": get("allocated_bytes.all.peak"),
        "peak_reserved_bytes": get("reserved_bytes.all.peak"),
        "num_ooms": get("num_ooms"),
        "num_alloc_retries": get("num_alloc_retries"),
        "num_device_alloc": get("num_device_alloc"),
    }


def capture(
    store: Any,
    *,
    trigger: str,
    job: str | None,
    host: str | None,
    rank: int | None,
    history_policy: str,
    oom: dict[str, Any] | None = None,
    stack: str = "",
    options: dict[str, Any] | None = None,
    attribution: dict[str, Any] | None = None,
    plan_measurement: dict[str, Any] | None = None,
) -> Any:
    """Take the snapshot now and write one ``memory`` artifact; return the finished Artifact.

    ``oom`` carries what the allocator's out-of-memory observer passed: ``device``,
    ``requested_bytes`` (the cudaMalloc it could not make), ``device_limit_bytes`` (the
    device's memory, or the cap set with set_per_process_memory_fraction) and
    ``device_free_bytes``. ``attribution`` is what :func:`job_attribution`
    found in the job's objects (parameters, gradients, optimizer state, the failing frames' tensors).
    ``plan_measurement``: the latest ``dynprof memory plan`` measurement of this process, for the
    advice.
    """
    import torch

    from collectors.memory import advice
    from collectors.memory.summary import manifest_summary, summarize_snapshot

    t0 = time.perf_counter()
    snapshot = torch.cuda.memory._snapshot()
    t_snapshot = time.perf_counter() - t0

    writer = store.create(
        KIND,
        job=job,
        host=host,
        rank=rank,
        options={"trigger": trigger, "memory_history": history_policy, **(options or {})},
    )
    try:
        t1 = time.perf_counter()
        with open(writer.file_path(SNAPSHOT_FILE), "wb") as fh:
            pickle.dump(snapshot, fh, protocol=PICKLE_PROTOCOL)
        t_pickle = time.perf_counter() - t1

        t2 = time.perf_counter()
        summary = summarize_snapshot(snapshot)
        in_use = [d["device"] for d in summary["devices"] if d["segments"]]
        if oom is not None and oom.get("device") is not None and oom["device"] not in in_use:
            in_use.append(int(oom["device"]))
        live: dict[str, Any] = {}
        texts = []
        for index in sorted(in_use):
            entry: dict[str, Any] = {}
            try:
                entry.update(_device_stats(torch, index))
            except Exception as exc:
                entry["stats_error"] = f"{type(exc).__name__}: {exc}"
            if oom is not None and oom.get("device") == index:
                # The observer's figures, from the moment of the failure; the device's size is
                # a property cached on the host. (The observer's limit is the device's size or the
                # process's cap from set_per_process_memory_fraction, whichever applies.)
                entry["free_bytes"] = oom.get("device_free_bytes")
                entry["limit_bytes"] = oom.get("device_limit_bytes")
                try:
                    entry["total_bytes"] = int(torch.cuda.get_device_properties(index).total_memory)
                except Exception:
                    entry["total_bytes"] = oom.get("device_limit_bytes")
            else:
                try:  # this device has segments, so a context: cudaMemGetInfo allocates nothing
                    free, total = torch.cuda.mem_get_info(index)
                    entry["free_bytes"], entry["total_bytes"] = int(free), int(total)
                except Exception as exc:
                    entry["mem_info_error"] = f"{type(exc).__name__}: {exc}"
            try:
                entry["name"] = torch.cuda.get_device_name(index)
            except Exception:
                pass
            live[str(index)] = entry
            try:
                texts.append(f"==== cuda:{index} ====\n{torch.cuda.memory_summary(index)}")
            except Exception as exc:
                texts.append(f"==== cuda:{index} ====\n(memory_summary failed: {type(exc).__name__}: {exc})\n")
        failing: dict[str, Any] | None = None
        if oom is not None:
            failing = dict(oom)
            recorded = [o for o in summary["oom_events"] if o["device"] == oom.get("device")]
            if recorded:  # the allocator's own record has the caller's requested size and stack
                failing["requested_bytes"] = recorded[-1]["requested_bytes"]
                failing["site"] = recorded[-1]["site"]
            failing["segment_request_bytes"] = oom.get("requested_bytes")
        summary.update(
            trigger=trigger,
            memory_history=history_policy,
            torch_version=getattr(torch, "__version__", None),
            failing_allocation=failing,
            device_memory=live,
            size_classes=advice.size_classes(snapshot),
        )
        if attribution is not None:
            summary["attribution"] = attribution
        if plan_measurement is not None:
            summary["memory_plan_measurement"] = plan_measurement
        summary["advice"] = advice.advise(summary)
        t_summary = time.perf_counter() - t2
        writer.write_text(MEMORY_SUMMARY_FILE, "\n".join(texts))
        writer.write_text(STACK_FILE, stack or "(no stack)\n")
        summary["capture"] = {
            "snapshot_s": round(t_snapshot, 4),
            "pickle_s": round(t_pickle, 4),
            "summary_s": round(t_summary, 4),
            "total_s": round(time.perf_counter() - t0, 4),
            "pickle_bytes": writer.file_path(SNAPSHOT_FILE).stat().st_size,
            "history_entries": sum(h["entries"] for h in summary["history"]),
        }
        writer.write_json(SUMMARY_FILE, summary)
        return writer.finish("complete", summary=manifest_summary(summary))
    except BaseException as exc:
        if writer.finished is None:
            writer.finish("failed", error=f"{type(exc).__name__}: {exc}")
        raise
