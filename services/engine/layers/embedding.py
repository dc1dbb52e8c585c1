"""Vocabulary-parallel token embedding and LM head.

Rules:
- Each rank holds rows [rank * per_rank, (rank + 1) * per_rank) of the (padded) vocabulary;
  the vocabulary is padded up to a multiple of the tp size and padded rows are never read.
- The embedding zeroes ids outside its shard and all-reduces, so every rank gets full rows.
- The LM head owns a `QuantMethod` (it is a linear layer over hidden states); with tied
  embeddings the model points `lm_head.weight` at the embedding's parameter before loading.
  A method with `owns_lm_head_weight` (a GGUF file's quantized `output.weight`) registers the
  head's weight itself and loads its rows (padded rows stay zero blocks).
  `forward` gathers the shards and returns float32 logits of the true vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.services.engine.distributed import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)
from flotilla.services.engine.quant.base import QuantConfig, get_quant_method


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.size(0) != self.num_embeddings:
            raise ValueError(f"embedding has {loaded.size(0)} rows, config says "
                             f"{self.num_embeddings}")
        rows = min(self.per_rank, self.num_embeddings - self.vocab_start)
        method = getattr(self, "quant_method", None)
        if method is not None and method.owns_lm_head_weight:  # GGUF blocks: rows of blocks
            method.load(param.data[:rows], loaded.narrow(0, self.vocab_start, rows))
        else:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [N, H] -> logits [N, vocab] float32, through this layer's QuantMethod."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 quant_config: QuantConfig | None = None, prefix: str = "lm_head") -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.quant_method = get_quant_method(quant_config, self, prefix)
        if self.quant_method.owns_lm_head_weight:  # its own weight layout (GGUF blocks)
            self.quant_method.create_weights(self, embedding_dim, self.per_rank,
                                             torch.get_default_dtype())
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = self.quant_method.apply(self, hidden)
        logits = tp_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()

