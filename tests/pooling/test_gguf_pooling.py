"""Embedding and reranker checkpoints converted to GGUF by llama.cpp's own converter
(`convert_hf_to_gguf.py` from the llama-cpp-python sdist, tests/engine/test_gguf_architectures.py)
pool and score as the transformers reference on the safetensors they came from (fp32, 1e-4).

- Qwen3-Embedding layout (sentence-transformers Pooling module): the converter writes
  `qwen3.pooling_type` (LAST, or MEAN for a mean-pooling config); the GGUF alone must say
  "embedding" and choose the method.
- Qwen3-Reranker (model card "# Qwen3-Reranker"): the converter writes pooling type RANK and
  keeps only the "yes" / "no" rows of the LM head as `cls.output` (labels `yes`, `no`); the
  engine's logits of those two ids must equal transformers' (untied and tied heads).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.libs.common.model_capabilities import model_kind
from flotilla.services.engine.pooling import PoolingParams
from flotilla.services.tokenizer.gguf_metadata import gguf_pooling_type
from tests.engine.test_gguf_architectures import llama_cpp_converter  # noqa: F401 (fixture)
from tests.engine.test_pooling import drain, make_engine, prompts
from tests.pooling.models import reference, save_tiny_qwen3

RERANKER_CARD = "---\npipeline_tag: text-ranking\n---\n# Qwen3-Reranker-0.6B\n"
# name -> (save_tiny_qwen3 pooling, config overrides, a reranker's model card)
CASES: dict[str, tuple[str | None, dict[str, Any], bool]] = {
    "embed_last": ("lasttoken", {}, False),
    "embed_mean": ("mean_tokens", {}, False),
    "rerank": (None, {}, True),
    "rerank_tied": (None, {"tie_word_embeddings": True}, True),
}


@pytest.fixture(scope="module")
def converted(
    llama_cpp_converter: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Any, Path]]:
    """name -> (transformers model, GGUF file); one converter process for all cases. The tiny
    byte-level BPE tokenizer is written as llama.cpp's "qwen2" pre-tokenizer (the converter
    recognizes vocabularies by a hash of known ones; the tensors do not depend on it)."""
    root = tmp_path_factory.mktemp("gguf-pooling")
    jobs, out = [], {}
    for name, (pooling, overrides, card) in CASES.items():
        hf_dir = root / name
        hf = save_tiny_qwen3(hf_dir, pooling, tokenizer=True, **overrides)
        if card:
            (hf_dir / "README.md").write_text(RERANKER_CARD)
        jobs.append((str(hf_dir), str(root / f"{name}.gguf")))
        out[name] = (hf, root / f"{name}.gguf")
    driver = (
        f"import sys; sys.path.insert(0, {str(llama_cpp_converter)!r})\n"
        "import convert_hf_to_gguf as c\n"
        "from conversion.base import TextModel\n"
        "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'\n"
        f"for src, dst in {jobs!r}:\n"
        "    sys.argv = ['convert', src, '--outtype', 'f32', '--outfile', dst]\n"
        "    c.main()\n"
    )
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.parametrize(("name", "method"), [("embed_last", "last"), ("embed_mean", "mean")])
def test_embedding_gguf_pools_as_its_safetensors(
    converted: dict[str, tuple[Any, Path]], name: str, method: str
) -> None:
    hf, gguf = converted[name]
    assert model_kind(gguf, ["served"], gguf_pooling_type(gguf)) == "embed"
    engine = make_engine(gguf)
    assert engine.model_pooling.method == method  # from the GGUF's pooling_type alone
    ps = prompts(4)
    for i, p in enumerate(ps):
        engine.add_request(f"e{i}", p, PoolingParams(engine.model_pooling.method))
    done = drain(engine)
    for i, p in enumerate(ps):
        torch.testing.assert_close(
            done[f"e{i}"].pooled, reference(hf, p, method), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("name", ["rerank", "rerank_tied"])
def test_reranker_gguf_scores_yes_and_no_as_its_safetensors(
    converted: dict[str, tuple[Any, Path]], name: str
) -> None:
    from transformers import AutoTokenizer

    hf, gguf = converted[name]
    assert model_kind(gguf, ["served"], gguf_pooling_type(gguf)) == "rerank"
    tok = AutoTokenizer.from_pretrained(gguf.parent / name)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    engine = make_engine(gguf)
    ps = prompts(4)
    for i, p in enumerate(ps):
        engine.add_request(f"r{i}", p, PoolingParams("last", logit_ids=(no, yes)))
    done = drain(engine)
    for i, p in enumerate(ps):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p])).logits[0, -1]
        want = torch.stack([logits[no], logits[yes]])
        torch.testing.assert_close(done[f"r{i}"].pooled, want, atol=1e-4, rtol=1e-4)


def test_kind_from_a_gguf_pooling_type() -> None:
    """llama.cpp's pooling types: NONE (or none written) leaves the names to decide."""
    assert [model_kind(None, ["m"], t) for t in (None, 0, 1, 2, 3, 4)] == [
        "generate",
        "generate",
        "embed",
        "embed",
        "embed",
        "rerank",
    ]
    assert model_kind(None, ["qwen3-reranker"], 0) == "rerank"
