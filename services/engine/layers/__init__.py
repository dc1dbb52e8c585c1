"""Shared model layers: every architecture file is built from these."""

from flotilla.services.engine.layers.activation import (
    GeluAndMul,
    SiluAndMul,
    gated_projection,
    get_gated_activation,
)
from flotilla.services.engine.layers.attention import Attention
from flotilla.services.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from flotilla.services.engine.layers.layernorm import (
    GemmaRMSNorm,
    LayerNorm,
    RMSNorm,
    RMSNormFp32Scale,
)
from flotilla.services.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from flotilla.services.engine.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "GeluAndMul",
    "GemmaRMSNorm",
    "LayerNorm",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RMSNormFp32Scale",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "gated_projection",
    "get_gated_activation",
    "get_rope",
]
