"""bf16 arithmetic of the 2026 families' layers against transformers' own, layer by layer.

bench/family_parity.py judges a family by its bf16 logits against transformers' fp32 truth,
next to transformers' bf16 error (the noise floor). Where transformers rounds less than we do,
our error sits above that floor on every token and MoE routers see a noisier input (more
routing flips). The cheapest place to see it is the layer itself: on the same bf16 input, each
of our RMSNorms must give transformers' bf16 output bit for bit (gpt-oss and Gemma 4 scale the
fp32 normalised row and round once; llama-style norms round before the scale), and each router
must choose transformers' experts with transformers' weights (to bf16 rounding: transformers
rounds gpt-oss's softmax and llama4's sigmoid to bf16, we keep fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.layers.moe import Router
from services.engine.loader import load_model
from services.engine.models.gemma4_moe import Gemma4Router
from tests.engine.test_recent_families import FAMILIES, save_tiny

NAMES = ["smollm3", "glm4_moe", "gpt_oss", "llama4_text", "gemma4_text", "gemma4_moe",
         "minimax_m2"]
MOE = ["glm4_moe", "gpt_oss", "llama4_text", "gemma4_moe", "minimax_m2"]


def _models(tmp_path: Path, name: str) -> tuple[Any, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    save_tiny(tmp_path, FAMILIES[name])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    return hf, ours


@pytest.mark.parametrize("name", NAMES)
def test_rms_norms_round_as_transformers_bf16(tmp_path: Path, name: str) -> None:
    hf, ours = _models(tmp_path, name)
    modules = dict(ours.named_modules())
    checked = 0
    gen = torch.Generator().manual_seed(0)
    for mod_name, module in hf.named_modules():
        if not type(module).__name__.endswith("RMSNorm") or getattr(module, "weight", None) is None:
            continue
        if mod_name not in modules:  # e.g. a layer of transformers' past num_hidden_layers
            continue
        dim = module.weight.shape[0]
        x = (torch.randn(16, dim, generator=gen) * 3).bfloat16()
        with torch.no_grad():
            want = module(x)
            got = modules[mod_name](x)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, n=mod_name: f"{n}: {m}")
        checked += 1
    assert checked >= 3, f"{name}: only {checked} norms compared"


def _hf_choice(module: torch.nn.Module, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, K] sorted, weights [T, K] in that order) of a transformers router's output."""
    if type(module).__name__ == "Llama4Router":  # (scores [T, E], logits): unchosen score 0
        scores = out[0].float()
        ids = scores.topk(module.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    else:  # (logits, weights, ids)
        weights, ids = out[1].float(), out[2]
    order = ids.argsort(-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("name", MOE)
def test_routers_choose_as_transformers_bf16(tmp_path: Path, name: str) -> None:
    hf, ours = _models(tmp_path, name)
    hf_routers = [m for m in hf.modules() if type(m).__name__.lower().endswith("router")]
    biases = [m.e_score_correction_bias for m in hf.modules()  # MiniMax-M2's, on its MoE block
              if type(m).__name__ == "MiniMaxM2SparseMoeBlock"]
    our_routers = [m for m in ours.modules() if isinstance(m, (Router, Gemma4Router))]
    assert len(hf_routers) == len(our_routers) > 0
    gen = torch.Generator().manual_seed(0)
    for i, (hf_router, router) in enumerate(zip(hf_routers, our_routers, strict=True)):
        width = (router.weight if isinstance(router, Router) else router.scale).shape[-1]
        x = torch.randn(64, width, generator=gen).bfloat16()
        with torch.no_grad():
            out = hf_router(x, biases[i]) if biases else hf_router(x)
            want_ids, want_w = _hf_choice(hf_router, out)
            got_w, got_ids = router(x)
        order = got_ids.argsort(-1)
        assert torch.equal(got_ids.gather(1, order), want_ids)
        torch.testing.assert_close(got_w.gather(1, order), want_w, rtol=8e-3, atol=1e-6)
