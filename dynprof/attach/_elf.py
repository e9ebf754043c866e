"""Addresses of C functions in a running process, from ``/proc/PID/maps`` and ELF ``.dynsym``.

gdb would find them by loading the symbol tables of every mapped library, which for a torch
job (libtorch_cpu alone is hundreds of MiB) keeps the whole process stopped for seconds. The
dynamic symbol table of libc and libpython (or of a statically linked ``python``) is all that
attach needs, and reading it here takes milliseconds without stopping anything.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

SHT_DYNSYM = 11
ET_DYN = 3
_SYM_SIZE = 24
_LIBPYTHON = re.compile(r"^libpython(\d+)\.(\d+)")
_PYTHON_EXE = re.compile(r"^python(\d+)\.(\d+)")


class ElfError(Exception):
    pass


def dynamic_symbols(path: str, wanted: Iterable[str]) -> tuple[int, dict[str, int]]:
    """``(e_type, {name: st_value})`` for the defined dynamic symbols of ``path`` in ``wanted``."""
    names = set(wanted)
    with open(path, "rb") as fh:
        data = fh.read()
    if data[:4] != b"\x7fELF" or len(data) < 64:
        raise ElfError(f"{path}: not an ELF file")
    if data[4] != 2:
        raise ElfError(f"{path}: not a 64-bit ELF file")
    end = "<" if data[5] == 1 else ">"
    (e_type,) = struct.unpack_from(end + "H", data, 16)
    (e_shoff,) = struct.unpack_from(end + "Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from(end + "HH", data, 0x3A)
    sections = [struct.unpack_from(end + "IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    found: dict[str, int] = {}
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, _entsize in sections:
        if sh_type != SHT_DYNSYM or link >= len(sections):
            continue
        str_offset = sections[link][4]
        for j in range(size // _SYM_SIZE):
            st_name, _st_info, _st_other, st_shndx, st_value, _st_size = struct.unpack_from(
                end + "IBBHQQ", data, offset + j * _SYM_SIZE
            )
            if st_shndx == 0 or st_value == 0:
                continue  # undefined here (imported from another object)
            start = str_offset + st_name
            name = data[start : data.index(b"\0", start)].decode("ascii", "replace")
            if name in names and name not in found:
                found[name] = st_value
    return e_type, found


@dataclass
class Mapping:
    path: str
    base: int  # the address where file offset 0 is mapped


def mapped_files(pid: int) -> list[Mapping]:
    """Files mapped into ``pid``, each with the address of its first byte."""
    out: dict[str, Mapping] = {}
    with open(f"/proc/{pid}/maps") as fh:
        for line in fh:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            if not path.startswith("/") or path.endswith("(deleted)"):
                continue
            start = int(parts[0].split("-", 1)[0], 16)
            offset = int(parts[2], 16)
            if offset == 0 and path not in out:
                out[path] = Mapping(path, start)
    return list(out.values())


def python_version(pid: int) -> tuple[int, int] | None:
    """The CPython ``(major, minor)`` that ``pid`` runs, from its mapped libpython or executable."""
    try:
        maps = mapped_files(pid)
    except OSError:
        maps = []
    for m in maps:
        found = _LIBPYTHON.match(os.path.basename(m.path))
        if found:
            return int(found.group(1)), int(found.group(2))
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return None
    found = _PYTHON_EXE.match(exe)
    if found:
        return int(found.group(1)), int(found.group(2))
    return _py_version_variable(pid)


def _py_version_variable(pid: int) -> tuple[int, int] | None:
    """From the exported ``Py_Version`` (3.11+, PY_VERSION_HEX), for an executable named plain
    ``python`` with libpython linked in."""
    try:
        address = resolve(pid, ["Py_Version"]).get("Py_Version")
        if address is None:
            return None
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(address)
            raw = mem.read(4)
    except (OSError, ValueError, OverflowError):
        return None
    if len(raw) != 4:
        return None
    value = int.from_bytes(raw, "little")
    major, minor = value >> 24, (value >> 16) & 0xFF
    return (major, minor) if major == 3 else None


def resolve(pid: int, wanted: Iterable[str]) -> dict[str, int]:
    """Absolute addresses in ``pid`` of the ``wanted`` functions exported by libc, libpython or
    the executable itself."""
    remaining = set(wanted)
    out: dict[str, int] = {}
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = ""
    for m in mapped_files(pid):
        if not remaining:
            break
        name = os.path.basename(m.path)
        if not (name.startswith(("libc.so", "libc-", "libpython")) or m.path == exe):
            continue
        try:
            e_type, symbols = dynamic_symbols(f"/proc/{pid}/root{m.path}", remaining)
        except (OSError, ValueError, struct.error, ElfError):
            continue
        for symbol, value in symbols.items():
            out[symbol] = value + (m.base if e_type == ET_DYN else 0)
            remaining.discard(symbol)
    return out
