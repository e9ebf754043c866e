"""PCI bus ids in the forms NVML, smi tools, torch and the kernel log write them."""

from __future__ import annotations

import re

_BUS_ID = re.compile(r"(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?")


def normalize_bus_id(text: str) -> str | None:
    """``00000000:3B:00.0``, ``0000:3b:00`` and ``3b:00.0`` all become ``0000:3b:00``.

    The function number is dropped: the kernel log's XID lines leave it out.
    """
    match = _BUS_ID.fullmatch(text.strip())
    if not match:
        return None
    domain, bus, dev, _fn = match.groups()
    domain_value = int(domain, 16) if domain else 0
    return f"{domain_value & 0xFFFF:04x}:{int(bus, 16):02x}:{int(dev, 16):02x}"
