"""Attention tilings on the engine benchmarks' own shapes (Llama-3-8B heads: 32 q / 8 kv, d 128).

    python bench/attention_tiles.py [--only prefill decode]

Prefill: B4 (one 4096-token prompt) and B3's prefill steps (64 prompts of 128), tile configs that
compile without spills, with the query blocks dispatched longest first or in order. Decode: B1
(batch 1, ~400 keys; split count as captured in the graphs, and others), B2/B3-like batches
over tile configs; the split counts of the long (max_model_len) and short-context graphs
(services/engine/cuda_graphs.py) are both timed. Decode is timed as CUDA-graph replays (what
the engine runs), prefill with plain launches. The default configuration is marked '*'.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import triton  # noqa: E402

from bench.kernels import bench, make_batch, report  # noqa: E402
from flotilla.kernels.paged_attention import (  # noqa: E402
    SHORT_SPLIT_KEYS,
    decode_attention_triton,
    default_num_splits,
)
from flotilla.kernels.prefill_attention import prefill_attention_triton  # noqa: E402

# (block_m, block_n, warps, stages, longest_first)
PREFILL = [(128, 32, 8, 2, True), (128, 32, 8, 2, False), (128, 32, 8, 3, True),
           (64, 64, 4, 2, True), (64, 32, 4, 2, True), (128, 64, 8, 3, True)]
DEFAULT_PREFILL = (128, 32, 8, 2, True)
# (block_n, warps, stages)
DECODE = [(64, 8, 2), (64, 4, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (128, 4, 2),
          (64, 2, 2), (32, 2, 2)]
DEFAULT_DECODE = (64, 2, 2)


def graph_bench(fn: Callable[[], object]) -> float:
    """Median ms of fn replayed from a CUDA graph (launch overhead excluded)."""
    fn()  # compile, allocate persistent buffers outside the capture
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def prefill() -> None:
    for batch, q_len in [(1, 4096), (64, 128)]:
        q, kc, vc, meta = make_batch([q_len] * batch, [q_len] * batch, 32, 8, 128,
                                     torch.bfloat16)
        flops = 4 * batch * q_len * (q_len + 1) / 2 * 32 * 128
        print(f"prefill B={batch} L={q_len} (causal, no prefix)")
        for m, n, w, s, lf in PREFILL:
            ms = bench(prefill_attention_triton, q, kc, vc, meta, 128**-0.5, block_m=m,
                       block_n=n, num_warps=w, num_stages=s, longest_first=lf)
            mark = "*" if (m, n, w, s, lf) == DEFAULT_PREFILL else " "
            report(f"{mark}m={m} n={n} w={w} s={s} {'longest-first' if lf else 'in order'}",
                   ms, flops=flops)
        if batch == 1:
            sdpa_peers(q_len, flops)


def sdpa_peers(q_len: int, flops: float) -> None:
    """torch's fused attention backends on the same causal prefill (contiguous K/V, no paging;
    GQA by enable_gqa, or K/V expanded to 32 heads where a backend refuses it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, q_len, 32, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(1, q_len, 8, 128, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    v = torch.randn_like(k)
    kx, vx = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            def fn(gqa: bool = gqa, backend: SDPBackend = backend) -> torch.Tensor:
                with sdpa_kernel([backend]):
                    if gqa:
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True, enable_gqa=True)
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, kx, vx, is_causal=True)
            try:
                ms = bench(fn)
            except RuntimeError as e:
                print(f"  torch sdpa {backend.name} gqa={gqa}: unavailable ({str(e)[:80]})")
                continue
            report(f" torch sdpa {backend.name} {'enable_gqa' if gqa else 'K/V expanded'}", ms,
                   flops=flops)


def decode() -> None:
    for batch, seq_len in [(1, 384), (1, 512), (4, 384), (8, 384), (16, 384), (16, 512),
                           (64, 384), (256, 256)]:
        q, kc, vc, meta = make_batch([1] * batch, [seq_len] * batch, 32, 8, 128,
                                     torch.bfloat16)
        meta.max_seq_len = 8192  # as captured in the CUDA graphs (max_model_len)
        nbytes = 2 * batch * seq_len * 8 * 128 * 2
        splits = default_num_splits(batch, 8, meta.max_seq_len)
        short = default_num_splits(batch, 8, SHORT_SPLIT_KEYS)
        print(f"decode B={batch} S={seq_len} (graph split count {splits}, short-context graph "
              f"{short}), CUDA-graph replay")

        def run(q=q, kc=kc, vc=vc, meta=meta, **kw: object) -> float:  # type: ignore[no-untyped-def]
            return graph_bench(lambda: decode_attention_triton(q, kc, vc, meta, 128**-0.5,
                                                               **kw))

        for s in sorted({1, 2, 4, 8, 16, 32, splits, short}):
            if s != splits:
                report(f" splits={s} (default tiles)", run(num_splits=s), nbytes)
        for n, w, st in DECODE:
            mark = "*" if (n, w, st) == DEFAULT_DECODE else " "
            report(f"{mark}splits={splits} n={n} w={w} s={st}",
                   run(num_splits=splits, block_n=n, num_warps=w, num_stages=st), nbytes)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=["prefill", "decode"])
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}")
    if "prefill" in args.only:
        prefill()
    if "decode" in args.only:
        decode()
