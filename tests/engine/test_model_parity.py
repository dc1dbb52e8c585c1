"""Our LlamaForCausalLM against transformers' on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.loader import load_model
from tests.engine.conftest import (
    BASE,
    SingleSequenceRunner,
    rel_error,
    save_tiny_llama,
    tensor_parallel_logits,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "llama3_rope": {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "tied": {"tie_word_embeddings": True},
    "mha_bias": {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logits_and_greedy_match_transformers(tmp_path: Path, variant: str) -> None:
    hf = save_tiny_llama(tmp_path, **VARIANTS[variant])
    model, config = load_model(tmp_path, dtype=torch.float32, device="cpu")
    assert model.config is config
    assert config.tie_word_embeddings == VARIANTS[variant].get("tie_word_embeddings", False)
    runner = SingleSequenceRunner(model, max_tokens=64)
    prompt = torch.randint(0, BASE["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        ref_logits = hf(prompt[None]).logits[0]
    assert rel_error(runner.forward(prompt.tolist()), ref_logits) < 1e-4

    hf.generation_config.eos_token_id = None  # a random model must not stop early
    with torch.no_grad():
        ref = hf.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]),
                          max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = ref[0, len(prompt):].tolist()
    assert runner.greedy_recompute(prompt.tolist(), 16) == expected
    assert runner.greedy_cached(prompt.tolist(), 16) == expected


def test_chunked_prefill_matches_full_prefill(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    model, _ = load_model(tmp_path)
    prompt = list(range(3, 40))
    full = SingleSequenceRunner(model).forward(prompt)
    chunked = SingleSequenceRunner(model)
    parts = [chunked.forward(prompt[:17]), chunked.forward(prompt[17:30], start=17),
             chunked.forward(prompt[30:], start=30)]
    assert rel_error(torch.cat(parts), full) < 1e-5


def test_int8_weight_only_stays_close_to_float(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, tie_word_embeddings=True)
    ref_model, _ = load_model(tmp_path)
    q_model, _ = load_model(tmp_path, quantization="int8")
    prompt = list(range(5, 29))
    ref = SingleSequenceRunner(ref_model).forward(prompt)
    ours = SingleSequenceRunner(q_model).forward(prompt)
    assert rel_error(ours, ref) < 3e-2
    # The tied embedding keeps its float weight; only the LM head holds int8.
    assert q_model.model.embed_tokens.weight.dtype == torch.float32
    assert q_model.lm_head.weight_int8.dtype == torch.int8


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_single_rank(tmp_path: Path) -> None:
    # 4 heads / 2 kv heads / vocab 256 / intermediate 128 all split over 2 ranks.
    save_tiny_llama(tmp_path / "ckpt", tie_word_embeddings=True)
    prompt = list(range(7, 30))
    single = SingleSequenceRunner(load_model(tmp_path / "ckpt").model).forward(prompt)
    assert rel_error(tensor_parallel_logits(tmp_path / "ckpt", prompt), single) < 1e-5
