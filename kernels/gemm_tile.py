"""Epilogue shared by the quantized GEMMs (kernels/gguf_matmul.py, gguf_kquant_gemm.py,
w4a16.py)."""

from __future__ import annotations

from flotilla.kernels.triton_compat import tl, triton


@triton.jit
def store_tile(out_ptr, acc, rm, rn, m_ok, n_ok, stride_om, ATOMIC: tl.constexpr):
    """A GEMM's [BLOCK_M, BLOCK_N] fp32 tile into out: fp32 atomics when split_k programs share
    it (out zero-filled fp32), else a store in out's dtype."""
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=mask)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
