"""What a checkpoint is for (generation, embeddings, reranking) and so what it can serve.

Rules:
- Evidence from the checkpoint directory, first match wins:
  1. a cross-encoder: `architectures` naming a `*ForSequenceClassification`, or a
     sentence-transformers `config_sentence_transformers.json` whose `model_type` is
     `CrossEncoder` -> reranker;
  2. the model card's `pipeline_tag` (README.md front matter, as Hugging Face snapshots ship
     it): `text-ranking` -> reranker; `feature-extraction` / `sentence-similarity` -> embedding;
  3. a sentence-transformers `modules.json` with a `Pooling` module -> embedding;
     for a GGUF file, the pooling type llama.cpp's converter wrote (`{arch}.pooling_type`,
     from that same module or a reranker's card): MEAN / CLS / LAST -> embedding, RANK ->
     reranker (NONE or absent: no evidence);
  4. only then a name (served name or directory) containing "reranker" -> reranker (the
     fallback for a bare Qwen3-Reranker layout: a causal LM with no other mark);
  5. otherwise a generative model.
- What each kind serves: a generative model everything (its last-token embeddings and cosine
  scores work, they are just not what it was trained for); an embedding model embeddings and
  cosine score / rerank, never generation; a reranker score / rerank and generation (Qwen3-
  Reranker is a causal LM that clients also run as a judging chat model), never embeddings.
- The engine announces the capabilities; the gateway refuses a request its model cannot serve
  with a 400 naming `model`; the tokenizer scores pairs as a reranker where the kind says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

Capability = Literal["generate", "embed", "score"]
ModelKind = Literal["generate", "embed", "rerank"]

CAPABILITIES: dict[ModelKind, tuple[Capability, ...]] = {
    "generate": ("generate", "embed", "score"),
    "embed": ("embed", "score"),
    "rerank": ("generate", "score"),
}

_PIPELINE_TAGS: dict[str, ModelKind] = {
    "text-ranking": "rerank",
    "feature-extraction": "embed",
    "sentence-similarity": "embed",
}
# llama.cpp's `enum llama_pooling_type` as GGUF stores it -> the kind it marks
GGUF_POOLING_KINDS: dict[int, ModelKind] = {1: "embed", 2: "embed", 3: "embed", 4: "rerank"}
_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---", re.DOTALL)
_PIPELINE_TAG = re.compile(r"^pipeline_tag:\s*['\"]?([\w-]+)", re.MULTILINE)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pipeline_tag(model_dir: Path) -> str | None:
    try:
        text = (model_dir / "README.md").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    front = _FRONT_MATTER.match(text)
    found = _PIPELINE_TAG.search(front.group(1)) if front else None
    return found.group(1) if found else None


def has_pooling_module(model_dir: Path) -> bool:
    modules = _read_json(model_dir / "modules.json")
    return isinstance(modules, list) and any(
        isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling") for m in modules
    )


def model_kind(
    model_dir: Path | None, names: list[str], gguf_pooling_type: int | None = None
) -> ModelKind:
    """The kind of the checkpoint at `model_dir` (a directory; a GGUF file or None: its
    `gguf_pooling_type`, then names only)."""
    if gguf_pooling_type in GGUF_POOLING_KINDS:
        return GGUF_POOLING_KINDS[gguf_pooling_type]
    if model_dir is not None and model_dir.is_dir():
        config = _read_json(model_dir / "config.json")
        architectures = config.get("architectures") if isinstance(config, dict) else None
        if any(str(a).endswith("ForSequenceClassification") for a in architectures or []):
            return "rerank"
        st_config = _read_json(model_dir / "config_sentence_transformers.json")
        if isinstance(st_config, dict) and st_config.get("model_type") == "CrossEncoder":
            return "rerank"
        tagged = _PIPELINE_TAGS.get(_pipeline_tag(model_dir) or "")
        if tagged is not None:
            return tagged
        if has_pooling_module(model_dir):
            return "embed"
    if any("reranker" in n.lower() for n in names):
        return "rerank"
    return "generate"


def capabilities(kind: ModelKind) -> list[Capability]:
    return list(CAPABILITIES[kind])
