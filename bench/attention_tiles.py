"""Attention tilings on the engine benchmarks' own shapes (Llama-3-8B heads: 32 q / 8 kv, d 128).

    python bench/attention_tiles.py

Prefill: B4 (one 4096-token prompt) and B3's prefill steps (64 prompts of 128) over the tile
configurations that compile without spills; decode: B1 (batch 1, ~400 keys) and B2 (16 x ~400)
with the split reduction fused (last split merges) or as a second launch, and B3 (256 x ~200).
Prints the median time of each; the default configuration is marked with '*'.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from bench.kernels import bench, make_batch, report  # noqa: E402
from kernels.paged_attention import decode_attention_triton, default_num_splits  # noqa: E402
from kernels.prefill_attention import prefill_attention_triton  # noqa: E402

PREFILL_TILES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2),
                 (64, 64, 4, 3), (64, 64, 4, 2)]
DEFAULT_PREFILL = (128, 64, 8, 2)


def prefill() -> None:
    for batch, q_len in [(1, 4096), (64, 128)]:
        q, kc, vc, meta = make_batch([q_len] * batch, [q_len] * batch, 32, 8, 128,
                                     torch.bfloat16)
        flops = 4 * batch * q_len * (q_len + 1) / 2 * 32 * 128
        print(f"prefill B={batch} L={q_len} (causal, no prefix)")
        for m, n, w, s in PREFILL_TILES:
            ms = bench(prefill_attention_triton, q, kc, vc, meta, 128**-0.5, block_m=m,
                       block_n=n, num_warps=w, num_stages=s)
            mark = "*" if (m, n, w, s) == DEFAULT_PREFILL else " "
            report(f"{mark}m={m} n={n} w={w} s={s}", ms, flops=flops)


def decode() -> None:
    for batch, seq_len in [(1, 384), (16, 384), (256, 192)]:
        q, kc, vc, meta = make_batch([1] * batch, [seq_len] * batch, 32, 8, 128,
                                     torch.bfloat16)
        meta.max_seq_len = 8192  # as captured in the CUDA graphs (max_model_len)
        nbytes = 2 * batch * seq_len * 8 * 128 * 2
        default = default_num_splits(batch, 8, meta.max_seq_len)
        print(f"decode B={batch} S={seq_len} (graph split count {default})")
        for splits in sorted({1, 4, 8, 16, 32, default}):
            for fused in (True, False):
                if splits == 1 and not fused:
                    continue
                ms = bench(decode_attention_triton, q, kc, vc, meta, 128**-0.5,
                           num_splits=splits, fused_reduce=fused)
                mark = "*" if splits == default and fused else " "
                report(f"{mark}splits={splits} {'fused' if fused else 'two launches'}", ms,
                       nbytes)


if __name__ == "__main__":
    print(f"device: {torch.cuda.get_device_name()}")
    prefill()
    decode()
