"""A synthetic CUDA GPU core dump (not recorded: built here, in the layout of cudacoredump.h), for
the reader's tests: one device, one context, one module whose relocated image names two kernels,
and grids of them with CTAs and warps."""

from __future__ import annotations

import struct

LOUSER = 0x80000000


def _elf(sections: list[tuple[str, int, bytes, int, int, int, int]], osabi: int) -> bytes:
    """An ELF64 LE file of ``sections`` (name, type, data, link, info, entsize, addr); section 0
    is the null one, the last is .shstrtab."""
    names = b"\0"
    offsets = []
    for name, *_ in sections:
        offsets.append(len(names))
        names += name.encode() + b"\0"
    shstr_off = len(names)
    names += b".shstrtab\0"
    body = b""
    placed = []
    base = 64
    for _name, _t, data, *_ in sections:
        placed.append(base + len(body))
        body += data + b"\0" * (-len(data) % 8)
    names_at = base + len(body)
    body += names + b"\0" * (-len(names) % 8)
    shoff = base + len(body)
    n = len(sections) + 2
    ident = b"\x7fELF" + bytes([2, 1, 1, osabi]) + b"\0" * 8
    head = struct.pack("<16sHHIQQQIHHHHHH", ident, 4, 190, 1, 0, 0, shoff, 0, 64, 0, 0, 64, n, n - 1)
    shdrs = b"\0" * 64
    for (_name, typ, data, link, info, entsize, addr), name_off, at in zip(sections, offsets, placed):
        shdrs += struct.pack("<IIQQQQIIQQ", name_off, typ, 0, addr, at, len(data), link, info, 8, entsize)
    shdrs += struct.pack("<IIQQQQIIQQ", shstr_off, 3, 0, 0, names_at, len(names), 0, 0, 1, 0)
    return head + body + shdrs


def cubin(kernels: dict[int, str]) -> bytes:
    """A device image whose symbol table names ``kernels`` (address -> mangled name)."""
    strtab = b"\0"
    syms = b"\0" * 24
    for addr, name in kernels.items():
        syms += struct.pack("<IBBHQQ", len(strtab), 0x12, 0, 1, addr, 0x200)
        strtab += name.encode() + b"\0"
    # sections: 1 .strtab, 2 .symtab (link 1)
    return _elf([(".strtab", 3, strtab, 0, 0, 0, 0), (".symtab", 2, syms, 1, 0, 24, 0)], osabi=0x41)


SPIN = "_ZN2at4cuda12_GLOBAL__N_111spin_kernelEl"
GEMM = "_Z10gemm_tile4IfEvPKT_S2_PS0_i"


def dump(
    grids: list[tuple[int, int, int, tuple[int, int, int], tuple[int, int, int]]] | None = None,
    warps_per_cta: int = 2,
    image: bytes | None = None,
    osabi: int = 0x33,
) -> bytes:
    """A dump; ``grids``: (grid id, kernel entry address, status, grid dims, block dims); each
    grid has one CTA of ``warps_per_cta`` warps resident."""
    if grids is None:
        grids = [(7, 0x7F00_0000_1000, 2, (1, 1, 1), (1, 1, 1)), (8, 0x7F00_0000_2000, 1, (64, 1, 1), (256, 1, 1))]
    strtab = b"\0NVIDIA H200\0sm_90\0"
    dev = struct.pack("<3Q12I", 1, 0, 13, 0, 0x19, 0, 132, 64, 32, 255, 7, 9, 0, 16, 1)
    ctx = struct.pack("<QQQQII", 0x55, 0, 0, 0, 0, 1234)
    mod = struct.pack("<Q", 0xABC)
    img = image if image is not None else cubin({0x7F00_0000_1000: SPIN, 0x7F00_0000_2000: GEMM})
    grid_rows = b"".join(
        struct.pack("<7Q12I", gid, 0x55, 0x99, entry, 0xABC, 0, 0, 0, 0, status, 32, *g, *b, 0, 0)
        for gid, entry, status, g, b in grids
    )
    ctas = b"".join(struct.pack("<QIIII", gid, 0, 0, 0, 0) for gid, *_ in grids)
    warp = struct.pack("<QIIIIII", 0, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0, 0, 0)
    # section indexes: 1 .strtab, 2 devtbl, 3 ctxtbl, 4 modtbl, 5 relfimg, 6 gridtbl, 7 ctatbl, 8.. wptbl
    sections = [
        (".strtab", 3, strtab, 0, 0, 0, 0),
        (".cudbg.devtbl", LOUSER + 9, dev, 0, 0, len(dev), 0),
        (".cudbg.ctxtbl", LOUSER + 10, ctx, 0, 0, len(ctx), 0),
        (".cudbg.modtbl", LOUSER + 16, mod, 3, 0, 8, 0),
        (".cudbg.relfimg.dev0.ctx85.mod2748", LOUSER + 7, img, 4, 0, 0, 0),
        (".cudbg.gridtbl.dev0", LOUSER + 12, grid_rows, 0, 0, 96 + 8, 0),
        (".cudbg.ctatbl.dev0.sm0", LOUSER + 13, ctas, 0, 0, 24, 0),
    ]
    for n in range(len(grids)):
        sections.append((f".cudbg.wptbl.dev0.sm0.cta{n}", LOUSER + 14, warp * warps_per_cta, 7, n, len(warp), 0))
    return _elf(sections, osabi)
