"""dynprof.attach._elf: C function addresses from /proc/PID/maps and ELF .dynsym, without gdb."""

from __future__ import annotations

import ctypes
import os
import struct
import sys

import pytest

from dynprof.attach import _elf


def _libc_path() -> str:
    for mapping in _elf.mapped_files(os.getpid()):
        if os.path.basename(mapping.path).startswith(("libc.so", "libc-")):
            return mapping.path
    raise AssertionError("this process maps no libc")


def test_resolve_gives_the_address_the_loader_gave_each_function():
    # GIVEN this process WHEN getpid and Py_IsInitialized are resolved
    found = _elf.resolve(os.getpid(), ["getpid", "Py_IsInitialized"])
    # THEN each is the address ctypes sees
    assert found["getpid"] == ctypes.cast(ctypes.CDLL(None).getpid, ctypes.c_void_p).value
    assert found["Py_IsInitialized"] == ctypes.cast(ctypes.pythonapi.Py_IsInitialized, ctypes.c_void_p).value


def test_resolve_leaves_out_what_no_library_exports():
    found = _elf.resolve(os.getpid(), ["getpid", "no_such_function_xyz"])
    assert "no_such_function_xyz" not in found and "getpid" in found


def test_dynamic_symbols_of_libc_are_defined_offsets_of_a_shared_object():
    # GIVEN the libc this process maps
    e_type, symbols = _elf.dynamic_symbols(_libc_path(), ["getpid", "mmap", "no_such_function_xyz"])
    # THEN it is a shared object, the wanted symbols it defines are there, the others not
    assert e_type == _elf.ET_DYN
    assert set(symbols) == {"getpid", "mmap"}
    assert all(v > 0 for v in symbols.values())


def test_a_file_that_is_not_elf_or_too_short_is_an_elf_error(tmp_path):
    bad = tmp_path / "x.so"
    bad.write_bytes(b"\x7fELF")  # the magic alone
    with pytest.raises(_elf.ElfError, match="not an ELF file"):
        _elf.dynamic_symbols(str(bad), ["mmap"])


def test_a_32_bit_elf_file_is_an_elf_error(tmp_path):
    bad = tmp_path / "x32.so"
    bad.write_bytes(b"\x7fELF" + bytes([1, 1, 1]) + bytes(64))
    with pytest.raises(_elf.ElfError, match="not a 64-bit"):
        _elf.dynamic_symbols(str(bad), ["mmap"])


def test_a_truncated_section_table_is_a_struct_error_that_resolve_skips(tmp_path):
    # GIVEN a 64-bit ELF header whose section table lies past the end of the file
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<H", header, 16, _elf.ET_DYN)
    struct.pack_into("<Q", header, 0x28, 10_000)
    struct.pack_into("<HH", header, 0x3A, 64, 3)
    path = tmp_path / "cut.so"
    path.write_bytes(bytes(header))
    # WHEN it is read THEN struct.error, one of the errors resolve() catches per library
    with pytest.raises(struct.error):
        _elf.dynamic_symbols(str(path), ["mmap"])


def test_mapped_files_list_each_file_once_at_its_first_byte():
    # GIVEN this process's maps
    maps = _elf.mapped_files(os.getpid())
    paths = [m.path for m in maps]
    # THEN each path is absolute and listed once, and the Python executable is among them
    assert len(paths) == len(set(paths))
    assert all(p.startswith("/") for p in paths)
    assert os.path.realpath(sys.executable) in {os.path.realpath(p) for p in paths}


def test_python_version_of_this_process_and_of_a_process_that_is_gone():
    assert _elf.python_version(os.getpid()) == tuple(sys.version_info[:2])
    assert _elf.python_version(2**22 + 1) is None  # above PID_MAX_LIMIT: never a process
