"""Hugging Face model directories: config.json plus one or many *.safetensors files.

Sharded checkpoints are found through model.safetensors.index.json; otherwise every
*.safetensors file in the directory is read. Tensor dtypes are checked from the file headers
before any weight is read, so an unsupported checkpoint (fp8, int4 packs) fails fast and clearly.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_DTYPES = ("F32", "F16", "BF16")
INDEX_FILE = "model.safetensors.index.json"


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists() and any(path.glob("*.safetensors"))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _header_dtypes(file: Path) -> dict[str, str]:
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {name: info["dtype"] for name, info in header.items() if name != "__metadata__"}


def check_checkpoint(model_dir: Path, files: list[Path]) -> None:
    quant = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?")
        raise ValueError(f"pre-quantized checkpoints ({method}) are not supported; use a "
                         f"{'/'.join(SUPPORTED_DTYPES)} checkpoint (optionally with int8 "
                         "weight-only quantization)")
    for file in files:
        for name, dtype in _header_dtypes(file).items():
            if dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"tensor {name!r} in {file.name} has dtype {dtype}; supported "
                                 f"checkpoint dtypes: {', '.join(SUPPORTED_DTYPES)}")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
