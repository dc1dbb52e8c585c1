"""What a checkpoint is for, from its files (model_capabilities.py): the layouts real
checkpoints ship (Qwen3-Embedding's sentence-transformers config, a cross-encoder's
`*ForSequenceClassification`, a Hugging Face model card's `pipeline_tag`), the name only as the
fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flotilla.libs.common.model_capabilities import capabilities, model_kind

ST_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


def checkpoint(path: Path, architecture: str = "Qwen3ForCausalLM", **files: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name.replace("__", ".")).write_text(text)
    return path


def test_a_plain_causal_lm_generates_and_pools(tmp_path: Path) -> None:
    assert model_kind(checkpoint(tmp_path / "m"), ["m"]) == "generate"
    assert capabilities("generate") == ["generate", "embed", "score"]


def test_sentence_transformers_pooling_makes_an_embedding_model(tmp_path: Path) -> None:
    path = checkpoint(tmp_path / "Qwen3-Embedding-0.6B", modules__json=ST_MODULES)
    assert model_kind(path, ["anything"]) == "embed"
    assert capabilities("embed") == ["embed", "score"]


@pytest.mark.parametrize(
    ("tag", "kind"),
    [
        ("text-ranking", "rerank"),
        ("feature-extraction", "embed"),
        ("sentence-similarity", "embed"),
        ("text-generation", "generate"),
    ],
)
def test_the_model_cards_pipeline_tag(tmp_path: Path, tag: str, kind: str) -> None:
    card = f"---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: {tag}\n---\n# x\n"
    assert model_kind(checkpoint(tmp_path / "m", README__md=card), ["m"]) == kind


def test_cross_encoders_are_rerankers(tmp_path: Path) -> None:
    seq_cls = checkpoint(tmp_path / "a", "Qwen3ForSequenceClassification")
    assert model_kind(seq_cls, ["a"]) == "rerank"
    st_cross = checkpoint(
        tmp_path / "b", config_sentence_transformers__json={"model_type": "CrossEncoder"}
    )
    assert model_kind(st_cross, ["b"]) == "rerank"
    assert capabilities("rerank") == ["generate", "score"]


def test_the_name_is_only_the_fallback(tmp_path: Path) -> None:
    bare = checkpoint(tmp_path / "Qwen3-Reranker-0.6B")
    assert model_kind(bare, ["qwen3-reranker"]) == "rerank"
    embedder = checkpoint(tmp_path / "embed", modules__json=ST_MODULES)
    assert model_kind(embedder, ["my-reranker"]) == "embed"  # the files win over the name
    assert model_kind(None, ["some-gguf"]) == "generate"
