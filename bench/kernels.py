"""GPU micro-benchmark of the Triton kernels against their torch references (CUDA only).

    python bench/kernels.py [--only NAME ...] [--dtype bf16|fp16] [--sweep]

Prints the median time (triton.testing.do_bench) of each kernel and of its baseline, with the
achieved memory bandwidth (GB/s) for the memory-bound kernels and TFLOP/s for prefill attention.
Baselines: the `*_ref` torch reference; for attention also torch SDPA over contiguous K/V (what a
non-paged flash kernel achieves on the same problem).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a script: import the `kernels` package, not this file
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from flotilla.kernels.activation import silu_and_mul_ref, silu_and_mul_triton  # noqa: E402
from flotilla.kernels.kv_cache import write_kv_cache_ref, write_kv_cache_triton  # noqa: E402
from flotilla.kernels.paged_attention import (  # noqa: E402
    decode_attention_triton,
    paged_attention_ref,
    paged_attention_triton,
)
from flotilla.kernels.prefill_attention import prefill_attention_triton  # noqa: E402
from flotilla.kernels.rms_norm import (  # noqa: E402
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from flotilla.kernels.rotary import rotary_embedding_ref, rotary_embedding_triton  # noqa: E402
from flotilla.services.engine.forward_context import AttentionMetadata  # noqa: E402


def bench(fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    """Median milliseconds of fn(*args, **kwargs)."""
    return float(triton.testing.do_bench(
        lambda: fn(*args, **kwargs), warmup=25, rep=100, return_mode="median"))


def report(name: str, ms: float, nbytes: float | None = None, flops: float | None = None) -> None:
    rate = f"{nbytes / ms / 1e6:8.1f} GB/s" if nbytes else ""
    if flops:
        rate += f"{flops / ms / 1e9:8.1f} TFLOP/s"
    print(f"  {name:<28} {ms * 1e3:10.1f} us {rate}")


def bench_norms(dtype: torch.dtype) -> None:
    for tokens, hidden in [(1, 4096), (256, 4096), (8192, 4096)]:
        x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
        res, w = torch.randn_like(x), torch.randn(hidden, dtype=dtype, device="cuda")
        size = x.numel() * x.element_size()
        print(f"rms_norm T={tokens} H={hidden}")
        report("triton", bench(rms_norm_triton, x, w, 1e-6), 2 * size)
        report("torch ref", bench(rms_norm_ref, x, w, 1e-6), 2 * size)
        print(f"fused_add_rms_norm T={tokens} H={hidden}")
        report("triton", bench(fused_add_rms_norm_triton, x, res, w, 1e-6), 4 * size)
        report("torch ref", bench(fused_add_rms_norm_ref, x, res, w, 1e-6), 4 * size)


def bench_activation(dtype: torch.dtype) -> None:
    for tokens, inter in [(1, 14336), (256, 14336), (4096, 14336)]:
        x = torch.randn(tokens, 2 * inter, dtype=dtype, device="cuda")
        nbytes = 3 * tokens * inter * x.element_size()
        print(f"silu_and_mul T={tokens} I={inter}")
        report("triton", bench(silu_and_mul_triton, x), nbytes)
        report("torch ref", bench(silu_and_mul_ref, x), nbytes)


def bench_rotary(dtype: torch.dtype) -> None:
    for tokens in [1, 256, 8192]:
        q = torch.randn(tokens, 32, 128, dtype=dtype, device="cuda")
        k = torch.randn(tokens, 8, 128, dtype=dtype, device="cuda")
        pos = torch.randint(0, 8192, (tokens,), device="cuda")
        cache = torch.randn(8192, 128, device="cuda")
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
        print(f"rotary T={tokens} Hq=32 Hk=8 D=128")
        report("triton", bench(rotary_embedding_triton, pos, q, k, cache), nbytes)
        report("torch ref", bench(rotary_embedding_ref, pos, q, k, cache), nbytes)


def bench_kv_write(dtype: torch.dtype) -> None:
    for tokens in [64, 8192]:
        k = torch.randn(tokens, 8, 128, dtype=dtype, device="cuda")
        v = torch.randn_like(k)
        caches = torch.zeros(2, 4096, 16, 8, 128, dtype=dtype, device="cuda")
        slots = torch.randperm(4096 * 16, device="cuda")[:tokens]
        nbytes = 4 * k.numel() * k.element_size()
        print(f"write_kv_cache T={tokens} Hk=8 D=128")
        report("triton", bench(write_kv_cache_triton, k, v, caches[0], caches[1], slots),
               nbytes)
        report("torch ref", bench(write_kv_cache_ref, k, v, caches[0], caches[1], slots),
               nbytes)


def make_batch(
    q_lens: list[int], seq_lens: list[int], hq: int, hk: int, dim: int, dtype: torch.dtype,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    blocks = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables,
        torch.zeros(qsl[-1], dtype=torch.int64, device="cuda"),
        max(q_lens), max(seq_lens), qsl, list(seq_lens),
    )
    cache_shape = (sum(blocks), block_size, hk, dim)
    q = torch.randn(qsl[-1], hq, dim, dtype=dtype, device="cuda")
    k_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    return q, k_cache, torch.randn_like(k_cache), meta


SWEEP = False  # --sweep: also time alternative tile configs of the attention kernels


def sweep_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata,
                 scale: float, nbytes: float) -> None:
    for splits in (1, 4, 16):
        for block_n, warps, stages in ((32, 4, 2), (64, 4, 2), (64, 8, 2), (64, 4, 3),
                                       (128, 8, 2)):
            ms = bench(decode_attention_triton, q, kc, vc, meta, scale, num_splits=splits,
                       block_n=block_n, num_warps=warps, num_stages=stages)
            report(f"splits={splits} n={block_n} w={warps} s={stages}", ms, nbytes)


def sweep_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata,
                  scale: float, flops: float) -> None:
    for block_m, block_n, warps, stages in ((64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2),
                                             (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3)):
        ms = bench(prefill_attention_triton, q, kc, vc, meta, scale, block_m=block_m,
                   block_n=block_n, num_warps=warps, num_stages=stages)
        report(f"m={block_m} n={block_n} w={warps} s={stages}", ms, flops=flops)


def bench_decode(dtype: torch.dtype) -> None:
    for batch, seq_len, hq, hk, dim in [(1, 4096, 32, 8, 128), (64, 1024, 32, 8, 128),
                                         (256, 2048, 32, 8, 128), (32, 8192, 9, 3, 64)]:
        q, kc, vc, meta = make_batch([1] * batch, [seq_len] * batch, hq, hk, dim, dtype)
        nbytes = 2 * batch * seq_len * hk * dim * q.element_size()
        scale = dim**-0.5
        print(f"decode B={batch} S={seq_len} Hq={hq} Hk={hk} D={dim}")
        report("triton paged", bench(paged_attention_triton, q, kc, vc, meta, scale),
               nbytes)
        k = torch.randn(batch, hk, seq_len, dim, dtype=dtype, device="cuda")
        v, qs = torch.randn_like(k), q.view(batch, hq, 1, dim)
        sdpa = F.scaled_dot_product_attention
        report("torch sdpa (contiguous)", bench(sdpa, qs, k, v, enable_gqa=True), nbytes)
        if batch <= 64:
            report("torch ref", bench(paged_attention_ref, q, kc, vc, meta, scale), nbytes)
        if SWEEP:
            sweep_decode(q, kc, vc, meta, scale, nbytes)


def bench_prefill(dtype: torch.dtype) -> None:
    for batch, q_len, ctx, hq, hk, dim in [(1, 4096, 0, 32, 8, 128), (4, 1024, 0, 32, 8, 128),
                                            (4, 512, 2048, 32, 8, 128), (8, 1024, 0, 9, 3, 64)]:
        seq_len = q_len + ctx
        q, kc, vc, meta = make_batch([q_len] * batch, [seq_len] * batch, hq, hk, dim, dtype)
        pairs = batch * (q_len * ctx + q_len * (q_len + 1) / 2)
        flops = 4 * pairs * hq * dim
        scale = dim**-0.5
        print(f"prefill B={batch} L={q_len} ctx={ctx} Hq={hq} Hk={hk} D={dim}")
        report("triton paged", bench(paged_attention_triton, q, kc, vc, meta, scale),
               flops=flops)
        if SWEEP:
            sweep_prefill(q, kc, vc, meta, scale, flops)
        if ctx == 0:
            qs = q.view(batch, q_len, hq, dim).transpose(1, 2)
            k = torch.randn(batch, hk, q_len, dim, dtype=dtype, device="cuda")
            v = torch.randn_like(k)
            report("torch sdpa causal", bench(F.scaled_dot_product_attention,
                qs, k, v, is_causal=True, enable_gqa=True), flops=flops)


BENCHES = {
    "norm": bench_norms, "activation": bench_activation, "rotary": bench_rotary,
    "kv_write": bench_kv_write, "decode": bench_decode, "prefill": bench_prefill,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=sorted(BENCHES), default=sorted(BENCHES))
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--sweep", action="store_true", help="time other attention tilings")
    args = parser.parse_args()
    global SWEEP
    SWEEP = args.sweep
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"device: {torch.cuda.get_device_name()}  dtype: {dtype}")
    for name in args.only:
        BENCHES[name](dtype)


if __name__ == "__main__":
    main()
