"""`load_model`: a checkpoint path (HF safetensors dir or GGUF file) -> ready model + config.

Rules:
- The file type decides the reader: a *.gguf file (or a directory holding exactly one, as a hub
  snapshot of a GGUF repo does) goes through gguf_loader, a directory with config.json and
  *.safetensors through safetensors_loader.
- The architecture is checked against the registry before any weight is read.
- Parameters are created directly in `dtype` on `device`; quantization is chosen by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from services.engine.loader.gguf_loader import iter_gguf, read_gguf
from services.engine.loader.safetensors_loader import (
    check_checkpoint,
    is_hf_dir,
    iter_safetensors,
    safetensors_files,
)
from services.engine.loader.weights import init_dummy_weights, load_weights
from services.engine.model_config import ModelConfig
from services.engine.models.base import CausalLM
from services.engine.models.registry import get_model_class
from services.engine.quant import get_quant_config

SUPPORTED_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LoadedModel(NamedTuple):
    model: CausalLM
    config: ModelConfig


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _find_gguf(path: Path) -> Path | None:
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(found) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(p.name for p in found)}); "
                         "pass the file itself")
    return found[0] if found else None


def load_model(
    path: Path | str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    load_format: str = "auto",
) -> LoadedModel:
    """load_format "dummy": only config.json is read and weights are random (benchmarks)."""
    path = Path(path)
    if dtype not in SUPPORTED_MODEL_DTYPES:
        raise ValueError(f"model dtype {dtype} not supported; use one of {SUPPORTED_MODEL_DTYPES}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if load_format == "dummy":
        config = ModelConfig.from_hf_dir(path)
        with torch.device(device), _default_dtype(dtype):
            dummy = get_model_class(config.architecture)(config, get_quant_config(quantization))
        init_dummy_weights(dummy)
        return LoadedModel(dummy.eval(), config)
    if is_hf_dir(path):
        files = safetensors_files(path)
        check_checkpoint(path, files)
        config = ModelConfig.from_hf_dir(path)
        weights = iter_safetensors(files)
    elif (gguf_path := _find_gguf(path)) is not None:
        checkpoint = read_gguf(gguf_path)
        config = checkpoint.config
        weights = iter_gguf(checkpoint)
    else:
        raise FileNotFoundError(f"{path} is neither a GGUF file nor a directory with config.json "
                                "and *.safetensors")
    model_cls = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config, get_quant_config(quantization))
    load_weights(model, weights)
    return LoadedModel(model.eval(), config)


__all__ = ["LoadedModel", "load_model"]
