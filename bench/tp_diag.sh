#!/usr/bin/env bash
# Where does a TP=2 pod stop? Runs one TP=2 pod (2-layer 8B-shaped checkpoint) with CUDA graphs and
# one eager; a pod still running after $WAIT s prints every thread's stack (SIGUSR1) into its log.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; WAIT=${WAIT:-75}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
fi
CK=$(python3 -c 'from bench.tp_bench import write_random_checkpoint as w; print(w(2))' 2>/dev/null | tail -1)
pod() {  # name, extra flags
  setsid python3 bench/tp_bench.py --check-one "$CK" --tp 2 --out "$OUT/$1.pt" ${2:-} \
    > "$OUT/$1.log" 2>&1 &
  local pid=$! i
  for i in $(seq "$WAIT"); do sleep 1; kill -0 $pid 2>/dev/null || break; done
  if kill -0 $pid 2>/dev/null; then
    kill -USR1 -- -$pid; sleep 4; kill -9 -- -$pid; echo "$1: HUNG after ${WAIT}s"
  else wait $pid; echo "$1: exit $? after ${i}s"; fi
  grep -v "Warning\|warn" "$OUT/$1.log" | grep -A3 "File \|Thread\|Error\|error" | head -${3:-60}
}
NCCL_DEBUG=INFO pod graphs "" 80
pod eager --enforce-eager 40
