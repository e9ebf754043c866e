"""Backends read accelerators' state behind one interface.

* ``nvml``: the NVIDIA Management Library through pynvml (nvidia-ml-py);
* ``smi``: an nvidia-smi-style tool in query/CSV mode, such as T-Head PPU's ``ppu-smi``;
  whatever the tool cannot report stays "not available".

:func:`open_backend` picks one (``auto``: NVML if it loads, else the first smi tool found on
``PATH``) or raises :class:`NoAccelerator` saying what was tried.
"""

from __future__ import annotations

import shutil

from healthcheck.backends.base import Backend, NoAccelerator, XidEvent

# smi tools tried by --backend auto when NVML is not there, in order.
SMI_TOOLS = ("nvidia-smi", "ppu-smi")

__all__ = ["SMI_TOOLS", "Backend", "NoAccelerator", "XidEvent", "open_backend"]


def open_backend(kind: str = "auto", smi_tool: str | None = None) -> Backend:
    if kind not in ("auto", "nvml", "smi"):
        raise ValueError(f"unknown backend {kind!r}")
    tried: list[str] = []
    if kind == "auto" and smi_tool:
        kind = "smi"
    if kind in ("auto", "nvml"):
        from healthcheck.backends.nvml import NvmlBackend

        try:
            return NvmlBackend.open()
        except NoAccelerator as exc:
            if kind == "nvml":
                raise
            tried.append(f"nvml: {exc.message}")
    tools = [smi_tool] if smi_tool else list(SMI_TOOLS)
    from healthcheck.backends.smi import SmiBackend

    for tool in tools:
        if shutil.which(tool) is None:
            tried.append(f"{tool}: not found on PATH")
            continue
        try:
            return SmiBackend.open(tool)
        except NoAccelerator as exc:
            tried.append(f"{tool}: {exc.message}")
    raise NoAccelerator("no accelerator found (" + "; ".join(tried) + ")")
