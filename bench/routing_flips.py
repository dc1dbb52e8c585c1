"""Expert choices of MoE routers, captured during one forward, for bench/family_parity.py.

A bf16 logits error in a mixture-of-experts model can come from the arithmetic or from the
routing: a token whose top-k expert set changes between bf16 and fp32 runs a different MLP, a
step change no rounding analysis bounds. `capture_routing` records the top-k expert ids of
every router call (one [T, K] tensor per MoE layer, in call order) so two runs of the same
prompt can be compared token by token with `routing_flips`.

Routers are found by type, not by name: transformers' `*TopKRouter` / `*TopkRouter` modules
(output (logits, weights, indices)) and the engine's `services.engine.layers.moe.Router` and
`Gemma4Router` (output (weights, ids)).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from flotilla.services.engine.layers.moe import Router
from flotilla.services.engine.models.gemma4_moe import Gemma4Router

ENGINE_ROUTERS = (Router, Gemma4Router)  # output (weights, ids)


def _indices(module: nn.Module, output: Any) -> torch.Tensor | None:
    if isinstance(module, ENGINE_ROUTERS):
        return output[1]
    if type(module).__name__ == "Llama4Router":  # (scores, logits): unchosen experts score 0
        return output[0].topk(module.top_k, dim=-1).indices
    if type(module).__name__.lower().endswith("router") and isinstance(output, tuple):
        return output[2]
    return None


@contextmanager
def capture_routing(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Yields a list that fills with each router call's top-k ids (int64 [T, K], on CPU)."""
    calls: list[torch.Tensor] = []

    def hook(module: nn.Module, _inputs: Any, output: Any) -> None:
        ids = _indices(module, output)
        if ids is not None:
            calls.append(ids.detach().reshape(-1, ids.shape[-1]).to("cpu", torch.int64))

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, ENGINE_ROUTERS) or type(m).__name__.lower().endswith("router")]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def routing_flips(a: list[torch.Tensor], b: list[torch.Tensor], tokens: int) -> dict[str, Any]:
    """Tokens (of the first `tokens` rows) whose top-k expert *set* differs between runs `a` and
    `b`, per MoE layer and over any layer; order inside the top-k does not count."""
    if len(a) != len(b):
        raise ValueError(f"router call counts differ: {len(a)} vs {len(b)}")
    per_layer: list[int] = []
    any_layer = torch.zeros(tokens, dtype=torch.bool)
    for x, y in zip(a, b, strict=True):
        differ = (x[:tokens].sort(-1).values != y[:tokens].sort(-1).values).any(-1)
        per_layer.append(int(differ.sum()))
        any_layer |= differ
    return dict(per_layer=per_layer, tokens=int(any_layer.sum()),
                flipped=any_layer.nonzero().squeeze(1).tolist())
