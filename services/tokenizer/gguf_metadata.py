"""Read the key/value metadata of a GGUF file, and nothing else.

`gguf.GGUFReader` also maps every tensor and wraps each vocabulary string in a numpy view, which
costs seconds for a 150k-token vocabulary; the tokenizer needs only the metadata at the head of
the file. The format (little-endian, GGUF v2/v3): magic `GGUF`, u32 version, u64 tensor count,
u64 key/value count, then per key: string key, u32 value type, value. Strings are u64 length +
UTF-8 bytes; arrays are u32 item type + u64 count + items. Tests compare this reader with
`gguf.GGUFReader` on the real model.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown GGUF value type {vtype}")
        value = self.unpack(_SCALARS[vtype][0])
        return bool(value) if vtype == 7 else value

    def array(self) -> list[Any]:
        itype, count = self.unpack("<I"), self.unpack("<Q")
        if itype in _SCALARS:
            dtype = np.dtype(_SCALARS[itype][1])
            items = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            values = items.tolist()
            return [bool(v) for v in values] if itype == 7 else values
        return [self.value(itype) for _ in range(count)]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as plain Python values (arrays become lists)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        cur = _Cursor(buf)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: unsupported GGUF version {version} "
                                  "(only little-endian v2/v3 files)")
        cur.unpack("<Q")  # tensor count: not needed here
        n_kv = cur.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("<I"))
        return meta


def gguf_pooling_type(path: str | Path) -> int | None:
    """The pooling type llama.cpp's converter wrote (`{arch}.pooling_type`: 0 none, 1 mean,
    2 cls, 3 last, 4 rank) in a `.gguf` file, or None (not a GGUF file, or none written)."""
    if Path(path).suffix != ".gguf" or not Path(path).is_file():
        return None
    meta = read_gguf_metadata(path)
    value = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    return None if value is None else int(value)
