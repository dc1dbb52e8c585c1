"""Compile every kernel for H100 (sm_90) with its default tiles and report register spills.

Run as `python -m tests.kernels.sm90_compile` in a process without TRITON_INTERPRET (the kernels
must be decorated as real JIT functions); prints one JSON object {config: spill bytes}
(`... sm90_compile fp8kv`: the fp8 KV-cache variants instead). Needs no GPU: triton ships ptxas.
Used by test_compile_sm90.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flotilla import kernels  # noqa: F401  (loads the kernel modules)

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
ATTN_PTRS = {n: "*bf16" for n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
ATTN_PTRS |= {n: "*i32" for n in ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")}
ATTN_PTRS |= {"sm_scale": "fp32", "softcap": "fp32"}
SCALE_PTRS = {"k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}  # fp8 KV scales (unused otherwise)
ATTN_PTRS |= SCALE_PTRS


def _ptx_sm90(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, Any],
              num_warps: int, num_stages: int, maxnreg: int | None) -> str:
    fn = getattr(sys.modules[f"flotilla.kernels.{module}"], kernel)
    # constexprs left out take their defaults (USE_PDL = False), as at a launch
    constexprs = {p.name: p.default for p in fn.params
                  if p.is_constexpr and p.has_default} | constexprs
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in constexprs and (signature[n].startswith("*")
                                         or (n.startswith("stride_") and n != "stride_bt"))}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "maxnreg": maxnreg})
    return str(compiled.asm["ptx"])


def compile_sm90(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, Any],
                 num_warps: int, num_stages: int = 2, maxnreg: int | None = None) -> str:
    """Compile for sm_90 and return ptxas -v's report (scalars default to i32); `maxnreg` caps
    the registers per thread as the launch option of that name does.

    Like the JIT at run time, pointers and strides are hinted 16-divisible (torch allocations
    are aligned; head/token strides of real models are multiples of 16): without the hints the
    loads are not vectorised or pipelined, and register use differs from the real kernels.
    Block-table row strides vary with the batch and get no hint."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(_ptx_sm90(module, kernel, types, constexprs, num_warps, num_stages, maxnreg))
        ptx.flush()
        result = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True)
    return result.stderr


def sass_sm90(module: str, kernel: str, types: dict[str, str], constexprs: dict[str, Any],
              num_warps: int, num_stages: int = 2) -> str:
    """The kernel's SASS for sm_90a (nvdisasm of the cubin), compiled as compile_sm90."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(_ptx_sm90(module, kernel, types, constexprs, num_warps, num_stages, None))
        subprocess.run([PTXAS, "--gpu-name=sm_90a", ptx, "-o", cubin], check=True)
        return subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout


def hot_loop(sass: str, containing: str = "") -> list[str]:
    """Instructions (opcode and operands) of the largest loop (the longest span from a label to
    a branch back to it) that has an instruction containing `containing`."""
    instructions: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: str | None = None
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if ins:
            addr = int(ins.group(1), 16)
            if pending:
                labels[pending], pending = addr, None
            instructions.append((addr, ins.group(2).strip()))
    best: list[str] = []
    for addr, text in instructions:
        target = re.search(r"BRA.*`\(\.(L_x_\d+)\)", text)
        if target and labels.get(target.group(1), addr) < addr:
            body = [t for a, t in instructions if labels[target.group(1)] <= a <= addr]
            if any(containing in t for t in body):
                best = max(best, body, key=len)
    return best


def spill_bytes(report: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def spill_report() -> dict[str, int]:
    """Spill bytes of each kernel configuration the launchers use by default."""
    spills: dict[str, int] = {}
    for head_dim in (64, 128):
        for extras in (False, True):
            constexprs = dict(HEAD_DIM=head_dim, GROUP=4, BLOCK_SIZE=16, BLOCK_M=128,
                              BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_D=head_dim,
                              LONGEST_FIRST=True,
                              USE_SOFTCAP=extras, USE_WINDOW=extras, DOT_PRECISION="tf32",
                              KV_FP8=False)
            report = compile_sm90("prefill_attention", "_prefill_kernel", ATTN_PTRS,
                                  constexprs, 8)
            spills[f"prefill d={head_dim} softcap+window={extras}"] = spill_bytes(report)
        for num_splits in (1, 8):
            types = ATTN_PTRS | {"lse_ptr": "*fp32"}
            if num_splits > 1:
                types["out_ptr"] = "*fp32"
            constexprs = dict(HEAD_DIM=head_dim, GROUP=4, BLOCK_H=16, BLOCK_SIZE=16, BLOCK_N=64,
                              BLOCK_D=head_dim, NUM_SPLITS=num_splits, USE_SOFTCAP=True,
                              USE_WINDOW=True, DOT_PRECISION="tf32", KV_FP8=False)
            report = compile_sm90("decode_attention", "_decode_split_kernel", types, constexprs,
                                  4 if head_dim <= 64 else 2)
            spills[f"decode d={head_dim} splits={num_splits}"] = spill_bytes(report)
        reduce_types = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16",
                        "query_start_loc_ptr": "*i32"}
        report = compile_sm90("decode_attention", "_decode_reduce_kernel", reduce_types,
                              dict(NUM_SPLITS=8, BLOCK_D=head_dim), 4)
        spills[f"decode reduce d={head_dim}"] = spill_bytes(report)
    bf16 = "*bf16"
    others: list[tuple[str, str, dict[str, str], dict[str, Any], int]] = [
        ("rms_norm", "_rms_norm_kernel",
         {n: bf16 for n in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}
         | {"eps": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK=4096), 16),
        ("activation", "_silu_and_mul_kernel", {"x_ptr": bf16, "out_ptr": bf16},
         dict(BLOCK=1024), 4),
        ("kv_cache", "_write_kv_kernel",
         {n: bf16 for n in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
         | {"slot_ptr": "*i64"} | SCALE_PTRS,
         dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_FP8=False), 2),
        ("rotary_kv", "_rotary_kv_kernel",
         {n: bf16 for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_cache_ptr",
                            "v_cache_ptr")} | {"pos_ptr": "*i64", "slot_ptr": "*i64",
                                               "cache_ptr": "*fp32"} | SCALE_PTRS,
         dict(IS_NEOX=True, BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=64, BLOCK_P=1,
              BLOCK_D=128, HAS_PASS=False, KV_FP8=False), 4),
        ("rotary", "_rotary_kernel",
         {n: bf16 for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")}
         | {"pos_ptr": "*i64", "cache_ptr": "*fp32"},
         dict(IS_NEOX=False, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=32, BLOCK_P=64, HAS_PASS=True), 4),
        ("argmax", "_chunk_best_kernel",
         {"logits_ptr": "*fp32", "best_val_ptr": "*fp32", "best_idx_ptr": "*i32"},
         dict(BLOCK=4096), 8),
    ]
    for module, kernel, types, constexprs, warps in others:
        spills[kernel] = spill_bytes(compile_sm90(module, kernel, types, constexprs, warps))
    return spills


def fp8_kv_spill_report() -> dict[str, int]:
    """Spill bytes of the fp8 KV-cache variants (e4m3 caches, fp32 scales, KV_FP8=True) at
    Llama-3-8B shapes with the launchers' default tiles (prefill: capped at 128 registers, as
    prefill_attention_triton launches it)."""
    fp8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32"}
    spills: dict[str, int] = {}
    for head_dim in (64, 128):
        for extras in (False, True):
            constexprs = dict(HEAD_DIM=head_dim, GROUP=4, BLOCK_SIZE=16, BLOCK_M=128,
                              BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_D=head_dim,
                              LONGEST_FIRST=True, USE_SOFTCAP=extras, USE_WINDOW=extras,
                              DOT_PRECISION="tf32", KV_FP8=True)
            report = compile_sm90("prefill_attention", "_prefill_kernel", ATTN_PTRS | fp8,
                                  constexprs, 8, maxnreg=128)
            spills[f"fp8 prefill d={head_dim} softcap+window={extras}"] = spill_bytes(report)
        for num_splits in (1, 8):
            types = ATTN_PTRS | fp8 | {"lse_ptr": "*fp32"}
            if num_splits > 1:
                types["out_ptr"] = "*fp32"
            constexprs = dict(HEAD_DIM=head_dim, GROUP=4, BLOCK_H=16, BLOCK_SIZE=16, BLOCK_N=64,
                              BLOCK_D=head_dim, NUM_SPLITS=num_splits, USE_SOFTCAP=True,
                              USE_WINDOW=True, DOT_PRECISION="tf32", KV_FP8=True)
            report = compile_sm90("decode_attention", "_decode_split_kernel", types, constexprs,
                                  4 if head_dim <= 64 else 2)  # the launcher's warps
            spills[f"fp8 decode d={head_dim} splits={num_splits}"] = spill_bytes(report)
    bf16 = "*bf16"
    spills["fp8 _write_kv_kernel"] = spill_bytes(compile_sm90(
        "kv_cache", "_write_kv_kernel",
        {"k_ptr": bf16, "v_ptr": bf16, "slot_ptr": "*i64"} | fp8,
        dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, KV_FP8=True), 2))
    for has_pass in (False, True):
        spills[f"fp8 _rotary_kv_kernel pass={has_pass}"] = spill_bytes(compile_sm90(
            "rotary_kv", "_rotary_kv_kernel",
            {n: bf16 for n in ("q_ptr", "k_ptr", "v_ptr", "q_out_ptr")} | fp8
            | {"pos_ptr": "*i64", "slot_ptr": "*i64", "cache_ptr": "*fp32"},
            dict(IS_NEOX=True, BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HK=8,
                 BLOCK_R=32 if has_pass else 64, BLOCK_P=64 if has_pass else 1, BLOCK_D=128,
                 HAS_PASS=has_pass, KV_FP8=True), 4))
    return spills


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the JIT compiler")
    print(json.dumps(fp8_kv_spill_report() if sys.argv[1:] == ["fp8kv"] else spill_report()))
