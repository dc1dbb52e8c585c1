"""In-situ quantization (--isq): float checkpoints quantized while loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.kernels.fp8 import FP8
from flotilla.kernels.gguf_dequant import GGUF_TYPES, Q4_1
from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.quant import ISQ_NAMES
from flotilla.services.engine.quant.isq import ISQ_GGUF_TYPES
from tests.engine.conftest import SingleSequenceRunner, save_tiny_llama
from tests.quant.conftest import DEVICE, rel_err

# logits error against the float model, per type: observed on this tiny random model x 1.3 (about
# 2.7x the relative weight error; roughly halved per extra bit)
FLOAT_BOUNDS = {"q2k": 1.1, "q3k": 0.6, "q4_0": 0.32, "q4_1": 0.3, "q4k": 0.3, "q5_0": 0.16,
                "q5_1": 0.15, "q5k": 0.15, "q6k": 0.07, "q8_0": 0.02, "fp8": 0.1}
IDS = list(range(7, 40))


@pytest.fixture(scope="module")
def llama256(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A tiny llama with in_features that are multiples of 256 (k-quant blocks), and its
    float logits."""
    path = tmp_path_factory.mktemp("isq256")
    save_tiny_llama(path, seed=7, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                    initializer_range=0.05)
    logits = SingleSequenceRunner(load_model(path, device=DEVICE).model).forward(IDS)
    return path, logits


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "quant_method")]


@pytest.mark.parametrize("name", ISQ_NAMES)
def test_isq_kernels_match_dequantized_and_stay_near_float(
    name: str, llama256: tuple[Path, torch.Tensor], kernels_mode: KernelSelection,
    dequant_mode: KernelSelection,
) -> None:
    path, float_logits = llama256
    quantized = load_model(path, device=DEVICE, quantization=name,
                           kernel_selection=kernels_mode).model
    for layer in linear_layers(quantized):  # every linear layer and the LM head
        assert not isinstance(getattr(layer, "weight", None), torch.nn.Parameter)
        if name == "fp8":
            assert layer.weight_fp8.dtype == FP8
        else:
            t = GGUF_TYPES[ISQ_GGUF_TYPES[name]]
            assert layer.quant_method.type == t and layer.qweight.dtype == torch.uint8
            assert layer.qweight.shape[1] % t.type_size == 0
    dequantized = load_model(path, device=DEVICE, quantization=name,
                             kernel_selection=dequant_mode).model
    ours = SingleSequenceRunner(quantized).forward(IDS)
    ref = SingleSequenceRunner(dequantized).forward(IDS)
    assert rel_err(ours, ref) < 1e-5
    assert rel_err(ours, float_logits) < FLOAT_BOUNDS[name]


def test_k_quants_fall_back_to_32_weight_blocks(tmp_path: Path,
                                                kernels_mode: KernelSelection) -> None:
    save_tiny_llama(tmp_path, seed=1)  # hidden 64: no whole 256-weight blocks
    model = load_model(tmp_path, device=DEVICE, quantization="q4k",
                       kernel_selection=kernels_mode).model
    assert {layer.quant_method.qtype for layer in linear_layers(model)} == {Q4_1}


def test_isq_rejects_unknown_names(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, seed=1)
    with pytest.raises(ValueError, match="unknown quantization"):
        load_model(tmp_path, quantization="q7k")
