"""Which files make up a GGUF model: one `.gguf`, or a split set as llama.cpp's gguf-split writes.

Rules:
- A split set is `<stem>-00001-of-0000N.gguf` .. `<stem>-0000N-of-0000N.gguf` (five digits each,
  gguf-split's naming); its first part holds the model metadata (architecture, tokenizer) and
  every part carries `split.no` / `split.count` / `split.tensors.count` (gguf.Keys.Split),
  which the engine's loader checks (services/engine/loader/gguf_split.py).
- Naming any part of a set names the whole set; a missing part is an error naming it.
- A directory names its model when it holds exactly one `.gguf`, or only the parts of one split
  set (a hub snapshot of a split repo). Anything else is ambiguous and refused.
"""

from __future__ import annotations

import re
from pathlib import Path

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_part_name(stem: str, no: int, count: int) -> str:
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


def gguf_parts(path: Path) -> list[Path]:
    """The files of the GGUF model `path` names (itself, or its split set in order)."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    stem, count = match["stem"], int(match["count"])
    parts = [path.with_name(split_part_name(stem, no, count)) for no in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"split GGUF {path.name} is missing part(s) "
                                f"{', '.join(missing)}")
    return parts


def find_gguf(path: Path) -> Path | None:
    """The GGUF file (a split set: its first part) that `path` names, or None if it names no
    GGUF (another kind of checkpoint)."""
    if path.is_file():
        return gguf_parts(path)[0] if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if not found:
        return None
    first = gguf_parts(found[0])
    if len(found) == 1 or found == first:
        return first[0]
    raise ValueError(f"{path} holds several GGUF files ({', '.join(p.name for p in found)}); "
                     "pass the file itself")


__all__ = ["SPLIT_NAME", "find_gguf", "gguf_parts", "split_part_name"]
