"""`load_model`: a checkpoint path (HF safetensors dir or GGUF file) -> ready model + config.

Rules:
- The file type decides the reader: a *.gguf file (or a directory holding exactly one, as a hub
  snapshot of a GGUF repo does; a split set `-0000i-of-0000N.gguf`, libs/common/gguf_files.py,
  counts as one) goes through gguf_loader, a directory with config.json and
  *.safetensors through safetensors_loader.
- The architecture is checked against the registry before any weight is read.
- Parameters are created directly in `dtype` on `device`; quantization is chosen by name, or by
  the checkpoint: a config.json `quantization_config` (gptq, awq, fp8) selects its format, and a
  quantized GGUF keeps its blocks on CUDA (or with quantization "gguf"; quant/gguf.py).
- Quantization "cpu" (the engine's CPU default, `auto`) is int4 groups for a GGUF whose layer
  matmuls are all Q4_1 (int4 holds that grid exactly, quant/int4.py) and int8 per channel
  otherwise.
- The engine's kernel selection (kernels/selection.py) is handed to every `Selecting` part of
  the built model (layers and their quantization methods, `bind_selection`) before any weight
  loads: post-processing already chooses by it (quant/base.py use_kernels).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from flotilla.kernels.gguf_dequant import Q4_1
from flotilla.kernels.selection import DEFAULT_SELECTION, KernelSelection, Selecting
from flotilla.libs.common.gguf_files import find_gguf
from flotilla.services.engine.layers.moe_offload import NO_OFFLOAD, ExpertOffload, building
from flotilla.services.engine.loader.gguf_loader import (
    GGUFCheckpoint,
    expert_types,
    iter_gguf,
    mxfp4_experts,
    read_gguf,
    tensor_types,
)
from flotilla.services.engine.loader.safetensors_loader import (
    check_checkpoint,
    is_hf_dir,
    iter_safetensors,
    safetensors_files,
)
from flotilla.services.engine.loader.weights import init_dummy_weights, load_weights
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.models.base import CausalLM
from flotilla.services.engine.models.registry import get_model_class
from flotilla.services.engine.quant import (
    GGUFConfig,
    QuantConfig,
    get_quant_config,
    quant_config_from_hf,
)

CPU_DEFAULT = "cpu"
# GGUF types whose blocks int4 holds exactly: (scale, min) groups of 32 four-bit values whose
# ends are the group's min and max (Q4_K's optimised sub-block grids need not be).
INT4_EXACT_TYPES = frozenset({Q4_1})

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


def bind_selection(model: nn.Module, selection: KernelSelection) -> None:
    """Give `selection` to every `Selecting` module of `model` and to the quantization methods
    they hold (plain attributes of a module)."""
    for module in model.modules():
        for part in (module, *vars(module).values()):
            if isinstance(part, Selecting):
                part.selection = selection


def _hf_quant_config(path: Path, files: list[Path], quantization: str | None
                     ) -> QuantConfig | None:
    if quantization == CPU_DEFAULT:
        quantization = "int8"
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not qcfg:
        check_checkpoint(path, files)
        return get_quant_config(quantization)
    if quantization not in (None, "int8"):  # int8: the CPU default, not a choice
        raise ValueError(f"{path} is already quantized ({qcfg.get('quant_method')}); "
                         f"quantization {quantization!r} cannot be applied on top")
    names: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())  # noqa: SIM118 - safe_open is not a mapping
    return quant_config_from_hf(qcfg, names)


def _gguf_quant_config(checkpoint: GGUFCheckpoint, packed: dict[str, tuple[str, str | int]],
                       quantization: str | None, device: torch.device | str
                       ) -> QuantConfig | None:
    """Blocks stay quantized on CUDA by default, anywhere with "gguf"; else they are dequantized
    and `quantization` (int8 on CPU, an --isq type) applies to the floats."""
    if quantization == "gguf" or (quantization is None and torch.device(device).type == "cuda"):
        return GGUFConfig(tensor_types(checkpoint), packed, mxfp4_experts(checkpoint),
                          expert_types(checkpoint))
    if quantization == CPU_DEFAULT:
        layer_types = {t for name, t in tensor_types(checkpoint).items()
                       if ".layers." in name and name.endswith("proj.weight")}
        quantization = "int4" if layer_types and layer_types <= INT4_EXACT_TYPES else "int8"
    return get_quant_config(quantization)


def load_model(
    path: Path | str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    load_format: str = "auto",
    expert_offload: ExpertOffload = NO_OFFLOAD,
    kernel_selection: KernelSelection = DEFAULT_SELECTION,
) -> LoadedModel:
    """load_format "dummy": only config.json is read and weights are random (benchmarks), in
    the layout its `quantization_config` names if it has one. `expert_offload`: which MoE
    experts are built in host memory (layers/moe_offload.py). `kernel_selection`: which
    implementation serves each op (kernels/selection.py; the engine's, from its config)."""
    path = Path(path)
    if dtype not in SUPPORTED_MODEL_DTYPES:
        raise ValueError(f"model dtype {dtype} not supported; use one of {SUPPORTED_MODEL_DTYPES}")
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    if load_format == "dummy":
        config = ModelConfig.from_hf_dir(path)
        if quantization == CPU_DEFAULT:
            quantization = "int8"
        qcfg = config.hf_config.get("quantization_config")  # a pre-quantized layout (MXFP4)
        dummy_quant = (quant_config_from_hf(qcfg, ()) if qcfg else
                       get_quant_config(quantization))
        with torch.device(device), _default_dtype(dtype), building(expert_offload):
            dummy = get_model_class(config.architecture)(config, dummy_quant)
        bind_selection(dummy, kernel_selection)
        init_dummy_weights(dummy)
        return LoadedModel(dummy.eval(), config)
    if is_hf_dir(path):
        files = safetensors_files(path)
        quant_config = _hf_quant_config(path, files, quantization)
        config = ModelConfig.from_hf_dir(path)
        weights = iter_safetensors(files)
        model_cls = get_model_class(config.architecture)
    elif (gguf_path := find_gguf(path)) is not None:
        checkpoint = read_gguf(gguf_path)
        config = checkpoint.config
        model_cls = get_model_class(config.architecture)
        quant_config = _gguf_quant_config(checkpoint, model_cls.packed_modules_mapping,
                                          quantization, device)
        keep = quant_config.keeps_quantized if isinstance(quant_config, GGUFConfig) else None
        weights = iter_gguf(checkpoint, keep)
    else:
        raise FileNotFoundError(f"{path} is neither a GGUF file nor a directory with config.json "
                                "and *.safetensors")
    with torch.device(device), _default_dtype(dtype), building(expert_offload):
        model = model_cls(config, quant_config)
    bind_selection(model, kernel_selection)
    load_weights(model, weights)
    return LoadedModel(model.eval(), config)


__all__ = ["LoadedModel", "bind_selection", "load_model"]
