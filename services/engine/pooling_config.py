"""How a checkpoint wants its hidden states pooled into one vector (embedding models).

Rules:
- A sentence-transformers layout (`modules.json` naming a `Pooling` module, whose directory
  holds `config.json` with `pooling_mode_*` flags) decides the method: lasttoken -> "last",
  mean_tokens -> "mean", cls_token -> "cls". Without one, decoder models pool the last token
  (what Qwen3-Embedding, e5-mistral and gte-Qwen2 do, and vLLM's default for decoder LLMs).
- A GGUF file says it in `gguf_pooling_type` (llama.cpp's pooling type, which its converter
  writes from the same sentence-transformers config): 1 mean, 2 cls, 3 last.
- The engine setting (`FLOTILLA_POOLING`, not "auto") overrides the checkpoint.
- Matryoshka: `dimensions` below the hidden size is honoured only where the checkpoint says it
  was trained for it (config.json `is_matryoshka: true`, or `matryoshka_dimensions: [...]`,
  which then lists the sizes allowed), as vLLM does; elsewhere it is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MODES = (
    ("pooling_mode_lasttoken", "last"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
)
_GGUF_METHODS = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type


@dataclass(frozen=True)
class ModelPooling:
    """The checkpoint's pooling: `method` (last | mean | cls) and its Matryoshka sizes
    (None: not Matryoshka-trained; an empty tuple: any size up to `hidden_size`)."""

    method: str
    hidden_size: int
    matryoshka: tuple[int, ...] | None = None

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be honoured, or None."""
        if dimensions is None or dimensions == self.hidden_size:
            return None
        if not 1 <= dimensions <= self.hidden_size:
            return f"`dimensions` must be in 1..{self.hidden_size} for this model"
        if self.matryoshka is None:
            return (
                "`dimensions` is not supported: this model was not trained for shortened "
                f"embeddings (Matryoshka); leave it out or send {self.hidden_size}"
            )
        if self.matryoshka and dimensions not in self.matryoshka:
            return (
                f"`dimensions` must be one of {list(self.matryoshka)} for this model "
                "(its Matryoshka sizes)"
            )
        return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def sentence_transformers_method(model_dir: Path) -> str | None:
    """The method a sentence-transformers `modules.json` asks for, or None without one."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            config = _read_json(model_dir / str(module.get("path", "")) / "config.json")
            if isinstance(config, dict):
                for key, method in _MODES:
                    if config.get(key):
                        return method
    return None


def model_pooling(
    model_dir: Path | None, hf_config: dict[str, Any], hidden_size: int, override: str = "auto"
) -> ModelPooling:
    """The pooling of the checkpoint at `model_dir` (see the module rules)."""
    method = override if override != "auto" else None
    if method is None and model_dir is not None and model_dir.is_dir():
        method = sentence_transformers_method(model_dir)
    if method is None:
        method = _GGUF_METHODS.get(hf_config.get("gguf_pooling_type", 0))
    sizes = hf_config.get("matryoshka_dimensions")
    matryoshka: tuple[int, ...] | None = None
    if isinstance(sizes, list) and sizes:
        matryoshka = tuple(int(s) for s in sizes)
    elif hf_config.get("is_matryoshka"):
        matryoshka = ()
    return ModelPooling(method or "last", hidden_size, matryoshka)
