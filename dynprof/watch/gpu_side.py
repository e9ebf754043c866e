"""The GPU's side of a hang: what each culprit's GPU is doing, in one line of words.

Two facts, from two places:

* the rank's own: the CUDA event its agent records at each step's end, queried when the
  agent answers a status (:class:`~dynprof.watch.model.GpuStep`: the step, whether the GPU
  finished the work queued by then, how long ago it was recorded);
* the node's: NVML's reading of that device (utilization, memory used, what the rank's process
  holds there: :class:`~dynprof.watch.model.GpuReading`), read on the rank's node by
  :func:`read_gpus` when the progress is read (the sidecar's poller, or ``dynprof watch`` on
  this node), and only for ranks that have not stepped for :data:`READ_AFTER_S`: a job that
  steps costs NVML nothing.

:func:`describe` makes the line ("GPU 1 busy 100 %, 41.2 GiB used (this process 40.9 GiB);
its work queued at step 199 has not finished after 40 s", "GPU 1 idle (0 %); its last step's
work finished: the host is stuck"), :func:`evidence` the verdict's ``gpu`` evidence and
:func:`clause` what the conclusion says of it. The kernel the GPU runs is named only by a GPU
core dump (``dynprof watch --gpu-coredump``, :mod:`collectors.gpu_coredump`), which ends the
rank's GPU work; without one, the evidence's ``kernel`` says why it is not named.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dynprof.watch.model import Culprit, GpuReading, RankProgress

log = logging.getLogger("dynprof.watch")

MIN_GAP_S = 0.010  # the agent's marker records at most this often (dynprof/agent/_gpu_step.py)
READ_AFTER_S = 10.0  # NVML is read for ranks whose last step is at least this old
IDLE_PCT = 5  # utilization at or below this is idle
MAX_GPU_LINES = 64
MAX_DEVICES = 256
NO_NVML = "no NVML here"


# -- the node's NVML ------------------------------------------------------------------------------
class _Nvml:
    """pynvml, initialised once per process on first need; None forever when it cannot be."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._module: Any = None
        self._why: str | None = None

    def get(self) -> tuple[Any, str | None]:
        with self._lock:
            if self._module is None and self._why is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._module = pynvml
                except ImportError:
                    self._why = f"{NO_NVML} (pynvml is not installed: pip install nvidia-ml-py)"
                except Exception as exc:  # no driver, no device: NVMLError_LibraryNotFound, ...
                    self._why = f"{NO_NVML} ({type(exc).__name__}: {exc})"[:300]
            return self._module, self._why


_NVML = _Nvml()


def _norm_uuid(uuid: Any) -> str:
    text = str(uuid or "").strip().lower()
    return text[4:] if text.startswith("gpu-") else text


def _device_of(nv: Any, uuid: str, pid: int) -> tuple[int, Any] | None:
    """The NVML (index, handle) of the device with ``uuid``, else of one ``pid`` runs on."""
    count = min(int(nv.nvmlDeviceGetCount()), MAX_DEVICES)
    handles = [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
    wanted = _norm_uuid(uuid)
    if wanted:
        for i, h in handles:
            if _norm_uuid(nv.nvmlDeviceGetUUID(h)) == wanted:
                return i, h
    for i, h in handles:
        if any(int(p.pid) == pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)):
            return i, h
    return None


def read_device(nv: Any, uuid: str, pid: int) -> GpuReading:
    """NVML's reading of the device of process ``pid`` (by its UUID, else by its process)."""
    try:
        found = _device_of(nv, uuid, pid)
        if found is None:
            return GpuReading(note=f"its device ({uuid or 'no UUID'}) is not among this node's NVML devices")
        index, h = found
        reading = GpuReading(index=index)
        reading.utilization_pct = max(0, min(100, int(nv.nvmlDeviceGetUtilizationRates(h).gpu)))
        memory = nv.nvmlDeviceGetMemoryInfo(h)
        reading.used_bytes, reading.total_bytes = int(memory.used), int(memory.total)
        for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
            used = getattr(p, "usedGpuMemory", None)
            if int(p.pid) == pid and isinstance(used, int) and used >= 0:
                reading.process_bytes = (reading.process_bytes or 0) + used
        return reading
    except Exception as exc:  # NVMLError, a pynvml without the call: said, never raised
        return GpuReading(note=f"NVML could not read it: {type(exc).__name__}: {exc}"[:300])


def read_gpus(rows: Sequence[RankProgress], nvml: Any = None) -> None:
    """Fill ``gpu`` of each row that stepped on CUDA and has not stepped for READ_AFTER_S, from
    this node's NVML (``nvml``: a pynvml-like module, for tests; default: pynvml, guarded)."""
    wanted = [
        r
        for r in rows
        if r.gpu_step is not None and r.last_step_age_s is not None and r.last_step_age_s >= READ_AFTER_S
    ]
    if not wanted:
        return
    why: str | None = None
    if nvml is None:
        nvml, why = _NVML.get()
    for row in wanted:
        step = row.gpu_step
        assert step is not None
        row.gpu = GpuReading(note=why or NO_NVML) if nvml is None else read_device(nvml, step.device_uuid, row.pid)


# -- the words --------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def describe(row: RankProgress) -> str:
    """One line of words for what the rank's GPU is doing (see the module's docstring)."""
    g = row.gpu
    step = row.gpu_step
    if g is None or g.index is None or g.utilization_pct is None:
        if g is None:
            why = f"its device is read once the rank has not stepped for {READ_AFTER_S:.0f} s"
        else:
            why = g.note or NO_NVML
        head = f"GPU state unknown: {why}"
        busy = None
    else:
        busy = g.utilization_pct > IDLE_PCT
        head = f"GPU {g.index} busy {g.utilization_pct} %" if busy else f"GPU {g.index} idle ({g.utilization_pct} %)"
        if g.used_bytes is not None:
            head += f", {_gib(g.used_bytes)} used"
            if g.process_bytes is not None:
                head += f" (this process {_gib(g.process_bytes)})"
    if step is None:
        return head + "; no GPU step recorded (no optimizer step on CUDA seen by its agent)"
    if not step.done:
        tail = f"its work queued at step {step.step} has not finished after {step.age_s:.0f} s"
        if busy is False:
            tail += ": it waits on something that is not a kernel (another stream, a peer, the host)"
        return f"{head}; {tail}"
    if row.step > step.step:
        # the marker records at most every 10 ms: the rank's last steps came sooner after it
        done = (
            f"its work up to step {step.step} finished (the marker records at most every "
            f"{MIN_GAP_S * 1000:.0f} ms, so its last step, {row.step}, is not marked)"
        )
    else:
        done = f"its last step's work (step {step.step}) finished"
    if busy is False:
        return f"{head}; {done}: the host is stuck"
    if busy:
        return f"{head}; {done}: it runs work queued since"
    return f"{head}; {done}"


@dataclass(frozen=True, slots=True)
class Agreement:
    """Whether the GPU's side agrees that a rank held in a GPU library waits for its device.

    ``agrees`` is True when the device has work queued and unfinished (the agent's progress probe,
    queued at the look's start, not done; or the last step's event not done) or it is busy (NVML
    above :data:`IDLE_PCT`): a call that does not return then waits behind that work. False when
    nothing says so and something says the contrary: the device idle, or the probe's work done
    (a finished last step alone says nothing: work may have been queued since). None when
    neither was read. ``evidence`` says what was read, in words."""

    agrees: bool | None
    evidence: str


def agreement(row: RankProgress | None) -> Agreement:
    """What the GPU's side of ``row`` (the look's fresh read) says of a wait for the device."""
    step = row.gpu_step if row is not None else None
    g = row.gpu if row is not None else None
    util = g.utilization_pct if g is not None and g.index is not None else None
    queued: list[str] = []
    finished: list[str] = []
    if step is not None and step.probe_done is not None:
        probe = f"the work queued {step.probe_age_s:.1f} s ago"
        (finished if step.probe_done else queued).append(f"{probe} {'finished' if step.probe_done else 'unfinished'}")
    if step is not None:
        what = f"its step {step.step}'s work"
        (finished if step.done else queued).append(f"{what} {'finished' if step.done else 'unfinished'}")
    busy = util is not None and util > IDLE_PCT
    device = f"GPU {g.index} {'busy' if busy else 'idle'} ({util} %)" if g is not None and util is not None else None
    said = ", ".join([*([device] if device else []), *queued, *finished])
    if queued or busy:
        return Agreement(True, said)
    if util is not None or (step is not None and step.probe_done):
        return Agreement(False, said)
    why = g.note if g is not None and g.note else "its device not read"
    return Agreement(None, f"{said + '; ' if said else ''}no reading of its device ({why})")


KERNEL_NOT_ARMED = (
    "not named: the GPU core dump is not armed in this rank (start the job with `dynprof run --gpu-coredump`)"
)
KERNEL_ARMED = (
    "not named: the GPU core dump is armed in this rank; `dynprof watch --gpu-coredump` or `dynprof gpu-coredump "
    "--pid PID --yes` names the kernel, and ends the rank's GPU work"
)


def kernel(row: RankProgress) -> str:
    """What the verdict says of the kernel the rank's GPU runs: why it is not named."""
    if row.gpu_step is None:
        return "not named: no GPU step recorded"
    return KERNEL_ARMED if row.gpu_step.coredump_armed else KERNEL_NOT_ARMED


def evidence(kind: str, culprits: Sequence[Culprit], rows: Sequence[tuple[str, RankProgress]]) -> list[dict[str, Any]]:
    """The verdict's ``gpu`` evidence: one entry per culprit of a hang whose rank stepped on
    CUDA or was read by NVML (its line, and the facts behind it); [] otherwise. Of two rows of
    one process in ``rows``, the later one is used (the look's fresh read)."""
    if kind != "hang":
        return []
    by_pid = {(node, r.pid): r for node, r in rows}
    by_rank = {(node, r.rank): r for node, r in rows if r.rank is not None}
    out: list[dict[str, Any]] = []
    for c in culprits[:MAX_GPU_LINES]:
        row = by_pid.get((c.host, c.pid)) if c.pid is not None else None
        row = row or (by_rank.get((c.host, c.rank)) if c.rank is not None else None)
        if row is None or (row.gpu_step is None and row.gpu is None):
            continue
        out.append(
            {
                "rank": row.rank,
                "host": c.host,
                "pid": row.pid,
                "line": describe(row),
                "kernel": kernel(row),
                "gpu_step": row.gpu_step.to_json() if row.gpu_step is not None else None,
                "gpu": row.gpu.to_json() if row.gpu is not None else None,
            }
        )
    return out


def clause(items: Sequence[dict[str, Any]]) -> str:
    """What the conclusion says of the ``gpu`` evidence: "; rank 1 (node-a): GPU 1 busy ..."."""
    parts = []
    for item in items[:8]:
        rank = item.get("rank")
        who = f"rank {rank}" if rank is not None else f"pid {item.get('pid')}"
        parts.append(f"{who} ({item.get('host')}): {item.get('line')}")
    more = f"; and {len(items) - 8} more" if len(items) > 8 else ""
    return ("; " + "; ".join(parts) + more) if parts else ""


__all__ = [
    "Agreement",
    "KERNEL_ARMED",
    "KERNEL_NOT_ARMED",
    "IDLE_PCT",
    "NO_NVML",
    "agreement",
    "READ_AFTER_S",
    "clause",
    "kernel",
    "describe",
    "evidence",
    "read_device",
    "read_gpus",
]
