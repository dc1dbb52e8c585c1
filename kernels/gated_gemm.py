"""Gated-MLP projection for prefill-sized inputs: y = silu(x @ gate^T) * (x @ up^T) in one GEMM.

The unfused path is a cuBLAS GEMM into a [T, 2I] buffer, then kernels/activation.py reading it
back and writing [T, I]: on Llama-3-8B at 4,096 tokens that round trip is 352 MB a layer, 3.8 ms of
a ~100 ms prefill on an H100 at copy bandwidth. Here each program owns a [BLOCK_M, BLOCK_N] tile of
y and carries two accumulators, one over gate rows n.. and one over up rows I + n.. of the same
[2I, K] weight (HF's gate-then-up order, as the decode GEMVs read it), so the epilogue applies
silu * up in registers and only y is written.

Loads go through tensor descriptors (TMA on Hopper; the interpreter emulates them) and the
programs are persistent: up to NUM_PROGRAMS (the SM count) programs stride over the tiles in
GROUP_M-row bands (tiles that share x rows run together, so x stays in L2). Out-of-range reads
are zero-filled by the descriptors; a gate tile that runs past I reads up rows, but those
columns are past y's end and the store drops them.

Rounding matches the unfused path: gate and up are rounded to the output dtype before silu, and
silu and the product are rounded as torch does on 16-bit tensors (kernels.activation.silu_mul).

`gated_gemm_ok` says whether a call can take this path (16-bit x and W, TMA-aligned strides);
the dispatch that decides whether it should (sizes, GPU, FLOTILLA_GATED_GEMM) lives with the
unquantized linear method (services/engine/quant/base.py).
"""

from __future__ import annotations

import torch

from flotilla.kernels.activation import silu_and_mul_ref, silu_mul
from flotilla.kernels.triton_compat import TensorDescriptor, tl, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): each program holds 2 x BLOCK_M x BLOCK_N fp32
# accumulators; 128 x 128 is the 128 x 256 output tile Hopper GEMMs favour, split in two halves.
CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 64, 64, 4, 4),
    (128, 64, 64, 8, 5),
    (64, 128, 64, 4, 4),
    (256, 64, 64, 8, 4),
]
# What CUDA launches. No autotuning: prefill sizes change every step, and a tuning pass (~1 s) in
# the middle of serving costs more than any tile choice gains. H100, Llama-3-8B gate/up, M =
# 256-8192 (bench/prefill_lab.py, git history): 128 x 128 x 64, 8 warps, 4 stages with Triton's warp
# specialisation (producer warps feed TMA loads to the two MMA warpgroups) was the fastest at M =
# 256, 512, 4,096 and 8,192 (the 3-stage variant: 4-6% faster at 1,024-2,048, 0.6% slower at 4,096),
# and only warp-specialised configs beat cuBLAS + SiLU·mul.
CUDA_CONFIG = (128, 128, 64, 8, 4)
CUDA_WARP_SPEC = True
DEFAULT_CONFIG = (128, 128, 64, 8, 3)  # the interpreter's (specialisation is a GPU matter)


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block), GROUP_M row blocks per band."""
    band = GROUP_M * num_n
    first_m = (tile // band) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % band) % rows, (tile % band) // rows


@triton.jit(do_not_specialize=["M"])  # prompt sizes vary: one build for every M
def _gated_gemm_kernel(
    x_desc,  # [M, K]
    w_desc,  # [2I, K]: gate rows, then up rows
    y_desc,  # [M, I]
    M, inter, K,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    WARP_SPEC: tl.constexpr = False,  # Triton's automatic warp specialisation of the tile loop
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(inter, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=not WARP_SPEC,
                         warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            off_k = ks * BLOCK_K
            x = x_desc.load([off_m, off_k])
            acc_gate = tl.dot(x, w_desc.load([off_n, off_k]).T, acc_gate)
            acc_up = tl.dot(x, w_desc.load([inter + off_n, off_k]).T, acc_up)
        y_desc.store([off_m, off_n], silu_mul(acc_gate, acc_up, y_desc.dtype))


def _stride(device: torch.device) -> int:
    """Programs a persistent launch strides over (NUM_PROGRAMS): the SM count, a constant per
    GPU, so that it never triggers a new build; the interpreter takes a few, each looping over
    several tiles."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def gated_gemm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [.., K] and weight [2I, K] meet the kernel's layout needs: 16-bit, same dtype,
    contiguous rows with 16-byte aligned starts and strides (the tensor descriptors')."""
    if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
        return False
    k = x.shape[-1]
    return (weight.dim() == 2 and weight.shape[1] == k and weight.shape[0] % 2 == 0
            and weight.stride(1) == 1 and x.stride(-1) == 1 and k % 8 == 0
            and (weight.shape[0] // 2) % 8 == 0 and weight.stride(0) % 8 == 0
            and weight.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0)


def gated_gemm_triton(x: torch.Tensor, weight: torch.Tensor,
                      config: tuple[int, int, int, int, int] | None = None,
                      warp_spec: bool | None = None) -> torch.Tensor:
    """silu(x @ weight[:I].T) * (x @ weight[I:].T) for x [.., K], weight [2I, K] (gated_gemm_ok).
    `config` (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) and `warp_spec` default to
    CUDA_CONFIG / CUDA_WARP_SPEC on CUDA and DEFAULT_CONFIG without specialisation elsewhere."""
    k = x.shape[-1]
    inter = weight.shape[0] // 2
    x2 = x.reshape(-1, k)
    if x2.stride(0) % 8:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], inter)
    if config is None:
        config = CUDA_CONFIG if x.is_cuda else DEFAULT_CONFIG
    if warp_spec is None:
        warp_spec = x.is_cuda and CUDA_WARP_SPEC
    bm, bn, bk, warps, stages = config
    x_desc = TensorDescriptor.from_tensor(x2, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    y_desc = TensorDescriptor.from_tensor(y, [bm, bn])
    # fewer tiles than the stride: one program a tile (program p takes tiles p, p + stride, ..)
    stride = _stride(x.device)
    programs = min(stride, triton.cdiv(m, bm) * triton.cdiv(inter, bn))
    _gated_gemm_kernel[(programs,)](x_desc, w_desc, y_desc, m, inter, k, NUM_PROGRAMS=stride,
                                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                    WARP_SPEC=warp_spec, num_warps=warps, num_stages=stages)
    return y.reshape(*x.shape[:-1], inter)


def gated_gemm_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused computation: one matmul into [.., 2I], then silu(gate) * up."""
    return silu_and_mul_ref(x @ weight.T)
