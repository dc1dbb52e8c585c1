"""bf16 arithmetic of the 2026 families' layers against transformers' own, layer by layer.

bench/family_parity.py judges a family by its bf16 logits against transformers' fp32 truth,
next to transformers' bf16 error (the noise floor). Where transformers rounds less than we do,
our error sits above that floor on every token and MoE routers see a noisier input (more
routing flips). The cheapest place to see it is the layer itself: on the same bf16 input, each
of our RMSNorms must give transformers' bf16 output bit for bit (gpt-oss and Gemma 4 scale the
fp32 normalised row and round once, as do the hybrids' (1 + w) norms; llama-style norms round
before the scale), a hybrid's first Gated DeltaNet layer must give transformers' bf16 output bit
for bit (its conv rounds twice, as transformers' bf16 F.conv1d and silu do), and each router
must choose transformers' experts with transformers' weights (to bf16 rounding: transformers
rounds gpt-oss's softmax and llama4's sigmoid to bf16, we keep fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.layers.moe import Router
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.models.gemma4_moe import Gemma4Router
from tests.engine.conftest import SingleSequenceRunner
from tests.engine.test_hybrid_models import FAMILIES as HYBRIDS
from tests.engine.test_recent_families import FAMILIES, Family, save_tiny

NAMES = ["smollm3", "glm4_moe", "gpt_oss", "llama4_text", "gemma4_text", "gemma4_moe",
         "minimax_m2"]
MOE = ["glm4_moe", "gpt_oss", "llama4_text", "gemma4_moe", "minimax_m2"]


def _models(tmp_path: Path, name: str, family: Family | None = None
            ) -> tuple[Any, torch.nn.Module]:
    """transformers' and our model of a tiny checkpoint, both in bf16; a `family` (the hybrids)
    is saved in bf16 too, so its (1 + w) norms start from the same rounded w on both sides."""
    from transformers import AutoModelForCausalLM

    save_tiny(tmp_path, family or FAMILIES[name])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    if family is not None:
        hf.save_pretrained(tmp_path)
    ours, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cpu")
    return hf, ours


@pytest.mark.parametrize("name", NAMES)
def test_rms_norms_round_as_transformers_bf16(tmp_path: Path, name: str) -> None:
    hf, ours = _models(tmp_path, name)
    _check_norms(name, hf, ours)


def _check_norms(name: str, hf: Any, ours: torch.nn.Module) -> None:
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


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_norms_and_linear_attention_round_as_transformers_bf16(
        tmp_path: Path, name: str) -> None:
    """The (1 + w) norms on a bf16 input, and the first Gated DeltaNet layer (projections, conv,
    delta rule in fp32, gated norm) on the prompt's embeddings, equal transformers' bf16."""
    hf, ours = _models(tmp_path, name, HYBRIDS[name])
    _check_norms(name, hf, ours)
    got: dict[str, torch.Tensor] = {}
    hooks = [m.get_submodule("model.layers.0.linear_attn").register_forward_hook(
        lambda _m, _i, out, key=key: got.__setitem__(key, out.reshape(-1, out.shape[-1])))
        for key, m in (("hf", hf), ("ours", ours))]
    prompt = torch.randint(3, 200, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        hf(torch.tensor([prompt]))
        SingleSequenceRunner(ours).forward(prompt)
    for hook in hooks:
        hook.remove()
    assert got["ours"].dtype == torch.bfloat16
    torch.testing.assert_close(got["ours"], got["hf"], rtol=0, atol=0)
