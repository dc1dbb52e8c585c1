"""GGUF files: metadata -> ModelConfig, tensors dequantized to float with gguf.quants.

Rules:
- Every tensor is dequantized to float32 on the host (`gguf.quants.dequantize`) and then loaded
  like a float checkpoint, so any quant type the gguf package knows is accepted.
- GGUF tensor names are translated to HF names; llama.cpp's converter permutes the rows of q/k
  projections for llama-family models (interleaved rotary pairs), which is undone here so the
  HF-layout (neox) rotary applies.
- Tied embeddings are inferred from the absence of an `output.weight` tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from services.engine.model_config import ModelConfig

# Arrays too large to turn into Python lists just to build a config.
_SKIPPED_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges"}
# Architectures whose llama.cpp converter applies the q/k row permutation.
_PERMUTED_ARCHS = {"llama", "mistral"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


class GGUFCheckpoint(NamedTuple):
    config: ModelConfig
    reader: GGUFReader


def hf_name(gguf_name: str) -> str | None:
    """HF checkpoint name of a GGUF tensor, or None for tensors the model does not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` for q/k rows (weight or bias)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    meta = {key: field.contents() for key, field in reader.fields.items()
            if key not in _SKIPPED_FIELDS}
    arch = meta["general.architecture"]
    if f"{arch}.vocab_size" not in meta:
        meta[f"{arch}.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def _dequantized(tensor: Any) -> np.ndarray:
    array = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(array, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = GGUFReader(path)
    names = {t.name for t in reader.tensors}
    factors = None
    if "rope_freqs.weight" in names:
        rope = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = _dequantized(rope).reshape(-1).tolist()
    config = ModelConfig.from_gguf_metadata(_metadata(reader), "output.weight" not in names,
                                            factors)
    return GGUFCheckpoint(config, reader)


def iter_gguf(checkpoint: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    config, reader = checkpoint
    permuted = reader.fields["general.architecture"].contents() in _PERMUTED_ARCHS
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        array = _dequantized(tensor)
        if permuted and ".q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif permuted and ".k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
        if not (array.flags.writeable and array.flags.c_contiguous):  # F32 tensors are mmap views
            array = array.copy()
        yield name, torch.from_numpy(array)
