"""Patches for triton 3.6's CPU interpreter (TRITON_INTERPRET=1), applied by conftest.py.

Compiled GPU kernels are unaffected; these only make the interpreter compute what the GPU does:
- scalars are shape-(1,) numpy arrays turned into ints with int(array), which numpy >= 2.4
  rejects, so every loop with a runtime bound (`for n in range(lo, hi, BLOCK)`) fails;
- tl.dot on bfloat16 multiplies the raw uint16 bit patterns as integers;
- fp32 -> bf16 casts truncate instead of rounding to nearest even;
- casts to fp8 e4m3 round ties up, drop the mantissa carry and mishandle subnormals; the GPU
  (cvt.rn.satfinite) rounds to nearest even and saturates at +-448.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _bf16_to_fp32(handle: Any) -> Any:
    data = (handle.data.astype(np.uint32) << 16).view(np.float32)
    return interpreter.TensorHandle(data, tl.float32)


def _fp32_to_bf16_rne(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(data)
    return np.where(nan, np.uint16(0x7FC0), rounded.astype(np.uint16))


def _to_e4m3_satfinite(data: np.ndarray, src: Any) -> np.ndarray:
    if src == tl.bfloat16:
        data = (data.astype(np.uint32) << 16).view(np.float32)
    x = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def apply() -> None:
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_flotilla_patched", False):
        return
    original_patch = interpreter._patch_lang_tensor
    original_dot = builder.create_dot
    original_cast = builder.cast_impl

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a = _bf16_to_fp32(a)
        if b.dtype.scalar == tl.bfloat16:
            b = _bf16_to_fp32(b)
        return original_dot(self, a, b, d, *args)

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_rne(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    original_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_rne(src.data), tl.bfloat16)
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar != tl.float8e4nv:
            data = _to_e4m3_satfinite(src.data, src.dtype.scalar)
            return interpreter.TensorHandle(data, tl.float8e4nv)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_dot = create_dot
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = cast_impl
    builder._flotilla_patched = True
