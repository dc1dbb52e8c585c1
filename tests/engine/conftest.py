"""Single-sequence helpers to drive a model outside the engine (parity tests, CPU bench).

`SingleSequenceRunner` plays the ModelRunner for one sequence: it binds a small paged KV cache to
every attention layer (blocks 0..n-1 in order, so slot == position) and builds the
`AttentionMetadata` of each step; a hybrid model's linear-attention layers get a one-slot state
pool (slot 0, zeroed when a sequence starts at position 0). `save_tiny_llama` writes a tiny
random transformers Llama.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flotilla.services.engine.forward_context import AttentionMetadata, forward_context
from flotilla.services.engine.models.base import CausalLM
from flotilla.services.engine.state_pool import StateCache

# Tiny GQA llama: 4 query heads over 2 kv heads, every size divisible by 2 (tensor parallel).
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.1, rms_norm_eps=1e-5)


def save_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig  # heavy: import only when used

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**{**BASE, **overrides}))
    hf.save_pretrained(path)
    return hf.eval()


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


class SingleSequenceRunner:
    def __init__(self, model: CausalLM, max_tokens: int = 256, block_size: int = 16) -> None:
        self.model, self.block_size = model, block_size
        self.num_blocks = -(-max_tokens // block_size)
        param = next(model.parameters())
        self.device = param.device
        for attn in model.attention_layers():
            k_shape, v_shape = attn.kv_cache_shape()
            attn.bind_kv_cache(*(torch.zeros(self.num_blocks, block_size, *shape,
                                             dtype=param.dtype, device=self.device)
                                 for shape in (k_shape, v_shape)))
        self.block_table = torch.arange(self.num_blocks, dtype=torch.int32,
                                        device=self.device)[None]
        layers = model.state_layers()
        self.states = (StateCache(layers, 1, param.dtype, self.device) if layers else None)

    def metadata(self, start: int, num_new: int) -> AttentionMetadata:
        end = start + num_new
        if end > self.num_blocks * self.block_size:
            raise ValueError(f"sequence of {end} tokens exceeds the helper's cache")
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=self.device),
            block_tables=self.block_table,
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=self.device),
            max_query_len=num_new,
            max_seq_len=end,
            query_start_loc_cpu=[0, num_new],
            seq_lens_cpu=[end],
            state_indices=None if self.states is None else torch.zeros(
                1, dtype=torch.int32, device=self.device),
            has_initial_state=None if self.states is None else torch.tensor(
                [start > 0], device=self.device),
        )

    @torch.inference_mode()
    def forward(self, token_ids: list[int], start: int = 0, all_logits: bool = True
                ) -> torch.Tensor:
        """Run `token_ids` at positions start.. (cache holds 0..start-1); float32 logits
        [len, vocab], or [1, vocab] for the last token only when all_logits is False."""
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        if self.states is not None and start == 0:
            self.states.reset([0])
        with forward_context(self.metadata(start, len(token_ids))):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden if all_logits else hidden[-1:])

    def greedy_recompute(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy decoding that re-runs the whole sequence every step (no cache reuse)."""
        tokens = list(prompt)
        for _ in range(num_tokens):
            tokens.append(int(self.forward(tokens, 0, all_logits=False)[-1].argmax()))
        return tokens[len(prompt):]

    def greedy_cached(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy decoding with one prefill and then one cached decode step per token."""
        logits = self.forward(prompt, 0, all_logits=False)
        out = [int(logits[-1].argmax())]
        while len(out) < num_tokens:
            logits = self.forward(out[-1:], len(prompt) + len(out) - 1, all_logits=False)
            out.append(int(logits[-1].argmax()))
        return out


def _tp_worker(rank: int, world: int, path: str, port: int, prompt: list[int],
               out: str) -> None:
    import torch.distributed as dist

    from flotilla.services.engine.distributed import init_tensor_parallel
    from flotilla.services.engine.loader import load_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.set_num_threads(1)
        init_tensor_parallel(rank, world)
        model, _ = load_model(path)
        logits = SingleSequenceRunner(model).forward(prompt)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def tensor_parallel_logits(path: Path, prompt: list[int], world: int = 2) -> torch.Tensor:
    """Prompt logits of the checkpoint at `path` run by `world` gloo ranks (separate processes,
    each loading only its weight slices); rank 0's result."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = path.parent / f"tp{world}_logits.pt"
    mp.spawn(_tp_worker, args=(world, str(path), port, prompt, str(out)), nprocs=world)
    return torch.load(out)
