"""A GGUF model read from its file or from all parts of a split set as one reader.

Rules:
- libs/common/gguf_files.py names the parts (`<stem>-0000i-of-0000N.gguf`); each part is a
  GGUFReader (memory-mapped). The set's `fields` are the first part's (the model metadata; the
  other parts carry only the split keys), its `tensors` those of every part, in part order.
- Each part's `split.no` (0-based, as llama.cpp's gguf-split and gguf-py write it) and
  `split.count` must match its place in the set, and the tensors found must add up to the
  first part's `split.tensors.count`: a set mixed from two conversions is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader, Keys

from flotilla.libs.common.gguf_files import gguf_parts


class GGUFSet:
    """The parts of a split GGUF read as one (see the module rules)."""

    def __init__(self, paths: list[Path]) -> None:
        readers = [GGUFReader(p) for p in paths]
        for i, (path, reader) in enumerate(zip(paths, readers, strict=True)):
            no, count = (_scalar(reader, key) for key in (Keys.Split.LLM_KV_SPLIT_NO,
                                                          Keys.Split.LLM_KV_SPLIT_COUNT))
            if (no, count) != (i, len(paths)):
                raise ValueError(f"{path.name}: split.no / split.count {no} / {count}, expected "
                                 f"{i} / {len(paths)}")
        self.paths = paths
        self.fields = readers[0].fields
        self.tensors = [t for reader in readers for t in reader.tensors]
        expected = _scalar(readers[0], Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
        if expected != len(self.tensors):
            raise ValueError(f"split GGUF {paths[0].name} declares {expected} tensors, its "
                             f"{len(paths)} parts hold {len(self.tensors)}")


def _scalar(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def open_gguf(path: Path) -> GGUFReader | GGUFSet:
    """A reader of the model `path` names: the file itself, or its whole split set."""
    parts = gguf_parts(path)
    return GGUFReader(path) if len(parts) == 1 else GGUFSet(parts)


__all__ = ["GGUFSet", "open_gguf"]
