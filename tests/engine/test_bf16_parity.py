"""bf16 prompt logits on CPU against transformers' fp32 truth, as bench/family_parity.py measures.

The bench builds its references with `build_reference`: transformers' bf16 run (the noise floor)
and its fp32 run of the same bf16 weights (the truth). Our bf16 error against the truth must stay
within transformers' own bf16 error (x 1.1). Sizes are reduced from Llama-3-8B / Phi-3-mini but
keep head_dim 128, the rope settings, and attention scores of the real model's scale (weight std
scaled by sqrt(4096 / hidden)), where rounding of the rotary frequencies shows: a truth whose
`inv_freq` went through bf16 (a built model cast with `.to(bf16)`) shares rounded angles with
transformers' bf16 run and puts our exact-frequency rotary at 1.4x transformers' error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.family_parity import PROMPT_LEN, build_reference, compare, load_reference, run_ours
from bench.family_shapes import Family, config_dict
from tests.engine.test_architectures import Case

HIDDEN, HEADS, HEAD_DIM = 512, 4, 128
VOCAB = 4096
X_HF = 1.1  # our error against the truth / transformers' bf16 error against it
SIZES: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, head_dim=HEAD_DIM,
    num_attention_heads=HEADS, initializer_range=0.02 * (4096 / HIDDEN) ** 0.5,
    rms_norm_eps=1e-5, max_position_embeddings=131072)

FAMILIES = {
    "llama3_rope": Family(Case("llama", dict(SIZES, num_key_value_heads=1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
        "Llama-3.1-8B rope, reduced"),
    "phi3_longrope": Family(Case("phi3", dict(
        SIZES, num_key_value_heads=HEADS, original_max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "original_max_position_embeddings": 4096})),
        "Phi-3-mini-128k rope, reduced"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_bf16_error_within_transformers_bf16(name: str, tmp_path: Path) -> None:
    family = FAMILIES[name]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
    ref = build_reference(family, False, tmp_path, prompt, "cpu", torch.bfloat16)
    res = compare(ref, run_ours(tmp_path, prompt, "cpu", "bfloat16"))
    summary = {k: res[k] for k in ("err_fp32", "hf_bf16_vs_fp32", "x_hf")}
    assert res["err_fp32"] < X_HF * res["hf_bf16_vs_fp32"], summary
    assert res["err_fp32"] < 2e-2, summary  # the bench's bar


def test_reference_keeps_rotary_frequencies_fp32(tmp_path: Path) -> None:
    """The bf16 reference computes inv_freq in float32 at load, as transformers' own loading does;
    casting a built model would round it to bf16 (what the truth must not share)."""
    import transformers

    family = Family(Case("llama", dict(FAMILIES["llama3_rope"].case.overrides,
                                       num_hidden_layers=1, hidden_size=256,
                                       intermediate_size=64, num_attention_heads=2,
                                       vocab_size=64, pad_token_id=0)), "tiny")
    config = transformers.AutoConfig.for_model("llama", **config_dict(family, False))
    built = transformers.AutoModelForCausalLM.from_config(config)
    exact = built.model.rotary_emb.inv_freq.clone()
    built.to(torch.bfloat16).save_pretrained(tmp_path)
    loaded = load_reference(family, tmp_path, torch.bfloat16, "cpu", {})
    inv_freq = loaded.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, exact, rtol=0, atol=0)
    assert not torch.equal(exact.bfloat16().float(), exact)  # bf16 would really round it
