"""The dynamic symbol table of an ELF64 little-endian shared object, read with the struct module.

What `nm -D` shows, without needing binutils: which symbols a library exports (defined, global or
weak, default or protected visibility) and which it expects from others (undefined). Used by
tests/test_private_ggml.py to prove the extension exports no ggml symbol and imports none.
"""

from __future__ import annotations

import struct
from pathlib import Path

SHT_DYNSYM = 11
SHN_UNDEF = 0
STB_LOCAL = 0
STV_HIDDEN, STV_INTERNAL = 2, 1
SYM_SIZE = 24  # Elf64_Sym


def dynamic_symbols(path: Path) -> tuple[set[str], set[str]]:
    """(exported, undefined) symbol names of the shared object at `path`."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    exported: set[str] = set()
    undefined: set[str] = set()
    for _name, sh_type, _flags, _addr, offset, size, link, *_rest in sections:
        if sh_type != SHT_DYNSYM:
            continue
        str_offset = sections[link][4]
        for pos in range(offset, offset + size, SYM_SIZE):
            st_name, st_info, st_other, st_shndx, _value, _size = struct.unpack_from("<IBBHQQ", data, pos)
            end = data.index(b"\0", str_offset + st_name)
            name = data[str_offset + st_name : end].decode()
            if not name or st_info >> 4 == STB_LOCAL:
                continue
            if st_shndx == SHN_UNDEF:
                undefined.add(name)
            elif st_other & 3 not in (STV_HIDDEN, STV_INTERNAL):
                exported.add(name)
    return exported, undefined
