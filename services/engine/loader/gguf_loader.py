"""GGUF files: metadata -> ModelConfig, tensors as quantized blocks or dequantized floats.

Rules:
- A tensor the quant config keeps quantized (`keep(hf_name)`, quant/gguf.py) is passed as its raw
  blocks, a `QuantBytes` uint8 [rows, row_bytes] tagged with its ggml type; every other tensor is
  dequantized to float32 on the host (`gguf.quants.dequantize`) and loaded like a float
  checkpoint, so any quant type the gguf package knows is accepted.
- GGUF tensor names are translated to HF names per architecture (gguf_names.py); llama.cpp's
  converter permutes the rows of q/k projections for llama-family models (interleaved rotary
  pairs), which is undone here so the HF-layout (neox) rotary applies. Architectures without a
  verified name map are refused.
- Stacked expert tensors [E, out, in] (MoE) are yielded one expert at a time under the
  per-expert HF names the MoE models load: as raw blocks (QuantBytes [out, row_bytes]) when the
  config keeps them quantized (quant/gguf_moe.py), else dequantized; MXFP4 stacks (gpt-oss) the
  config keeps quantized are yielded per expert as `.blocks` / `.scales` (quant/mxfp4.py's
  layout) instead.
- deepseek2 (DeepSeek-V2 / V3, gguf_deepseek2.py): the config gets its MLA / routing keys, and
  the attn_k_b / attn_v_b halves of each layer's kv_b_proj are dequantized (kv_b_proj stays
  float in the model) and joined into one tensor once both have been read.
- Other archs whose metadata holds more than the generic fields (glm4moe, ...) get their config
  from gguf_configs.py; the hybrid archs (qwen3next, qwen35, qwen35moe) from gguf_qwen3next.py,
  which also undoes the converter's transforms of their tensors (their linear-attention
  tensors always load as floats).
- Tied embeddings are inferred from the absence of an `output.weight` tensor.
- A split GGUF (`-00001-of-0000N.gguf`) is read as one file (gguf_split.py).
- A reranker (llama.cpp's pooling type RANK, Qwen3-Reranker) keeps only the LM head's rows of
  its labels ("yes", "no") as `cls.output`: the head is rebuilt as the input embeddings (what
  a tied head is; an untied one's other rows are lost, so its generations mean nothing) with
  the labels' rows from `cls.output`, so the scorer's yes / no logits are the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from flotilla.services.engine.loader.gguf_configs import GGUF_ARCH_CONFIGS
from flotilla.services.engine.loader.gguf_deepseek2 import deepseek2_config, join_kv_b
from flotilla.services.engine.loader.gguf_gemma import NORM_PLUS_ONE
from flotilla.services.engine.loader.gguf_names import (
    EXPERT,
    KV_B_PARTS,
    MAPPED_ARCHS,
    PERMUTED_ARCHS,
    hf_name,
)
from flotilla.services.engine.loader.gguf_qwen3next import (
    HYBRID_ARCHS,
    fix_tensor,
    hybrid_config,
    keeps_float,
)
from flotilla.services.engine.loader.gguf_split import GGUFSet, open_gguf
from flotilla.services.engine.model_config import ModelConfig
from flotilla.services.engine.quant.gguf import QuantBytes
from flotilla.services.engine.quant.gguf_moe import expert_stack
from flotilla.services.engine.quant.mxfp4 import from_ggml_mxfp4

GGML_MXFP4 = 39  # ggml's type id of MXFP4 blocks
# Arrays too large to turn into Python lists just to build a config.
_SKIPPED_FIELDS = {"tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges"}


_CLS_OUT = "cls.output.weight"


class GGUFCheckpoint(NamedTuple):
    config: ModelConfig
    reader: GGUFReader | GGUFSet


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert_hf_to_gguf's `permute` for q/k rows (weight or bias)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _metadata(reader: GGUFReader | GGUFSet) -> dict[str, Any]:
    meta = {key: field.contents() for key, field in reader.fields.items()
            if key not in _SKIPPED_FIELDS}
    arch = meta["general.architecture"]
    if f"{arch}.vocab_size" not in meta:
        meta[f"{arch}.vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    return meta


def _dequantized(tensor: Any) -> np.ndarray:
    array = dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(array, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])


def _vector(reader: GGUFReader | GGUFSet, name: str) -> list[float] | None:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return None if tensor is None else _dequantized(tensor).reshape(-1).tolist()


def read_gguf(path: Path) -> GGUFCheckpoint:
    reader = open_gguf(path)
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in MAPPED_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported GGUF "
                         f"architectures: {', '.join(sorted(MAPPED_ARCHS))}")
    names = {t.name for t in reader.tensors}
    long, short = _vector(reader, "rope_factors_long.weight"), _vector(reader,
                                                                       "rope_factors_short.weight")
    meta = _metadata(reader)
    tied = "output.weight" not in names and _CLS_OUT not in names
    config = ModelConfig.from_gguf_metadata(
        meta, tied, _vector(reader, "rope_freqs.weight"),
        longrope_factors=(long, short) if long is not None and short is not None else None)
    if arch == "deepseek2":
        config = deepseek2_config(config, meta, any(n.endswith(".exp_probs_b.bias")
                                                    for n in names))
    elif arch in GGUF_ARCH_CONFIGS:
        config = GGUF_ARCH_CONFIGS[arch](config, meta, names)
    elif arch in HYBRID_ARCHS:
        config = hybrid_config(config, meta, names)
    return GGUFCheckpoint(config, reader)


def _arch(reader: GGUFReader | GGUFSet) -> str:
    return str(reader.fields["general.architecture"].contents())


def mxfp4_experts(checkpoint: GGUFCheckpoint) -> set[str]:
    """HF prefixes (`model.layers.N.mlp.experts`) of the expert stacks stored as MXFP4."""
    arch = _arch(checkpoint.reader)
    return {name.split(f".{EXPERT}.")[0] for t in checkpoint.reader.tensors
            if (name := hf_name(t.name, arch)) is not None and EXPERT in name
            and int(t.tensor_type) == GGML_MXFP4}


def tensor_types(checkpoint: GGUFCheckpoint) -> dict[str, int]:
    """HF name -> ggml type id of every matrix the model loads."""
    arch = _arch(checkpoint.reader)
    hybrid = arch in HYBRID_ARCHS
    return {name: int(t.tensor_type) for t in checkpoint.reader.tensors
            if (name := hf_name(t.name, arch)) is not None and len(t.shape) == 2
            and not (hybrid and keeps_float(name))}


def expert_types(checkpoint: GGUFCheckpoint) -> dict[str, dict[str, int]]:
    """MoE experts prefix (`model.layers.N.mlp.experts`) -> role (gate / up / down) -> ggml
    type of its stacked tensor."""
    arch = _arch(checkpoint.reader)
    out: dict[str, dict[str, int]] = {}
    for t in checkpoint.reader.tensors:
        name = hf_name(t.name, arch)
        stack = None if name is None or EXPERT not in name else expert_stack(name)
        if stack is not None:
            out.setdefault(stack[0], {})[stack[1]] = int(t.tensor_type)
    return out


def iter_gguf(checkpoint: GGUFCheckpoint, keep: Callable[[str], bool] | None = None
              ) -> Iterator[tuple[str, torch.Tensor]]:
    config, reader = checkpoint
    arch = _arch(reader)
    permuted = arch in PERMUTED_ARCHS
    hybrid = arch in HYBRID_ARCHS
    plus_one = arch in NORM_PLUS_ONE
    kv_b_parts: dict[str, dict[str, np.ndarray]] = {}  # kv_b_proj name -> part -> array
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        if tensor.name.endswith(KV_B_PARTS):
            parts = kv_b_parts.setdefault(name, {})
            parts[tensor.name.rsplit(".", 2)[1]] = _dequantized(tensor)
            if len(parts) == 2:
                del kv_b_parts[name]
                yield name, torch.from_numpy(join_kv_b(parts["attn_k_b"], parts["attn_v_b"]))
            continue
        if EXPERT in name and keep is not None and keep(name) and \
                int(tensor.tensor_type) == GGML_MXFP4:
            blocks, scales = from_ggml_mxfp4(torch.from_numpy(np.array(tensor.data)))
            stem = name.removesuffix(".weight")
            for e in range(blocks.shape[0]):
                yield f"{stem.replace(EXPERT, str(e))}.blocks", blocks[e]
                yield f"{stem.replace(EXPERT, str(e))}.scales", scales[e]
            continue
        if EXPERT in name and keep is not None and keep(name):  # blocks (quant/gguf_moe.py)
            stacked = np.asarray(tensor.data)  # [E, rows, row_bytes]
            for e in range(stacked.shape[0]):
                yield name.replace(EXPERT, str(e)), QuantBytes.wrap(
                    torch.from_numpy(stacked[e].copy()), int(tensor.tensor_type))
            continue
        if EXPERT in name:
            for e, weight in enumerate(_dequantized(tensor)):
                yield name.replace(EXPERT, str(e)), torch.from_numpy(weight.copy())
            continue
        raw = keep is not None and keep(name) and not (hybrid and keeps_float(name))
        array = np.asarray(tensor.data) if raw else _dequantized(tensor)
        if hybrid and not raw:
            array = fix_tensor(arch, name, array, config)
        if plus_one and name.endswith("norm.weight"):  # gguf_gemma.py
            array = array - np.float32(1.0)
        if permuted and ".q_proj." in name:
            array = unpermute_qk(array, config.num_heads)
        elif permuted and ".k_proj." in name:
            array = unpermute_qk(array, config.num_kv_heads)
        if not (array.flags.writeable and array.flags.c_contiguous):  # F32 tensors are mmap views
            array = array.copy()
        out = torch.from_numpy(array)
        yield name, (QuantBytes.wrap(out, int(tensor.tensor_type)) if raw else out)
    if any(t.name == _CLS_OUT for t in reader.tensors):
        yield "lm_head.weight", _reranker_head(reader)
    if kv_b_parts:
        raise ValueError(f"GGUF has only one half (attn_k_b / attn_v_b) of {sorted(kv_b_parts)}")


def _reranker_head(reader: GGUFReader | GGUFSet) -> torch.Tensor:
    """The LM head of a RANK-pooling GGUF: the input embeddings with the rows of the
    classifier's labels (`{arch}.classifier.output_labels`, tokens of the vocabulary) taken
    from `cls.output` (see the module rules)."""
    tensors = {t.name: t for t in reader.tensors}
    head = torch.from_numpy(_dequantized(tensors["token_embd.weight"]).copy())
    labels = reader.fields[f"{_arch(reader)}.classifier.output_labels"].contents()
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    rows = _dequantized(tensors[_CLS_OUT])
    for label, row in zip(labels, rows, strict=True):
        head[tokens.index(label)] = torch.from_numpy(row.copy())
    return head
