"""Read PCIe links while they carry traffic (links drop to a lower generation when idle)."""

from __future__ import annotations

import threading
import time

from healthcheck.backends.base import Backend
from healthcheck.readings import DeviceReadings


def torch_ordinals(readings: list[DeviceReadings]) -> dict[int, int]:
    """Map backend device indices to torch CUDA ordinals, by UUID (CUDA_VISIBLE_DEVICES may reorder)."""
    import torch

    by_uuid = {r.uuid: r.index for r in readings if r.uuid}
    mapping = {}
    for ordinal in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(ordinal), "uuid", "") or "")
        key = uuid if uuid.startswith("GPU-") else "GPU-" + uuid
        if key in by_uuid:
            mapping[by_uuid[key]] = ordinal
    if not mapping and torch.cuda.device_count() == len(readings):
        mapping = {r.index: i for i, r in enumerate(readings)}
    return mapping


MIN_ROUNDS = 3


def loaded_links(
    backend: Backend, readings: list[DeviceReadings], seconds: float = 0.4
) -> tuple[dict[int, tuple[int, int]], str | None]:
    """``{device index: (generation, width)}`` read while host-to-device copies run on every device.

    Returns the readings and, when some devices could not be loaded, why.
    """
    try:
        import torch
    except ImportError:
        return {}, "torch is not importable here"
    if not torch.cuda.is_available():
        return {}, "torch sees no CUDA device"
    ordinals = torch_ordinals(readings)
    stop = threading.Event()
    ready = threading.Barrier(len(ordinals) + 1) if ordinals else None

    def load(ordinal: int) -> None:
        device = torch.device("cuda", ordinal)
        host = torch.empty(16 * 1024**2, dtype=torch.float32).pin_memory()
        dev = torch.empty_like(host, device=device)
        dev.copy_(host)
        torch.cuda.synchronize(device)
        assert ready is not None
        ready.wait()
        while not stop.is_set():
            for _ in range(4):
                dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize(device)

    threads = [threading.Thread(target=load, args=(o,), daemon=True) for o in ordinals.values()]
    for t in threads:
        t.start()
    found: dict[int, tuple[int, int]] = {}
    try:
        if ready is not None:
            ready.wait(timeout=30)
        deadline = time.monotonic() + seconds
        rounds = 0
        # for ``seconds``, and at least MIN_ROUNDS reads however slow the machine (a link
        # trains up under load: the first read may still show its idle generation)
        while rounds < MIN_ROUNDS or time.monotonic() < deadline:
            rounds += 1
            for index in ordinals:
                gen, width = backend.read_pcie(index)
                if gen is not None and width is not None:
                    best = found.get(index, (0, 0))
                    found[index] = (max(best[0], gen), max(best[1], width))
            time.sleep(0.05)
    except threading.BrokenBarrierError:
        return {}, "loading the links timed out"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
    missing = [r.index for r in readings if r.index not in ordinals]
    return found, (f"devices {missing} are not visible to CUDA" if missing else None)
