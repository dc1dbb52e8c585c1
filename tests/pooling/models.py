"""Tiny embedding checkpoints made offline: a random Qwen3 saved as Qwen3-Embedding ships
(sentence-transformers `modules.json` + `1_Pooling/config.json`, a tokenizer whose
post-processor appends `<|endoftext|>`), and the transformers reference that pools it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

VOCAB = 320
EOS_TEXT = "<|endoftext|>"
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a cat sat on the mat",
    "embeddings map text to vectors",
    "rerankers order documents by relevance",
    "paris is the capital of france",
    "the weather is sunny today",
] * 20 + ["yes", "no"] * 200  # single tokens, as a reranker's answers are


def save_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (< VOCAB ids) that appends EOS to every text, saved as
    tokenizer.json + tokenizer_config.json (transformers' layout)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=VOCAB - 8,
            special_tokens=[EOS_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    eos = tok.token_to_id(EOS_TEXT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TEXT}", special_tokens=[(EOS_TEXT, eos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, pad_token=EOS_TEXT)
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(path)


def save_tiny_qwen3(
    path: Path, pooling: str | None = None, tokenizer: bool = False, **overrides: Any
) -> Any:
    """A tiny random Qwen3ForCausalLM; with `pooling` (lasttoken / mean_tokens / cls_token) a
    sentence-transformers Pooling module as Qwen3-Embedding ships it; with `tokenizer` a real
    tokenizer beside it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy: import only when used

    torch.manual_seed(0)
    values: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    cfg = Qwen3Config(**{**values, **overrides})
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    if pooling is not None:
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {
                        "idx": 0,
                        "name": "0",
                        "path": "",
                        "type": "sentence_transformers.models.Transformer",
                    },
                    {
                        "idx": 1,
                        "name": "1",
                        "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling",
                    },
                    {
                        "idx": 2,
                        "name": "2",
                        "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize",
                    },
                ]
            )
        )
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True})
        )
    return model


def reference(
    model: Any,
    prompt: list[int],
    method: str,
    normalize: bool = True,
    dimensions: int | None = None,
) -> torch.Tensor:
    """transformers' last hidden state of `prompt`, pooled as sentence-transformers does."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[
            0
        ]
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    if dimensions is not None:
        vec = vec[:dimensions]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec
