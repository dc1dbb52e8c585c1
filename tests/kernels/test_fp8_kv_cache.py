"""FP8 (e4m3, per-(token, head) scale) KV cache: the write, fused rotary-write, decode and prefill
kernels against their torch references, and the references against unquantized attention."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from flotilla.kernels.kv_cache import write_kv_cache_ref, write_kv_cache_triton
from flotilla.kernels.kv_quant import FP8_KV_DTYPE, KVScales, dequantize_kv_ref, quantize_kv_ref
from flotilla.kernels.paged_attention import decode_attention_triton, paged_attention_ref
from flotilla.kernels.prefill_attention import prefill_attention_triton
from flotilla.kernels.rotary import rotary_embedding_ref
from flotilla.kernels.rotary_kv import rotary_write_kv_cache_triton
from tests.kernels.attention_cases import AttentionCase, bounds_only, make_case
from tests.kernels.conftest import DEVICE, tolerance
from tests.kernels.test_rotary import cos_sin_cache


class Fp8Cache(NamedTuple):
    k: torch.Tensor  # e4m3 [num_blocks, block_size, Hk, D]
    v: torch.Tensor
    scales: KVScales

    def clone(self) -> Fp8Cache:
        return Fp8Cache(self.k.clone(), self.v.clone(), KVScales(*(s.clone() for s in self.scales)))


def fp8_cache(case: AttentionCase) -> Fp8Cache:
    """The case's random caches quantized row by row."""
    k8, ks = quantize_kv_ref(case.k_cache)
    v8, vs = quantize_kv_ref(case.v_cache)
    return Fp8Cache(k8, v8, KVScales(ks, vs))


def empty_fp8(shape: tuple[int, ...]) -> Fp8Cache:
    """NaN-filled scales and random bytes: any slot a kernel wrongly writes shows."""
    k8, v8 = (torch.randint(0, 120, shape, dtype=torch.uint8, device=DEVICE).view(FP8_KV_DTYPE)
              for _ in range(2))
    scales = KVScales(*(torch.full(shape[:3], float("nan"), device=DEVICE) for _ in range(2)))
    return Fp8Cache(k8, v8, scales)


def assert_same_cache(a: Fp8Cache, b: Fp8Cache) -> None:
    for x, y in ((a.k, b.k), (a.v, b.v)):
        bad = x.view(torch.uint8) != y.view(torch.uint8)
        assert not bool(bad.any()), (
            f"{int(bad.sum())} of {bad.numel()} bytes differ, e.g. {x[bad][:6].float().tolist()} "
            f"vs {y[bad][:6].float().tolist()}")
    for x, y in zip(a.scales, b.scales, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_quantization_error_is_bounded_by_e4m3_rounding() -> None:
    x = torch.randn(64, 4, 128) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row gets scale 1 and stays zero
    q, scale = quantize_kv_ref(x)
    assert q.dtype == FP8_KV_DTYPE and scale.shape == (64, 4)
    back = dequantize_kv_ref(q, scale)
    # 3 mantissa bits: half an ulp is 2^-4 relative; below 2^-6 the subnormal step is 2^-9.
    bound = torch.maximum(x.abs() * 2.0**-4, scale[..., None] * 2.0**-10)
    assert bool(((back - x).abs() <= bound * 1.0001).all())
    torch.testing.assert_close(back.abs().amax(-1), x.abs().amax(-1))  # amax maps to 448 exactly
    assert torch.equal(back[0, 0], x[0, 0]) and scale[0, 0] == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,head_dim", [(16, 2, 64), (8, 3, 32), (4, 1, 128)])
def test_write_kv_cache_fp8_matches_reference(
    dtype: torch.dtype, block_size: int, num_heads: int, head_dim: int
) -> None:
    num_blocks, tokens = 6, 11
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[2, 7]] = -1  # padding rows must not be written
    qkv = torch.randn(tokens, 3 * num_heads, head_dim, dtype=dtype, device=DEVICE) * 3
    k, v = qkv[:, num_heads : 2 * num_heads], qkv[:, 2 * num_heads :]  # strided views
    got = empty_fp8((num_blocks, block_size, num_heads, head_dim))
    ref = got.clone()
    write_kv_cache_triton(k, v, got.k, got.v, slots, got.scales)
    write_kv_cache_ref(k, v, ref.k, ref.v, slots, ref.scales)
    assert_same_cache(got, ref)
    flat = got.scales.k.view(-1, num_heads)
    assert bool(flat[slots[slots >= 0]].isfinite().all())
    assert int(flat.isnan().any(-1).sum()) == num_blocks * block_size - int((slots >= 0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rot_dim,block_size", [(64, 64, 16), (32, 16, 8)])
def test_rotary_kv_fp8_matches_unfused_reference(
    dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int, block_size: int
) -> None:
    tokens, hq, hk, num_blocks = 9, 4, 3, 5
    qkv = torch.randn(tokens, hq + 2 * hk, head_dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    pos = torch.randint(0, 100, (tokens,), device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[[1, 6]] = -1
    cache = cos_sin_cache(100, rot_dim).to(DEVICE)
    got = empty_fp8((num_blocks, block_size, hk, head_dim))
    ref = got.clone()
    out_q = rotary_write_kv_cache_triton(pos, q, k, v, cache, is_neox, got.k, got.v, slots,
                                         got.scales)
    ref_q, ref_k = rotary_embedding_ref(pos, q, k, cache, is_neox)
    write_kv_cache_ref(ref_k, v, ref.k, ref.v, slots, ref.scales)
    torch.testing.assert_close(out_q, ref_q, **tolerance(dtype))
    assert_same_cache(got, ref)


# Decode seq_lens: one token, exactly one block, one past, several blocks (block size 16).
SEQ_LENS = [1, 16, 17, 45]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,num_splits", [(1, 1), (4, 4)])
def test_decode_fp8_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    case = make_case([1] * 4, SEQ_LENS, 2 * group, 2, 32, 16, dtype, pad_rows=1)
    k8, v8, scales = fp8_cache(case)
    out = decode_attention_triton(case.q, k8, v8, case.meta, 0.3, num_splits=num_splits,
                                  block_n=16, kv_scales=scales)
    ref = paged_attention_ref(case.q, k8, v8, case.meta, 0.3, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tolerance(dtype))


@pytest.mark.parametrize("window,softcap", [(None, None), (9, 4.0)])
def test_decode_fp8_window_softcap(window: int | None, softcap: float | None) -> None:
    case = make_case([1] * 3, [8, 33, 70], 4, 2, 64, 8, torch.float16)
    k8, v8, scales = fp8_cache(case)
    out = decode_attention_triton(case.q, k8, v8, case.meta, 0.1, window, softcap,
                                  num_splits=2, kv_scales=scales)
    ref = paged_attention_ref(case.q, k8, v8, case.meta, 0.1, window, softcap, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tolerance(torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, 3.0)])
@pytest.mark.parametrize("q_len,block_m", [(20, 16), (70, 64)])
@pytest.mark.parametrize("graph", [False, True])
def test_prefill_fp8_ragged_matches_reference(
    dtype: torch.dtype, window: int | None, softcap: float | None, q_len: int, block_m: int,
    graph: bool,
) -> None:
    # Ragged batch: a whole prompt, extends across block boundaries, a decode row, an idle one.
    # block_m 16 scales the scores and p per key; 64 (wgmma tiles) scales the K / V rows.
    # graph: the bounds-only metadata of a whole-step CUDA graph (flat grid, empty sequences).
    case = make_case([q_len, 5, 1, 0, 9], [q_len, 21, 33, 4, 40], 4, 2, 32, 8, dtype,
                     pad_rows=2)
    k8, v8, scales = fp8_cache(case)
    meta = bounds_only(case.meta, 3) if graph else case.meta
    out = prefill_attention_triton(case.q, k8, v8, meta, 0.25, window, softcap,
                                   block_m=block_m, block_n=16, kv_scales=scales)
    ref = paged_attention_ref(case.q, k8, v8, case.meta, 0.25, window, softcap, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    if graph:  # the reference reads a bounds-only metadata's host values back
        torch.testing.assert_close(
            paged_attention_ref(case.q, k8, v8, meta, 0.25, window, softcap, kv_scales=scales),
            ref, atol=0, rtol=0)


def test_fp8_reference_stays_near_unquantized_attention() -> None:
    """The accuracy the fp8 cache costs: outputs within 5% of the output scale (fp32)."""
    case = make_case([1, 12, 1], [40, 12, 90], 8, 2, 64, 16, torch.float32)
    k8, v8, scales = fp8_cache(case)
    exact = paged_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 64**-0.5)
    fp8 = paged_attention_ref(case.q, k8, v8, case.meta, 64**-0.5, kv_scales=scales)
    err = float((fp8 - exact).abs().max() / exact.abs().max())
    assert 0 < err < 0.05


def test_fp8_cache_without_scales_is_refused() -> None:
    case = make_case([1], [5], 2, 1, 32, 8, torch.float32)
    k8, v8, scales = fp8_cache(case)
    with pytest.raises(ValueError, match="kv_scales"):
        decode_attention_triton(case.q, k8, v8, case.meta, 0.3)
    with pytest.raises(ValueError, match="float32"):
        decode_attention_triton(case.q, k8, v8, case.meta, 0.3,
                                kv_scales=KVScales(scales.k.half(), scales.v))


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 300])
def test_fp8_attention_gpu_realistic(q_len: int) -> None:
    """Llama-3-8B heads (GQA 32/8, head_dim 128), bf16 queries: kernels vs the references."""
    seq_lens = torch.randint(q_len, 2048, (32,)).tolist()
    case = make_case([q_len] * 32, seq_lens, 32, 8, 128, 16, torch.bfloat16)
    k8, v8, scales = fp8_cache(case)
    out = (decode_attention_triton if q_len == 1 else prefill_attention_triton)(
        case.q, k8, v8, case.meta, 128**-0.5, kv_scales=scales)
    ref = paged_attention_ref(case.q, k8, v8, case.meta, 128**-0.5, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tolerance(torch.bfloat16))


@pytest.mark.gpu
def test_fp8_writes_gpu_realistic() -> None:
    tokens, hq, hk, dim, bs = 4096, 32, 8, 128, 16
    qkv = torch.randn(tokens, hq + 2 * hk, dim, dtype=torch.bfloat16, device="cuda")
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hk], qkv[:, hq + hk :]
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    slots = torch.randperm(1024 * bs, device="cuda")[:tokens]
    cache = cos_sin_cache(8192, dim).cuda()
    for fused in (False, True):
        got = empty_fp8((1024, bs, hk, dim))
        ref = got.clone()
        if fused:
            rotary_write_kv_cache_triton(pos, q, k, v, cache, True, got.k, got.v, slots, got.scales)
            k = rotary_embedding_ref(pos, q, k, cache, True).k
        else:
            write_kv_cache_triton(k, v, got.k, got.v, slots, got.scales)
        write_kv_cache_ref(k, v, ref.k, ref.v, slots, ref.scales)
        # Measured on an H200: the plain write matched torch's rounding in all but 4,858 of 16.8M
        # bytes, each one e4m3 step larger in magnitude next to a rounding tie (the GPU's
        # f32 -> e4m3 conversion appears to round twice); the fused write also rotates with fused
        # multiply-adds, so a rotated k may sit one bf16 ulp apart. Dequantized rows agree.
        for c8, r8, cs, rs in ((got.k, ref.k, got.scales.k, ref.scales.k),
                               (got.v, ref.v, got.scales.v, ref.scales.v)):
            live = slots.cpu()
            a = dequantize_kv_ref(c8, cs).flatten(0, 1)[live]
            b = dequantize_kv_ref(r8, rs).flatten(0, 1)[live]
            torch.testing.assert_close(a, b, atol=0.07 * float(b.abs().max()), rtol=0.07)
            codes = (c8.view(torch.uint8).int() - r8.view(torch.uint8).int()).abs()
            assert int(codes.max()) <= 1  # neighbouring e4m3 codes at most
            assert float((c8.view(torch.uint8) != r8.view(torch.uint8)).float().mean()) < 1e-3
