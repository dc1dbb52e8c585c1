"""The dense Llama GGUF that bench/gpu_vs_llamacpp.py gives both flotilla and llama.cpp
(bench/gguf_moe_file.write_llama_gguf): llama.cpp's Q4_K_M type mix layer by layer
(llama_tensor_get_type: attn_v / ffn_down Q6_K in use_more_bits layers), blocks that gguf.quants
dequantizes to the normal(0, 0.02) weights they were made from, and a file without a tokenizer
(`tokenizer.ggml.model` "none") that our loader reads as the Llama it describes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from bench.gguf_moe_file import LlamaShape, file_types, more_bits, write_llama_gguf
from flotilla.kernels.gguf_dequant import Q4_K, Q6_K
from flotilla.services.engine.loader import load_model

SHAPE = LlamaShape(vocab=512, hidden=256, layers=8, heads=4, kv_heads=2, inter=512, context=256)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("llama") / "llama-Q4_K_M.gguf", SHAPE)


def test_file_has_llama_cpp_q4_k_m_mix(gguf_file: Path) -> None:
    types = file_types(gguf_file)
    wide = [i for i in range(SHAPE.layers) if more_bits(i, SHAPE.layers)]
    assert wide == [0, 3, 6, 7]  # llama.cpp's use_more_bits(i, 8)
    for i in range(SHAPE.layers):
        want = Q6_K if i in wide else Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == want
        assert types[f"blk.{i}.ffn_down.weight"] == want
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == Q4_K
    assert types["token_embd.weight"] == Q4_K and types["output.weight"] == Q6_K
    fields = GGUFReader(gguf_file).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "none"
    assert int(fields["general.file_type"].parts[-1][0]) == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def test_blocks_hold_the_random_weights(gguf_file: Path) -> None:
    by_name = {t.name: t for t in GGUFReader(gguf_file).tensors}
    for name, shape in (("blk.0.ffn_down.weight", (SHAPE.hidden, SHAPE.inter)),
                        ("blk.1.ffn_gate.weight", (SHAPE.inter, SHAPE.hidden))):
        t = by_name[name]
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        assert abs(float(np.std(w)) - 0.02) < 0.002 and abs(float(np.mean(w))) < 0.001


def test_our_loader_reads_it_as_the_llama_it_describes(gguf_file: Path) -> None:
    model = load_model(gguf_file, dtype=torch.float32, device="cpu", quantization="gguf").model
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.intermediate_size) == (
        SHAPE.vocab, SHAPE.hidden, SHAPE.layers, SHAPE.heads, SHAPE.kv_heads, SHAPE.inter)
    assert config.rope_theta == 500_000.0 and config.architecture == "LlamaForCausalLM"
