"""Checkpoint loading: sharded safetensors, the real GGUF default model, hub cache, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.libs.common.model_cache import ensure_default_model, resolve_model
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, rel_error, save_tiny_llama

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]


def test_sharded_safetensors_load_and_match(tmp_path: Path) -> None:
    hf = save_tiny_llama(tmp_path, tie_word_embeddings=False)
    shutil.rmtree(tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = load_model(tmp_path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]) % 256).logits[0]
    ours = SingleSequenceRunner(model).forward([t % 256 for t in PROMPT])
    assert rel_error(ours, ref) < 1e-4


def test_unknown_architecture_names_supported_ones(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'FooForCausalLM'.*supported: .*LlamaForCausalLM"):
        load_model(tmp_path)


def test_fp8_checkpoint_is_rejected_clearly(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"F8_E4M3.*supported checkpoint dtypes: F32, F16, BF16"):
        load_model(tmp_path)


def test_hub_cache_snapshot_resolves_and_loads(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    hub = tmp_path / "hf" / "hub"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / "models--org--name"
    save_tiny_llama(repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its environment at import; point the live constants at the tmp cache.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    path = resolve_model("org/name")
    assert path.resolve() == (repo / "snapshots" / revision).resolve()
    model, config = load_model(path)
    assert config.architecture == "LlamaForCausalLM" and config.num_layers == 2
    assert SingleSequenceRunner(model).forward([1, 2, 3]).shape == (3, 256)


def _transformers_gguf_reference(path: Path) -> torch.nn.Module:
    """transformers' own GGUF loading: from_pretrained(gguf_file=...) when accelerate is present,
    else the same dequantize/rename/un-permute code (load_gguf_checkpoint) into LlamaForCausalLM."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    except (ImportError, ValueError) as exc:
        if "accelerate" not in str(exc):
            raise
    config = LlamaConfig(**load_gguf_checkpoint(str(path))["config"])
    hf = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    result = hf.load_state_dict(tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    hf.tie_weights()
    return hf.eval()


@pytest.mark.slow
def test_default_gguf_loads_and_matches_transformers() -> None:
    path = ensure_default_model()
    model, config = load_model(path, dtype=torch.float32, device="cpu")
    assert (config.architecture, config.num_layers, config.hidden_size) == \
        ("LlamaForCausalLM", 30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings) == (49152, True)
    assert config.rope_theta == 100000.0 and config.eos_token_ids == [2]
    ours = SingleSequenceRunner(model).forward(PROMPT)
    del model
    hf = _transformers_gguf_reference(path)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert rel_error(ours, ref) < 1e-3


def test_gguf_rope_freq_factors_equal_llama3_scaling() -> None:
    """Llama 3.1 GGUFs carry llama3 rope scaling as a `rope_freqs` tensor of per-frequency
    divisors; built the way llama.cpp's converter builds it, it must give HF's llama3 inv_freq."""
    import math

    from flotilla.services.engine.layers.rotary import compute_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    base, dim = 500000.0, 128
    factors = []
    for i in range(0, dim, 2):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < 8192 / 4.0:
            factors.append(1.0)
        elif wavelen > 8192 / 1.0:
            factors.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    from_factors = compute_inv_freq(dim, base, {"rope_type": "freq_factors", "factors": factors})
    torch.testing.assert_close(from_factors, compute_inv_freq(dim, base, scaling))
