"""GGUF files made by llama.cpp's own converter load and match the safetensors they came from.

Tiny random transformers models (llama, qwen2, qwen3, phi3, smollm3) are converted with the
`convert_hf_to_gguf.py` that the llama-cpp-python source distribution ships (downloaded once from
PyPI and cached), so the tensor names, the llama q/k row permutation, fused phi3 tensors, LongRoPE
factor tensors and the metadata are llama.cpp's, not ours. The converter wants a tokenizer in the
model directory: a tiny sentencepiece model is trained on the spot (the converter's BPE path, which
qwen2moe / qwen3moe take, would look the tokenizer up by a hash of known vocabularies, so it is
pointed at the sentencepiece path: only the vocabulary metadata differs, no tensor).

MoE cases (tests/engine/test_moe_models.py's tiny configs): mixtral (GGUF arch "llama" with
experts), qwen2_moe and qwen3_moe, with stacked expert tensors, routers and qwen2moe's gated
shared expert. llama.cpp's qwen2moe has no dense layers, so that case has no `mlp_only_layers`
(the converter refuses `mlp.down_proj` of a dense layer: "Can not map tensor").
DeepSeek-V2 (no q_lora_rank, grouped softmax routing, YaRN with mscale) and DeepSeek-V3
(q_lora_rank, sigmoid routing with correction bias) both convert to arch "deepseek2" with
kv_b_proj split per head into attn_k_b / attn_v_b; a pre-split file (attn_kv_b whole, as older
converters wrote) is rebuilt from the V2 one with kv_b_proj taken from the safetensors.

Families of tests/engine/test_recent_families.py: glm4_moe (arch "glm4moe", its MTP layer
converted as an extra block the loader drops; its GLM tokenizer path is pointed at
sentencepiece too); gpt-oss from float experts and from an MXFP4 checkpoint (llama.cpp keeps
the experts MXFP4: dequantized on the CPU path, kept and repacked where the kernels run);
llama4 (arch "llama4", with llama.cpp's hard-coded chunk size and temperature tuning);
minimax_m2 (arch "minimax-m2": all-heads q/k norms, partial rotary, sigmoid routing with its
correction bias stored as `exp_probs_b`).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from flotilla.kernels.selection import KernelSelection
from flotilla.libs.common.model_cache import cache_dir
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, rel_error
from tests.engine.test_architectures import VOCAB, Case, save_tiny
from tests.engine.test_moe_models import save_tiny as save_tiny_moe
from tests.engine.test_recent_families import FAMILIES, Family, save_mxfp4_gpt_oss
from tests.engine.test_recent_families import save_tiny as save_tiny_recent

_MEMBERS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
            "vendor/llama.cpp/gguf-py/")
# name -> (architecture case, converter outtype, tolerance against the safetensors logits)
CASES: dict[str, tuple[Case, str, float]] = {
    "llama": (Case("llama", {}), "f32", 1e-5),
    "llama_tied_mha": (Case("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
                       "f32", 1e-5),
    "qwen2": (Case("qwen2", {}), "f32", 1e-5),
    "qwen2_f16": (Case("qwen2", {}), "f16", 5e-3),
    "qwen3": (Case("qwen3", dict(head_dim=32)), "f32", 1e-5),
    # llama.cpp's smollm3 skips the rotary on every 4th layer (hard-coded, no GGUF key)
    "smollm3": (Case("smollm3", dict(num_hidden_layers=4)), "f32", 1e-5),
    "phi3_longrope": (Case("phi3", dict(
        original_max_position_embeddings=16, sliding_window=8, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 16, "short_factor": [1.0, 1.1, 1.2, 1.3],
            "long_factor": [2.0, 2.5, 3.0, 3.5]})), "f32", 1e-5),
}
# name -> (test_moe_models.ARCHS key, config overrides, outtype, tolerance)
MOE_CASES: dict[str, tuple[str, dict[str, Any], str, float]] = {
    "mixtral": ("mixtral", {}, "f32", 1e-5),
    "mixtral_f16": ("mixtral", {}, "f16", 5e-3),
    "qwen2_moe": ("qwen2_moe", dict(mlp_only_layers=[]), "f32", 1e-5),
    "qwen3_moe": ("qwen3_moe", {}, "f32", 1e-5),
    "deepseek_v2": ("deepseek_v2", {}, "f32", 1e-4),
    "deepseek_v3": ("deepseek_v3", {}, "f32", 1e-4),
}

# gpt-oss as llama.cpp hard-codes it (its SwiGLU limit of 7; no GGUF key holds another)
GPT_OSS = Family("gpt_oss", {**FAMILIES["gpt_oss"].overrides, "swiglu_limit": 7.0})
# Llama 4 with llama.cpp's hard-coded chunk, temperature scale and floor
LLAMA4 = Family("llama4_text", {**FAMILIES["llama4_text"].overrides, "attention_chunk_size": 8192,
                                "floor_scale": 8192, "attn_scale": 0.1})
# name -> (test_recent_families family, outtype, tolerance, experts as MXFP4 in the checkpoint)
RECENT_CASES: dict[str, tuple[Family, str, float, bool]] = {
    "glm4_moe": (FAMILIES["glm4_moe"], "f32", 1e-5, False),
    "gpt_oss": (GPT_OSS, "f32", 1e-5, False),
    "gpt_oss_mxfp4": (GPT_OSS, "f32", 1e-5, True),
    "llama4_text": (LLAMA4, "f32", 1e-5, False),
    "minimax_m2": (FAMILIES["minimax_m2"], "f32", 1e-5, False),
}


@pytest.fixture(scope="session")
def llama_cpp_converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py with its `conversion` package and gguf-py."""
    dest = cache_dir() / "llama-cpp-convert"
    if (dest / ".complete").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-q", "-d", tmp, "llama-cpp-python"]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            pytest.skip("could not download the llama-cpp-python sdist (GGUF converter)")
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            for member in tar:
                name = member.name.split("/", 1)[-1]
                if member.isfile() and name.startswith(_MEMBERS):
                    member.name = name.removeprefix("vendor/llama.cpp/")
                    tar.extract(member, dest, filter="data")
    (dest / ".complete").touch()
    return dest


def _sentencepiece_model() -> bytes:
    spm = pytest.importorskip("sentencepiece")
    text = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(100)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=out, vocab_size=64,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    return out.getvalue()


@pytest.fixture(scope="module")
def converted(llama_cpp_converter: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, tuple[Path, Path]]:
    """name -> (safetensors dir, GGUF file); one converter process for all cases."""
    root = tmp_path_factory.mktemp("gguf")
    tokenizer = _sentencepiece_model()
    jobs: list[tuple[str, str, str]] = []
    paths: dict[str, tuple[Path, Path]] = {}
    for name, (case, outtype, _) in CASES.items():
        hf_dir, gguf = root / name, root / f"{name}.gguf"
        save_tiny(hf_dir, case)
        (hf_dir / "tokenizer.model").write_bytes(tokenizer)
        jobs.append((str(hf_dir), outtype, str(gguf)))
        paths[name] = (hf_dir, gguf)
    for name, (arch, extra, outtype, _) in MOE_CASES.items():
        hf_dir, gguf = root / name, root / f"{name}.gguf"
        save_tiny_moe(hf_dir, arch, **extra)
        (hf_dir / "tokenizer.model").write_bytes(tokenizer)
        jobs.append((str(hf_dir), outtype, str(gguf)))
        paths[name] = (hf_dir, gguf)
    for name, (family, outtype, _, mxfp4) in RECENT_CASES.items():
        hf_dir, gguf = root / name, root / f"{name}.gguf"
        if mxfp4:
            save_mxfp4_gpt_oss(root / name, family)
            hf_dir = root / name / "mxfp4"
        else:
            save_tiny_recent(hf_dir, family)
        (hf_dir / "tokenizer.model").write_bytes(tokenizer)
        jobs.append((str(hf_dir), outtype, str(gguf)))
        paths[name] = (hf_dir, gguf)
    driver = (f"import sys; sys.path.insert(0, {str(llama_cpp_converter)!r})\n"
              "import convert_hf_to_gguf as c\n"
              "from conversion.base import TextModel\n"
              "TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece\n"
              "TextModel._set_vocab_glm = TextModel._set_vocab_sentencepiece\n"
              f"for src, outtype, out in {jobs!r}:\n"
              "    sys.argv = ['convert', src, '--outtype', outtype, '--outfile', out]\n"
              "    c.main()\n")
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return paths


def _tolerance(name: str) -> tuple[str, float]:
    if name in CASES:
        return CASES[name][1], CASES[name][2]
    if name in MOE_CASES:
        return MOE_CASES[name][2], MOE_CASES[name][3]
    return RECENT_CASES[name][1], RECENT_CASES[name][2]


def test_gpt_oss_mxfp4_gguf_keeps_its_experts_mxfp4(converted: dict[str, tuple[Path, Path]]
                                                   ) -> None:
    """Where the quantized kernels run (forced here: the interpreter), llama.cpp's MXFP4 expert
    blocks are repacked and served by kernels/mxfp4_moe.py, matching the safetensors' experts
    dequantized on the CPU path."""
    hf_dir, gguf = converted["gpt_oss_mxfp4"]
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SingleSequenceRunner(load_model(hf_dir)[0]).forward(prompt)
    model, _ = load_model(gguf, quantization="gguf",
                          kernel_selection=KernelSelection(quant_kernels="triton"))
    assert model.model.layers[0].mlp.experts.w13.blocks.dtype == torch.uint8
    err = rel_error(SingleSequenceRunner(model).forward(prompt), ref)
    assert err < 1e-5, f"MXFP4 GGUF (kept) vs safetensors logits rel. error {err:.2e}"


@pytest.mark.parametrize("name", [*CASES, *MOE_CASES, *RECENT_CASES])
def test_converted_gguf_matches_its_safetensors(converted: dict[str, tuple[Path, Path]],
                                                name: str) -> None:
    hf_dir, gguf = converted[name]
    outtype, tolerance = _tolerance(name)
    ref_model, ref_config = load_model(hf_dir)
    model, config = load_model(gguf)
    assert config.architecture == ref_config.architecture
    same: dict[str, Any] = {f: getattr(ref_config, f) for f in (
        "num_layers", "num_heads", "num_kv_heads", "head_dim", "rotary_dim", "sliding_window",
        "tie_word_embeddings", "vocab_size", "rope_theta")}
    assert {f: getattr(config, f) for f in same} == same
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SingleSequenceRunner(ref_model).forward(prompt)
    err = rel_error(SingleSequenceRunner(model).forward(prompt), ref)
    print(f"{name} ({outtype}): GGUF vs safetensors logits rel. error {err:.2e}")
    assert err < tolerance


def test_pre_split_deepseek2_gguf_matches_its_safetensors(
        converted: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Older llama.cpp converters wrote kv_b_proj whole (attn_kv_b) and the per-head sizes as
    key_length / value_length with head_count_kv = head count (no *_length_mla keys)."""
    gguf = pytest.importorskip("gguf")
    hf_dir, split_file = converted["deepseek_v2"]
    hf = json.loads((hf_dir / "config.json").read_text())
    state = load_file(hf_dir / "model.safetensors")
    reader = gguf.GGUFReader(split_file)
    old = gguf.GGUFWriter(tmp_path / "old.gguf", "deepseek2")
    replaced = ("key_length", "value_length", "key_length_mla", "value_length_mla",
                "head_count_kv")
    for key, field in reader.fields.items():
        if key.startswith("deepseek2.") and key.rsplit(".", 1)[1] not in replaced:
            old.add_key_value(key, field.contents(), field.types[0])
    old.add_key_length(hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
    old.add_value_length(hf["v_head_dim"])
    old.add_head_count_kv(hf["num_attention_heads"])
    for tensor in reader.tensors:
        if tensor.name.endswith(".attn_k_b.weight"):
            continue
        if tensor.name.endswith(".attn_v_b.weight"):
            layer = tensor.name.split(".")[1]
            kv_b = state[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].numpy()
            old.add_tensor(f"blk.{layer}.attn_kv_b.weight", kv_b)
        else:
            old.add_tensor(tensor.name, np.array(tensor.data))
    old.write_header_to_file()
    old.write_kv_data_to_file()
    old.write_tensors_to_file()
    old.close()
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = SingleSequenceRunner(load_model(hf_dir)[0]).forward(prompt)
    err = rel_error(SingleSequenceRunner(load_model(tmp_path / "old.gguf")[0]).forward(prompt), ref)
    assert err < 1e-4, f"pre-split deepseek2 GGUF vs safetensors logits rel. error {err:.2e}"
