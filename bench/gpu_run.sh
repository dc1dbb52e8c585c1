#!/usr/bin/env bash
# One device call: GPU facts, kernel + engine GPU tests, kernel micro-benchmarks, engine benchmarks
# with their peers. Usage (device tool): bash bench/gpu_run.sh [quick|full]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:-full}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
step() { echo; echo "=== $*"; }
step "GPU tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/engine/test_gpu_engine.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
if [[ $mode == quick ]]; then exit 0; fi
step "kernel benchmarks"
timeout 240 python3 bench/kernels.py 2>&1 | tee "$OUT/kernels_bench.log" | tail -30
step "engine benchmarks"
timeout 420 python3 bench/engine_bench.py 2>&1 | tee "$OUT/engine_bench.log" | tail -20
step "peer: transformers continuous batching"
timeout 300 python3 bench/peer_transformers.py --requests 256 --prompt 128 --new 128 2>&1 | tail -5
