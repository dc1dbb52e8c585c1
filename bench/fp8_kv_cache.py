"""fp8 vs bf16 KV cache on the GPU: decode / prefill attention and cache-write kernel times.

    python bench/fp8_kv_cache.py

Llama-3-8B heads (GQA 32/8, head_dim 128), block size 16. Prints one line per problem: median
microseconds (triton.testing.do_bench) with the bf16 cache, with the fp8 cache (default tiles),
for decode the fp8 cache with the bf16 tiles (2 warps) and the fp8 decode's cache bandwidth
(K/V bytes + scales read per call), for prefill the fp8 cache without its 128-register cap.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a script: import the `kernels` package, not this file
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import triton  # noqa: E402

from flotilla.kernels import prefill_attention  # noqa: E402
from flotilla.kernels.kv_cache import write_kv_cache_triton  # noqa: E402
from flotilla.kernels.kv_quant import KVScales, quantize_kv_ref  # noqa: E402
from flotilla.kernels.paged_attention import decode_attention_triton  # noqa: E402
from flotilla.kernels.prefill_attention import prefill_attention_triton  # noqa: E402
from tests.kernels.attention_cases import make_case  # noqa: E402

HQ, HK, D, BS = 32, 8, 128, 16


def us(fn) -> float:  # type: ignore[no-untyped-def]
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


def main() -> None:
    torch.manual_seed(0)
    for batch, keys, q_len in ((1, 4096, 1), (64, 2048, 1), (256, 1024, 1), (4, 2048, 2048)):
        case = make_case([q_len] * batch, [keys] * batch, HQ, HK, D, BS, torch.bfloat16)
        k8, ks = quantize_kv_ref(case.k_cache)
        v8, vs = quantize_kv_ref(case.v_cache)
        scales = KVScales(ks, vs)
        args = (case.q, case.k_cache, case.v_cache, case.meta, D**-0.5)
        args8 = (case.q, k8, v8, case.meta, D**-0.5)
        if q_len == 1:
            t16 = us(lambda: decode_attention_triton(*args))  # noqa: B023
            t8 = us(lambda: decode_attention_triton(*args8, kv_scales=scales))  # noqa: B023
            t8w2 = us(lambda: decode_attention_triton(*args8, num_warps=2,  # noqa: B023
                                                      kv_scales=scales))  # noqa: B023
            gbs = batch * keys * HK * 2 * (D + 4) / (t8 * 1e-6) / 1e9
            print(f"decode B={batch} keys={keys}: bf16 {t16:.1f} us, fp8 {t8:.1f} us "
                  f"({gbs:.0f} GB/s), fp8 2 warps {t8w2:.1f} us")
        else:
            t16 = us(lambda: prefill_attention_triton(*args))  # noqa: B023
            t8 = us(lambda: prefill_attention_triton(*args8, kv_scales=scales))  # noqa: B023
            prefill_attention.FP8_MAXNREG = None
            t8u = us(lambda: prefill_attention_triton(*args8, kv_scales=scales))  # noqa: B023
            prefill_attention.FP8_MAXNREG = 128
            print(f"prefill B={batch} q_len={q_len}: bf16 {t16:.1f} us, fp8 {t8:.1f} us, "
                  f"fp8 uncapped {t8u:.1f} us")
    tokens = 4096
    k = torch.randn(tokens, HK, D, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(8192 * BS, device="cuda")[:tokens]
    c16 = [torch.zeros(8192, BS, HK, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    c8 = [c.to(torch.float8_e4m3fn) for c in c16]
    sc = KVScales(*(torch.ones(8192, BS, HK, device="cuda") for _ in range(2)))
    t16 = us(lambda: write_kv_cache_triton(k, k, c16[0], c16[1], slots))
    t8 = us(lambda: write_kv_cache_triton(k, k, c8[0], c8[1], slots, sc))
    print(f"write_kv_cache T={tokens}: bf16 {t16:.1f} us, fp8 {t8:.1f} us")


if __name__ == "__main__":
    main()
