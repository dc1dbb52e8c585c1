#!/usr/bin/env bash
# One device call: GPU facts, GPU tests, engine benchmarks (async scheduling on, and off as the
# A/B), decode/prefill profiles, the suite through gateway -> NATS -> tokenizer -> engine against
# the engine alone, transformers' continuous batching as B3's peer, decode attention tilings.
# Usage (device tool, carry [".whl"]): bash bench/gpu_run.sh [quick|perf|full]   (default full)
#   quick: tests only; perf: no suite / peer / tilings / parity; full: everything (~12 minutes:
#   split it with TESTS= or run the steps one by one when a call's 10-minute limit is near).
# TESTS="..." overrides the test selection. Missing packages travel as wheels in .whl
# (docs/benchmarks.md lists them).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/all.log"
mode=${1:-full}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
step() { echo; echo "=== $* ($(date +%T))"; }
quiet() { grep -v "UserWarning\|_warn_once\|cudaStream\|Activity Buffer\|^\s*$"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
step "GPU tests"
timeout 400 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" ${TESTS:-tests/kernels \
  tests/engine/test_gpu_engine.py tests/engine/test_fp8_kv_cache.py tests/engine/test_moe_models.py} \
  2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
} 2>&1 | tee "$LOG"
[[ $mode == quick ]] && exit 0
{
step "engine benchmarks, async scheduling"
timeout 240 python3 bench/engine_bench.py --out "$OUT/engine_bench.json" 2>&1 | tail -9
step "engine benchmarks, synchronous (A/B)"
timeout 150 python3 bench/engine_bench.py --sync --only B1,B3 --out "$OUT/engine_bench_sync.json" 2>&1 | tail -4
step "decode GEMVs: cuBLAS vs ours, M=1..16"
timeout 90 python3 bench/gemv_sweep.py --m 1,2,4,8,16 --out "$OUT/gemv_sweep.json" 2>&1 | tail -30
step "FP8 KV cache kernels"
timeout 60 python3 bench/fp8_kv_cache.py 2>&1 | tail -6
step "host work per step vs device span (B4 prefill, B3 decode)"
timeout 120 python3 bench/host_overhead.py --device cuda --repeats 5 --decode-steps 10 2>&1 | tail -20
step "profile: batch-1 decode"
timeout 120 python3 bench/profile_decode.py --batch 1 2>&1 | head -24 | quiet
step "profile: batch-256 decode"
timeout 150 python3 bench/profile_decode.py --batch 256 2>&1 | head -24 | quiet
step "profile: 4096-token prefill"
timeout 120 python3 bench/profile_decode.py --prefill 4096 2>&1 | head -18 | quiet
} 2>&1 | tee -a "$LOG"
[[ $mode == perf ]] && exit 0
{
step "suite: gateway -> NATS -> tokenizer -> engine, 64 streams (engine GIL switch 5 / 0.5 ms)"
if ! timeout 300 python3 bench/suite_bench.py \
    --out "$OUT/suite_bench.json" 2>&1 | tail -4; then
  for f in "$OUT"/suite_logs/*.log; do echo "--- $f"; tail -30 "$f"; done
fi
rm -rf "$OUT/suite_logs"
step "architectures at real hidden sizes vs transformers (bf16)"
timeout 400 python3 bench/family_parity.py --out "$OUT/family_parity.json" 2>&1 \
  | grep -v -i "warn\|Writing\|rope_param\|Loading" | tail -22
step "peer: transformers continuous batching (B3 shape)"
timeout 150 python3 bench/peer_transformers.py --requests 256 --prompt 128 --new 128 2>&1 | tail -1
step "decode attention tilings (CUDA-graph replays)"
timeout 120 python3 bench/attention_tiles.py --only decode 2>&1
} 2>&1 | tee -a "$LOG"
