"""The real SmolLM2-135M Q4_1 GGUF served from its quantized blocks.

The perplexity check runs all 30 layers' matmuls through the Triton GGUF kernels (on CPU, the
interpreter) over the whole fixed text (384 tokens, one prefill: the GEMM kernel), against the
existing path that dequantizes every tensor with gguf.quants at load time. The tied LM head /
embedding is Q8_0 in this file and stays float on both paths (embeddings are not matmuls).
"""

from __future__ import annotations

import math

import pytest
import torch

from flotilla.kernels.gguf_dequant import Q4_0, Q4_1, Q6_K, Q8_0
from flotilla.kernels.selection import KernelSelection
from flotilla.libs.common.model_cache import ensure_default_model
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.quant import GGUFConfig, GGUFLinearMethod
from flotilla.services.engine.quant.gguf_parts import GGUFPartsLinearMethod
from flotilla.services.tokenizer.tokenizer import Tokenizer
from tests.engine.conftest import SingleSequenceRunner
from tests.quant.fixed_text import TEXT

PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    logits = SingleSequenceRunner(model, max_tokens=len(ids) + 16).forward(ids)
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()
    return math.exp(float(nll))


def test_gguf_file_keeps_its_blocks(kernels_mode: KernelSelection) -> None:
    model = load_model(ensure_default_model(), quantization="gguf",
                       kernel_selection=kernels_mode).model
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert isinstance(linear.quant_method, GGUFLinearMethod)
        assert linear.quant_method.qtype == Q4_1 and linear.qweight.dtype == torch.uint8
        assert linear.qweight.shape[1] == linear.input_size // 32 * 20  # 20 bytes / block
        assert not hasattr(linear, "weight")
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_mixed_types_in_one_fused_layer_stay_quantized_in_parts() -> None:
    types = {"model.layers.0.self_attn.q_proj.weight": Q4_0,
             "model.layers.0.self_attn.k_proj.weight": Q4_0,
             "model.layers.0.self_attn.v_proj.weight": Q6_K,
             "model.layers.0.self_attn.o_proj.weight": Q8_0}
    config = GGUFConfig(types, PACKED)
    linear = torch.nn.Linear(1, 1)
    linear.input_size = 256  # type: ignore[assignment]  # what GGUFConfig reads off LinearBase
    qkv = config.get_method(linear, "model.layers.0.self_attn.qkv_proj")
    o_proj = config.get_method(linear, "model.layers.0.self_attn.o_proj")
    assert isinstance(qkv, GGUFPartsLinearMethod) and qkv.qtypes == {Q4_0, Q6_K}
    assert isinstance(o_proj, GGUFLinearMethod) and o_proj.qtype == Q8_0
    assert config.keeps_quantized("model.layers.0.self_attn.v_proj.weight")
    assert config.keeps_quantized("model.layers.0.self_attn.o_proj.weight")


@pytest.mark.slow
def test_perplexity_with_quantized_kernels_matches_dequantized_weights(
    kernels_mode: KernelSelection,
) -> None:
    path = ensure_default_model()
    ids = Tokenizer.from_path(path).encode(TEXT)
    assert len(ids) > 300
    reference = perplexity(load_model(path).model, ids)  # gguf.quants-dequantized float32
    quantized = load_model(path, quantization="gguf", kernel_selection=kernels_mode).model
    assert quantized.model.layers[29].mlp.down_proj.qweight.dtype == torch.uint8
    ours = perplexity(quantized, ids)
    assert 1.5 < reference < 30, reference  # the model reads the text as English
    assert abs(ours / reference - 1) < 0.01, (ours, reference)


def test_cpu_default_serves_q4_1_as_int4_within_one_percent_perplexity() -> None:
    """The engine's CPU default ("cpu") holds this Q4_1 file's layers as int4 groups (the LM
    head int8) and reads the text as the dequantized float weights do."""
    from flotilla.services.engine.quant import Int4WeightOnlyMethod, Int8WeightOnlyMethod

    path = ensure_default_model()
    ids = Tokenizer.from_path(path).encode(TEXT)
    reference = perplexity(load_model(path).model, ids)
    model = load_model(path, quantization="cpu").model
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, Int4WeightOnlyMethod)
    assert isinstance(model.lm_head.quant_method, Int8WeightOnlyMethod)
    ours = perplexity(model, ids)
    assert abs(ours / reference - 1) < 0.01, (ours, reference)
