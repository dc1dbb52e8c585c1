#!/usr/bin/env bash
# Session-2 device call (H200 x2): GPU tests of the new kernels (FP8 KV cache, MLA, decode GEMV),
# the FP8-KV timing, the GEMV sweep at M=1..8, the engine benchmarks with the Triton decode GEMV,
# the all-reduce timings. carry [".whl"].
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
quiet() { grep -v "UserWarning\|_warn_once\|warnings.warn\|NCCL INFO\|^\s*$"; }
{
echo "=== GPU tests ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu -s \
  tests/kernels/test_fp8_kv_cache.py tests/engine/test_fp8_kv_cache.py \
  tests/kernels/test_mla_attention.py tests/engine/test_moe_models.py tests/kernels/test_gemv.py \
  2>&1 | grep -i "MLA H=\|passed\|failed\|Error\|assert" | head -20
echo "=== fp8 KV timing ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/fp8_kv_cache.py 2>&1 | quiet | tail -8
echo "=== all-reduce timings ($(date +%T))"
timeout 90 python3 bench/tp_probe.py --stage-timeout 40 2>&1 | grep "timings\|exit"
echo "=== GEMV sweep M=1,2,4,8 ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 timeout 80 python3 bench/gemv_sweep.py --m 1,2,4,8 --formats cublas,gemv \
  --out "$OUT/gemv_sweep.json" 2>&1 | quiet | tail -22
echo "=== engine benchmarks, Triton decode GEMV ($(date +%T))"
CUDA_VISIBLE_DEVICES=0 FLOTILLA_GEMV=triton timeout 150 python3 bench/engine_bench.py \
  --only peers,B1,B2,B3,B4 --out "$OUT/engine_bench_gemv.json" 2>&1 | quiet | tail -8
echo "=== done ($(date +%T))"
} 2>&1 | tee "$OUT/final_run.log"
