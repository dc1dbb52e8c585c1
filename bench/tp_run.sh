#!/usr/bin/env bash
# One device call on nvidia-h200-x2 for issue 7: the torch.distributed probe (with all-reduce
# timings), the TP=2 logits check against TP=1, then B1/B3 at TP=2 against TP=1 and A/Bs of the
# all-reduce and the decode GEMV (each step under its own timeout).
# Usage (device tool, carry [".whl"]): bash bench/tp_run.sh [probe|check|all]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mode=${1:-all}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
quiet() { grep -v "UserWarning\|_warn_once\|warnings.warn\|NCCL INFO\|^\s*$"; }
{
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "=== probe ($(date +%T))"
timeout 150 python3 bench/tp_probe.py --stage-timeout 40 2>&1 | quiet | tail -20
[[ $mode == probe ]] && exit 0
echo "=== TP=2 logits check ($(date +%T))"
TP_CHECK_TIMEOUT_S=150 timeout 400 python3 bench/tp_bench.py --tp 2 --only check \
  --out "$OUT/tp_check.json" > "$OUT/check.log" 2>&1; quiet < "$OUT/check.log" | tail -30
[[ $mode == check ]] && exit 0
echo "=== TP=2 vs TP=1: B1, B3 ($(date +%T))"
timeout 200 python3 bench/tp_bench.py --tp 2 --only B1,B3 --baseline \
  --out "$OUT/tp_bench.json" 2>&1 | quiet | tail -8
echo "=== A/B: TP=2 B1 with NCCL all-reduces ($(date +%T))"
timeout 100 python3 bench/tp_bench.py --tp 2 --only B1 --all-reduce nccl \
  --out "$OUT/tp_bench_nccl.json" 2>&1 | quiet | tail -3
echo "=== A/B: B1 with the Triton decode GEMV, TP=2 and TP=1 ($(date +%T))"
FLOTILLA_GEMV=triton timeout 150 python3 bench/tp_bench.py --tp 2 --only B1 --baseline \
  --out "$OUT/tp_bench_gemv.json" 2>&1 | quiet | tail -4
echo "=== done ($(date +%T))"
} 2>&1 | tee "$OUT/tp_run.log"
