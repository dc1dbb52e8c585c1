#!/usr/bin/env bash
# Device calls (H100), carry [".whl"]; each part fits one 10-minute call:
#   bash bench/final_run.sh ab       # B1 of gptq / awq / bf16 (3 runs each), FLOTILLA_PDL=1 then 0
#                                    # (PDL_MODES, FORMATS; TESTS: GPU tests to run first)
#   bash bench/final_run.sh quant    # GPU tests of the kernels + quant_bench (all formats)
#   bash bench/final_run.sh engine   # engine_bench (peers, B1-B4, prefix), the suite vs engine,
#                                    # per-hop admission of a 64-stream burst
#   bash bench/final_run.sh admit    # admission (16 client processes) + suite, 1 and 4 gateways
#   bash bench/final_run.sh suite    # suite vs engine A/B (VARIANTS: suite_bench --variant
#                                    # values, default the engine as it is now; ROUNDS x
#                                    # REPEAT bursts each)
#   bash bench/final_run.sh pad      # GPU engine tests, bench/shape_probe.py with and without
#                                    # bucketed eager steps, then the suite A/B of the same
#                                    # (cold and warm client connections)
#   bash bench/final_run.sh graphs   # GPU tests of whole-step graphs, bench/shape_probe.py with
#                                    # and without them, engine_bench (peers, B1-B3, prefix) with
#                                    # them and B1 + prefix without (NOGRAPHS=0 skips it), the
#                                    # TTFT A/B in one process (SUITE=1: the suite A/B too;
#                                    # GRAPH_TOKENS= skips the shape probes, ONLY= the B list)
#   bash bench/final_run.sh lab      # GPU tests of the prefill paths (TESTS overrides), then
#                                    # bench/prefill_lab.py (B4 options A/B), once per
#                                    # '|'-separated argument list in LAB_RUNS
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
quiet() { grep -v "UserWarning\|_warn_once\|warnings.warn\|^\s*$"; }
part=${1:-quant}
{
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [[ $part == ab ]]; then
  if [[ -n ${TESTS:-} ]]; then
    echo "=== GPU tests ($(date +%T))"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS 2>&1 \
      | grep -E "passed|failed|^FAILED|^E " | head -20
  fi
  i=0
  for mode in ${PDL_MODES:-1 0}; do
    i=$((i + 1))
    echo "=== FLOTILLA_PDL=$mode ($(date +%T))"
    FLOTILLA_PDL=$mode timeout 200 python3 bench/quant_bench.py --only ${FORMATS:-gptq,awq,bf16} \
      --repeat 3 --out "$OUT/quant_ab_${i}_pdl$mode.json" 2>&1 | quiet | tail -6
  done
elif [[ $part == quant ]]; then
  echo "=== GPU tests ($(date +%T))"
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/quant \
    tests/kernels/test_pdl.py tests/kernels/test_gemv.py tests/kernels/test_dense_attention.py \
    tests/engine/test_gpu_engine.py 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
  echo "=== quant bench ($(date +%T))"
  timeout 250 python3 bench/quant_bench.py --repeat 3 --out "$OUT/quant_bench.json" 2>&1 \
    | quiet | tail -8
elif [[ $part == lab ]]; then
  echo "=== GPU tests ($(date +%T))"
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/kernels/test_gated_gemm.py \
    tests/kernels/test_dense_attention.py tests/engine/test_gpu_engine.py} 2>&1 \
    | grep -E "passed|failed|^FAILED|^E " | head -30
  IFS='|' read -ra runs <<< "${LAB_RUNS:-}"  # several runs: their arguments, '|' between
  [[ ${#runs[@]} -eq 0 ]] && runs=("")
  i=0
  for r in "${runs[@]}"; do
    i=$((i + 1))
    echo "=== prefill lab $i: $r ($(date +%T))"
    # shellcheck disable=SC2086
    timeout 400 python3 bench/prefill_lab.py $r --out "$OUT/prefill_lab_$i.json" 2>&1 \
      | quiet | grep -v "^ *[%#}{^]\|mlir\|^ *tt\.\|^ *scf\.\|^ *arith\." | tail -45
  done
elif [[ $part == suite ]]; then
  args=()
  for v in ${VARIANTS:-now}; do args+=(--variant "$v"); done
  echo "=== suite vs engine, 64 streams: ${args[*]} ($(date +%T))"
  timeout 560 python3 bench/suite_bench.py "${args[@]}" --rounds "${ROUNDS:-2}" \
    --repeat "${REPEAT:-3}" --out "$OUT/suite_ab.json" 2>&1 | grep -v Warning | tail -30
  rm -f "$OUT"/suite_logs/*.log
elif [[ $part == pad ]]; then
  echo "=== GPU tests ($(date +%T))"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/engine/test_gpu_engine.py} \
    2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
  for p in 1 0; do
    echo "=== prefill launch per shape, pad_eager_steps=$p ($(date +%T))"
    timeout 120 python3 bench/shape_probe.py --pad $p --profile 0 --idle 0.5 \
      --shapes 4x128,11x128,18x128,53x128,7x100,3x700 --out "$OUT/shape_probe_pad$p.json" 2>&1 \
      | quiet | grep -v "USDT\|_warn_once" | tail -8
  done
  echo "=== suite vs engine, 64 streams, padded / not ($(date +%T))"
  timeout 400 python3 bench/suite_bench.py --variant pad --variant nopad:FLOTILLA_PAD_EAGER_STEPS=0 \
    --rounds "${ROUNDS:-2}" --repeat "${REPEAT:-2}" --out "$OUT/suite_pad.json" 2>&1 \
    | grep -v Warning | tail -30
  rm -f "$OUT"/suite_logs/*.log
elif [[ $part == graphs ]]; then
  echo "=== GPU tests ($(date +%T))"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/engine/test_step_graphs.py \
    tests/kernels/test_prefill_attention.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_gpu_engine.py} 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
  for g in ${GRAPH_TOKENS-512 0}; do
    echo "=== prefill step per shape, step_graph_tokens=$g ($(date +%T))"
    timeout 150 python3 bench/shape_probe.py --step-graphs "$g" --profile 0 --idle 0.5 \
      --shapes ${SHAPES:-1x16,1x128,1x500,2x200,4x128,11x128,3x700} \
      --out "$OUT/shape_probe_graphs$g.json" 2>&1 | quiet | grep -v "USDT\|_warn_once" | tail -10
  done
  echo "=== TTFT of one prompt, step graphs on / off in one process ($(date +%T))"
  timeout 150 python3 bench/ttft_probe.py --out "$OUT/ttft_probe.json" 2>&1 | quiet | tail -6
  echo "=== engine benchmarks, step graphs on ($(date +%T))"
  timeout 240 python3 bench/engine_bench.py --only ${ONLY:-peers,B1,B2,B3,prefix} \
    --out "$OUT/engine_bench_graphs.json" 2>&1 | quiet | tail -8
  if [[ ${NOGRAPHS:-1} != 0 ]]; then
    echo "=== engine benchmarks, step graphs off ($(date +%T))"
    timeout 150 python3 bench/engine_bench.py --only B1,prefix --step-graph-tokens 0 \
      --out "$OUT/engine_bench_nographs.json" 2>&1 | quiet | tail -5
  fi
  if [[ -n ${SUITE:-} ]]; then
    echo "=== suite vs engine, 64 streams, step graphs on / off ($(date +%T))"
    timeout 300 python3 bench/suite_bench.py --variant graphs \
      --variant nographs:FLOTILLA_STEP_GRAPH_TOKENS=0 --rounds 1 --repeat "${REPEAT:-2}" \
      --out "$OUT/suite_graphs.json" 2>&1 | grep -v Warning | tail -20
    rm -f "$OUT"/suite_logs/*.log
  fi
elif [[ $part == admit ]]; then
  for w in 1 4; do
    echo "=== per-hop admission, 16 client processes, $w gateway worker(s) ($(date +%T))"
    timeout 150 python3 bench/admission_probe.py --device cuda --full --layers 32 --repeat 2 \
      --clients 16 --env FLOTILLA_GATEWAY_WORKERS=$w --out "$OUT/admission_probe_gw$w.json" \
      2>&1 | quiet | grep -E "burst|arrivals|send→|→first|TTFT|CPU per" | tail -14
    echo "=== suite vs engine, 64 streams, $w gateway worker(s) ($(date +%T))"
    FLOTILLA_GATEWAY_WORKERS=$w timeout 200 python3 bench/suite_bench.py \
      --out "$OUT/suite_bench_gw$w.json" 2>&1 | tail -4
    rm -rf "$OUT/suite_logs"
  done
else
  echo "=== engine benchmarks ($(date +%T))"
  timeout 280 python3 bench/engine_bench.py --out "$OUT/engine_bench.json" 2>&1 | quiet | tail -10
  echo "=== suite vs engine, 64 streams ($(date +%T))"
  if ! timeout 280 python3 bench/suite_bench.py --out "$OUT/suite_bench.json" 2>&1 | tail -4; then
    for f in "$OUT"/suite_logs/*.log; do echo "--- $f"; tail -20 "$f"; done
  fi
  rm -rf "$OUT/suite_logs"
  echo "=== per-hop admission of a 64-stream burst ($(date +%T))"
  timeout 200 python3 bench/admission_probe.py --device cuda --full --layers 32 --repeat 2 \
    --out "$OUT/admission_probe.json" 2>&1 | quiet | tail -16
fi
echo "=== done ($(date +%T))"
} 2>&1 | tee "$OUT/final_run_$part.log"
