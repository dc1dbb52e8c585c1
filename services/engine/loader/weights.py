"""Route named checkpoint tensors onto model parameters through each parameter's weight_loader.

Rules:
- Names are HF checkpoint names (GGUF names are translated before they get here); the model's
  `checkpoint_name` renames each, then its `checkpoint_tensors` may split one into several
  (gpt-oss's stacked experts into per-expert tensors).
- A name containing a key of `model.packed_modules_mapping` goes to the fused parameter with the
  mapped shard id; any other name must match a parameter exactly.
- Every parameter must be loaded at least once; unknown or missing names raise, naming them.
- A base-model checkpoint (tensors named `layers.*`, `embed_tokens.*`, `norm.*` without the
  `model.` prefix, and no `lm_head`: how Qwen3-Embedding and other embedders saved from
  `AutoModel` ship) loads into the causal LM: names get the prefix, and the missing LM head is
  tied to the input embeddings (logged: such a model is for pooling; its generations mean
  nothing).
- After loading, each module's `quant_method.process_after_loading` runs exactly once.
- A parameter with `loaded_through` (the host twin of an offloaded expert stack) is filled by
  its device twin's weight loader and is not missing on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from flotilla.services.engine.models.base import CausalLM

log = logging.getLogger(__name__)
_BASE_MODEL_ROOTS = ("embed_tokens.", "layers.", "norm.")
_BASE_MODEL_PREFIX = "model."


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} != parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    prefixed = f"{_BASE_MODEL_PREFIX}embed_tokens.weight" in params
    bare = False  # a base-model checkpoint (see the module rules)
    for ckpt_name, ckpt_tensor in weights:
        if prefixed and ckpt_name.startswith(_BASE_MODEL_ROOTS):
            ckpt_name, bare = _BASE_MODEL_PREFIX + ckpt_name, True
        for name, tensor in model.checkpoint_tensors(model.checkpoint_name(ckpt_name),
                                                     ckpt_tensor):
            if not model.skip_weight(name):
                loaded.add(_load_one(model, params, name, tensor))
    # host twins of offloaded experts load through their device parameter (layers/moe_offload)
    missing = sorted(name for name in set(params) - loaded
                     if not hasattr(params[name], "loaded_through"))
    if bare and missing == ["lm_head.weight"]:
        log.warning("the checkpoint is a base model without an LM head (an embedding model): "
                    "the head is tied to the input embeddings; use it for embeddings, score "
                    "and rerank")
        model.lm_head.tie_to(model.model.embed_tokens)  # type: ignore[union-attr, operator]
        missing = []
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_after_loading(module)


def _load_one(model: CausalLM, params: dict[str, nn.Parameter], name: str,
              tensor: torch.Tensor) -> str:
    """Load one named tensor; returns the parameter's name."""
    for ckpt_key, (param_key, shard_id) in model.packed_modules_mapping.items():
        if f".{ckpt_key}." in name:
            pname = name.replace(f".{ckpt_key}.", f".{param_key}.")
            param = _lookup(params, pname, name)
            param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
            return pname
    param = _lookup(params, name, name)
    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    return name


MXFP4_DUMMY_SCALE = 124  # E8M0 exponent 124 - 127: random FP4 codes then stay within +-0.75


def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks (speed does not depend on values): small normal matrices,
    norm scales of one, so activations stay finite in bf16 through any depth. Runs where the
    parameters live (fast on a GPU), then the quant post-processing as after a real load."""
    gens: dict[torch.device, torch.Generator] = {}  # offloaded experts live on the CPU
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.device not in gens:
                gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            gen = gens[param.device]
            if param.dtype == torch.uint8 and name.endswith(".scales"):  # MXFP4: 2^-3 groups
                param.fill_(MXFP4_DUMMY_SCALE)
            elif param.dtype == torch.uint8 and name.endswith(".blocks"):
                param.random_(0, 256, generator=gen)
            elif "norm" in name or param.dim() == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
            elif param.is_floating_point():
                param.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_after_loading(module)


def _lookup(params: dict[str, nn.Parameter], pname: str, ckpt_name: str) -> nn.Parameter:
    try:
        return params[pname]
    except KeyError:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching model parameter "
                         f"({pname!r})") from None
