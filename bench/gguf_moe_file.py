"""Qwen3-MoE- and Llama-shaped GGUF files with random weights, quantized by our quantizer
(services/engine/quant/gguf_quantize.py) to llama.cpp's Q4_K_M type mix.

Q4_K_M as llama.cpp's llama_tensor_get_type picks it (per layer i of n, "more bits" layers:
i < n / 8, i >= 7n / 8, or (i - n / 8) % 3 == 2): attn_v, ffn_down and ffn_down_exps Q6_K in
more-bits layers, Q4_K elsewhere; attn_q / attn_k / attn_output / ffn_gate_exps / ffn_up_exps
Q4_K; token_embd Q4_K; output Q6_K; norms and the router (ffn_gate_inp) F32. Weights are
normal(0, 0.02) (norms 1), quantized where they are generated (a GPU quantizes the 30B-A3B
shape's experts in seconds). Used by tests/quant/test_gguf_moe_model.py and
bench/gguf_moe_bench.py; the dense Llama file (ffn_gate / ffn_up Q4_K, ffn_down as attn_v, no
tokenizer: `tokenizer.ggml.model` "none", which llama.cpp fills with vocab_size dummy tokens) by
bench/gpu_vs_llamacpp.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFWriter

from flotilla.kernels.gguf_dequant import Q4_K, Q6_K
from flotilla.services.engine.quant.gguf_quantize import quantize_gguf

F32 = int(GGMLQuantizationType.F32)


@dataclass(frozen=True)
class MoEShape:
    vocab: int = 151936
    hidden: int = 2048
    layers: int = 48
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 128
    top_k: int = 8
    moe_inter: int = 768
    context: int = 40960


QWEN3_30B_A3B = MoEShape()


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_types(shape: MoEShape, layer: int) -> dict[str, int]:
    wide = Q6_K if more_bits(layer, shape.layers) else Q4_K
    return {"attn_q": Q4_K, "attn_k": Q4_K, "attn_v": wide, "attn_output": Q4_K,
            "ffn_gate_exps": Q4_K, "ffn_up_exps": Q4_K, "ffn_down_exps": wide}


def _matrix(gen: torch.Generator, rows: int, cols: int, device: str) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen, device=device) * 0.02


class _Writer:
    def __init__(self, path: Path, device: str, seed: int, split_max_tensors: int,
                 arch: str = "qwen3moe") -> None:
        self.w = GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def floats(self, name: str, array: torch.Tensor) -> None:
        self.w.add_tensor(name, array.float().cpu().numpy())

    def quantized(self, name: str, qtype: int, stack: int, rows: int, cols: int) -> None:
        """A [stack, rows, cols] (stack 0: [rows, cols]) random matrix as `qtype` blocks."""
        parts = [quantize_gguf(_matrix(self.gen, rows, cols, self.device), qtype).cpu()
                 for _ in range(max(stack, 1))]
        raw = (torch.stack(parts) if stack else parts[0]).numpy()
        self.w.add_tensor(name, raw, raw_shape=raw.shape,
                          raw_dtype=GGMLQuantizationType(qtype))


def write_qwen3_moe_gguf(path: Path | str, shape: MoEShape = QWEN3_30B_A3B, seed: int = 0,
                         device: str = "cpu", split_max_tensors: int = 0) -> Path:
    """Writes the file (split_max_tensors > 0: a split set, gguf-py's own split writer) and
    returns its path (a split set: its first part)."""
    path = Path(path)
    out = _Writer(path, device, seed, split_max_tensors)
    w, s = out.w, shape
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.moe_inter * s.top_k)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_expert_feed_forward_length(s.moe_inter)
    w.add_vocab_size(s.vocab)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    out.quantized("token_embd.weight", Q4_K, 0, s.vocab, s.hidden)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        types = q4_k_m_types(s, i)
        b = f"blk.{i}."
        for norm, size in (("attn_norm", s.hidden), ("ffn_norm", s.hidden),
                           ("attn_q_norm", s.head_dim), ("attn_k_norm", s.head_dim)):
            out.floats(f"{b}{norm}.weight", 1 + 0.1 * torch.randn(size, generator=out.gen,
                                                                  device=device))
        out.quantized(f"{b}attn_q.weight", types["attn_q"], 0, q, s.hidden)
        out.quantized(f"{b}attn_k.weight", types["attn_k"], 0, kv, s.hidden)
        out.quantized(f"{b}attn_v.weight", types["attn_v"], 0, kv, s.hidden)
        out.quantized(f"{b}attn_output.weight", types["attn_output"], 0, s.hidden, q)
        out.floats(f"{b}ffn_gate_inp.weight", _matrix(out.gen, s.experts, s.hidden, device) * 10)
        out.quantized(f"{b}ffn_gate_exps.weight", types["ffn_gate_exps"], s.experts,
                      s.moe_inter, s.hidden)
        out.quantized(f"{b}ffn_up_exps.weight", types["ffn_up_exps"], s.experts, s.moe_inter,
                      s.hidden)
        out.quantized(f"{b}ffn_down_exps.weight", types["ffn_down_exps"], s.experts, s.hidden,
                      s.moe_inter)
    out.floats("output_norm.weight", torch.ones(s.hidden))
    out.quantized("output.weight", Q6_K, 0, s.vocab, s.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
    return parts[0] if split_max_tensors and parts else path


@dataclass(frozen=True)
class LlamaShape:
    vocab: int = 128256
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    inter: int = 14336
    context: int = 8192


LLAMA3_8B = LlamaShape()
Q4_K_M_FILE_TYPE = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M


def write_llama_gguf(path: Path | str, shape: LlamaShape = LLAMA3_8B, seed: int = 0,
                     device: str = "cpu") -> Path:
    """A dense Llama (Llama-3-8B shape by default; rope base 500000, no rope scaling) as
    Q4_K_M; the tensors are generated and quantized on `device`."""
    path = Path(path)
    out = _Writer(path, device, seed, 0, arch="llama")
    w, s = out.w, shape
    head_dim = s.hidden // s.heads
    w.add_file_type(Q4_K_M_FILE_TYPE)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.inter)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500_000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    w.add_tokenizer_model("none")
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    out.quantized("token_embd.weight", Q4_K, 0, s.vocab, s.hidden)
    kv = s.kv_heads * head_dim
    for i in range(s.layers):
        wide = Q6_K if more_bits(i, s.layers) else Q4_K
        b = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            out.floats(f"{b}{norm}.weight",
                       1 + 0.1 * torch.randn(s.hidden, generator=out.gen, device=device))
        out.quantized(f"{b}attn_q.weight", Q4_K, 0, s.hidden, s.hidden)
        out.quantized(f"{b}attn_k.weight", Q4_K, 0, kv, s.hidden)
        out.quantized(f"{b}attn_v.weight", wide, 0, kv, s.hidden)
        out.quantized(f"{b}attn_output.weight", Q4_K, 0, s.hidden, s.hidden)
        out.quantized(f"{b}ffn_gate.weight", Q4_K, 0, s.inter, s.hidden)
        out.quantized(f"{b}ffn_up.weight", Q4_K, 0, s.inter, s.hidden)
        out.quantized(f"{b}ffn_down.weight", wide, 0, s.hidden, s.inter)
    out.floats("output_norm.weight", torch.ones(s.hidden))
    out.quantized("output.weight", Q6_K, 0, s.vocab, s.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def file_types(path: Path | str) -> dict[str, int]:
    """GGUF tensor name -> ggml type id (what the file holds)."""
    from gguf import GGUFReader

    return {t.name: int(t.tensor_type) for t in GGUFReader(path).tensors}


__all__ = ["LLAMA3_8B", "QWEN3_30B_A3B", "LlamaShape", "MoEShape", "file_types", "more_bits",
           "q4_k_m_types", "write_llama_gguf", "write_qwen3_moe_gguf"]
