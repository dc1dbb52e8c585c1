"""Gemma 2 / Gemma 3 GGUFs made by llama.cpp's own converter (the llama-cpp-python sdist's
convert_hf_to_gguf.py, as tests/engine/test_gguf_architectures.py runs it) load and match the
safetensors they came from: the converter's 1 + w norms are undone, its norm names mapped, and
the hyper-parameters llama.cpp hard-codes (attention scale, sliding period, local rope base)
reproduced. The tiny configs follow what llama.cpp assumes of real non-27B Gemmas
(query_pre_attn_scalar = head_dim; Gemma 3: every 6th layer global)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.loader import load_model
from flotilla.services.engine.loader.gguf_gemma import gemma_config
from flotilla.services.engine.model_config import ModelConfig
from tests.engine.conftest import SingleSequenceRunner, rel_error
from tests.engine.test_architectures import GEMMA, VOCAB, Case, save_tiny
from tests.engine.test_gguf_architectures import (  # noqa: F401 (fixture)
    _sentencepiece_model,
    llama_cpp_converter,
)

GEMMA_LLAMA_CPP = dict(GEMMA, query_pre_attn_scalar=16)  # head_dim 16
CASES: dict[str, Case] = {
    "gemma2": Case("gemma2", dict(GEMMA_LLAMA_CPP, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=3.0)),
    "gemma3": Case("gemma3_text", dict(GEMMA_LLAMA_CPP, num_hidden_layers=6,
                                       sliding_window_pattern=6, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})),
}


@pytest.fixture(scope="module")
def converted(llama_cpp_converter: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
              ) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("gemma-gguf")
    tokenizer = _sentencepiece_model()
    jobs, paths = [], {}
    for name, case in CASES.items():
        hf_dir, gguf = root / name, root / f"{name}.gguf"
        save_tiny(hf_dir, case)
        (hf_dir / "tokenizer.model").write_bytes(tokenizer)
        jobs.append((str(hf_dir), "f32", str(gguf)))
        paths[name] = (hf_dir, gguf)
    driver = (f"import sys; sys.path.insert(0, {str(llama_cpp_converter)!r})\n"
              "import convert_hf_to_gguf as c\n"
              f"for src, outtype, out in {jobs!r}:\n"
              "    sys.argv = ['convert', src, '--outtype', outtype, '--outfile', out]\n"
              "    c.main()\n")
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return paths


@pytest.mark.parametrize("name", list(CASES))
def test_converted_gemma_gguf_matches_its_safetensors(converted: dict[str, tuple[Path, Path]],
                                                      name: str) -> None:
    hf_dir, gguf = converted[name]
    ref_model, ref_config = load_model(hf_dir)
    model, config = load_model(gguf)
    fields = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "sliding_window",
              "layer_types", "tie_word_embeddings", "vocab_size", "rope_theta", "rope_scaling",
              "sliding_rope_theta", "hidden_act", "attention_scale", "attn_logit_softcapping",
              "final_logit_softcapping")
    same: dict[str, Any] = {f: getattr(ref_config, f) for f in fields}
    assert {f: getattr(config, f) for f in fields} == same
    assert config.architecture == ref_config.architecture.replace(
        "Gemma3ForConditionalGeneration", "Gemma3ForCausalLM")
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.allclose(norm, ref_model.model.layers[0].input_layernorm.weight, atol=1e-6)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SingleSequenceRunner(ref_model).forward(prompt)
    err = rel_error(SingleSequenceRunner(model).forward(prompt), ref)
    assert err < 1e-5, err


def _config(layers: int, hidden: int = 4608, heads: int = 32, head_dim: int = 128
            ) -> ModelConfig:
    return ModelConfig(architecture="x", vocab_size=8, hidden_size=hidden, intermediate_size=8,
                       num_layers=layers, num_heads=heads, num_kv_heads=heads,
                       head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=8, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_ids=[], dtype=torch.float32)


def test_llama_cpp_hard_coded_gemma_hyper_parameters() -> None:
    # Gemma 2 27B (46 layers): scale 1 / sqrt(hidden / heads); 9B: 1 / sqrt(head_dim)
    meta = {"general.architecture": "gemma2"}
    assert gemma_config(_config(46), meta, set()).attention_scale == pytest.approx(144**-0.5)
    nine_b = gemma_config(_config(42, 3584, 16, 256), meta, set())
    assert nine_b.attention_scale == pytest.approx(256**-0.5)
    assert nine_b.sliding_window == 4096 and nine_b.layer_types[:2] == [
        "sliding_attention", "full_attention"]
    # Gemma 3 without rope.freq_base_swa: local base 10000; a per-layer pattern array wins
    meta3 = {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 512,
             "gemma3.attention.sliding_window_pattern": [True, False, True]}
    g3 = gemma_config(_config(3, 1152, 4, 256), meta3, set())
    assert g3.sliding_rope_theta == 10000.0 and g3.layer_types == [
        "sliding_attention", "full_attention", "sliding_attention"]
    assert gemma_config(_config(62, 5376, 32, 128), meta3 | {
        "gemma3.attention.sliding_window_pattern": 6}, set()).attention_scale == pytest.approx(
            168**-0.5)
