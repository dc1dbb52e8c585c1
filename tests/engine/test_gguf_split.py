"""Split GGUF files (`-00001-of-0000N.gguf`, written by gguf-py's own split writer) load as the
single file they were split from: same tensors, same logits; named by any part or by their
directory. Broken sets (a missing part, parts of different sets) are refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGUFReader

from bench.gguf_moe_file import MoEShape, write_qwen3_moe_gguf
from flotilla.libs.common.gguf_files import find_gguf, gguf_parts
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner

SHAPE = MoEShape(vocab=128, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=4,
                 top_k=2, moe_inter=256, context=128)
IDS = [5, 77, 3, 120, 64]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(one file, first part of the same model split 8 tensors a part)."""
    single = write_qwen3_moe_gguf(tmp_path_factory.mktemp("one") / "m.gguf", SHAPE)
    first = write_qwen3_moe_gguf(tmp_path_factory.mktemp("split") / "m.gguf", SHAPE,
                                 split_max_tensors=8)
    return single, first


def _logits(path: Path) -> torch.Tensor:
    return SingleSequenceRunner(load_model(path).model, max_tokens=16).forward(IDS)


def test_split_set_loads_as_the_single_file(files: tuple[Path, Path]) -> None:
    single, first = files
    parts = gguf_parts(first)
    assert len(parts) >= 3 and first.name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    assert sum(len(GGUFReader(p).tensors) for p in parts) == len(GGUFReader(single).tensors)
    ref = _logits(single)
    assert torch.equal(_logits(first), ref)
    assert torch.equal(_logits(parts[-1]), ref)  # any part names the set
    assert find_gguf(first.parent) == first  # a directory of one split set


def test_missing_part_is_named(files: tuple[Path, Path], tmp_path: Path) -> None:
    parts = gguf_parts(files[1])
    for p in parts[:-1]:
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(FileNotFoundError, match=parts[-1].name):
        load_model(tmp_path / parts[0].name)


def test_parts_of_another_split_are_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    parts = gguf_parts(files[1])
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    other = write_qwen3_moe_gguf(tmp_path / "o.gguf", SHAPE, split_max_tensors=4)
    # a part of a set cut differently, renamed into this set
    shutil.copy(gguf_parts(other)[1], tmp_path / parts[1].name)
    with pytest.raises(ValueError, match="split"):
        load_model(tmp_path / parts[0].name)


def test_directory_with_two_models_is_ambiguous(files: tuple[Path, Path], tmp_path: Path
                                                ) -> None:
    shutil.copy(files[0], tmp_path / "a.gguf")
    shutil.copy(files[0], tmp_path / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        find_gguf(tmp_path)
