"""The maintained benchmarks, by name: `python bench/run.py` lists them, `python bench/run.py NAME
[ARGS...]` runs one (its own options after the name; `-- --help` shows them).

Every benchmark prints, in the same run, the peer or the limit its numbers are read against
(STYLE.md rule 16); bench/README.md is the table of what each measures. A script in bench/ is
either a benchmark here or a helper one of them (or a test) imports: tests/test_repo.py fails on
anything else, so a one-off probe is deleted once it has answered its question (git history keeps
it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Benchmark:
    script: str
    area: str
    device: str  # where it runs: "cpu", "gpu", "2+ gpus"
    measures: str
    against: str  # the peer or limit printed in the same run


SUITE: dict[str, Benchmark] = {
    "engine": Benchmark(
        "engine_bench.py", "engine", "gpu",
        "B1-B4 on a Llama-3-8B-shaped model (batch-1 decode, 256-request throughput, a "
        "4,096-token prefill) and the prefix-cache case", "device copy bandwidth (B1's limit), "
        "the bf16 matmul rate, transformers' continuous batching for B2/B3 (--only peers)"),
    "moe": Benchmark(
        "moe_bench.py", "engine", "gpu",
        "batch-1 decode and 64-request throughput of a gpt-oss-20b-shaped model (MXFP4 experts)",
        "the bandwidth limit of the bytes a step reads"),
    "moe-offload": Benchmark(
        "moe_offload.py", "engine", "gpu",
        "decode tok/s of a Qwen3-30B-A3B-shaped model with no, half and all experts in host "
        "memory, computed on the CPU or streamed to the GPU",
        "PCIe host->device and host-memory bandwidth measured in the same run (each offload "
        "row's limit), the all-on-GPU engine with and without CUDA graphs"),
    "quant": Benchmark(
        "quant_bench.py", "quantization", "gpu",
        "decode with GPTQ / AWQ / fp8 / GGUF / in-situ quantized weights", "bf16 in the same run "
        "and the weight-bytes bandwidth limit"),
    "gguf-moe": Benchmark(
        "gguf_moe_bench.py", "quantization", "gpu",
        "GPU memory of a Qwen3-30B-A3B-shaped Q4_K_M GGUF (few layers, every matrix kept "
        "quantized) and its B1 / B16 decode", "the file's size (+ KV cache) and the bf16 "
        "model's bytes"),
    "gguf-check": Benchmark(
        "gguf_gpu_check.py", "kernels", "gpu",
        "every GGUF type's GEMV / GEMM and the GGUF fused MoE (Qwen3-30B-A3B shape) at real "
        "sizes: error and time", "dequantize-then-matmul / the torch MoE over dequantized "
        "experts; the float-expert fused MoE's time"),
    "w4batch": Benchmark(
        "w4a16_batched.py", "quantization", "gpu",
        "4-bit GEMMs at batched-decode rows (M = 2..64; M = 1: the GEMV) per Llama-3-8B "
        "projection, on the K-order and the load-time re-packed layout (--sweep: a grid of "
        "pinned tiles)", "cuBLAS bf16 on the same shapes and the copy bandwidth, in the same "
        "run"),
    "suite": Benchmark(
        "suite_bench.py", "suite", "gpu",
        "gateway -> NATS -> tokenizer -> engine: a burst of streams, time to first token and "
        "tokens/s", "the engine alone, in the same run"),
    "load": Benchmark(
        "load_test.py", "suite", "cpu or gpu",
        "bounded load at multiples of the saturating concurrency: every request ends well",
        "the saturation point it measures first"),
    "tp": Benchmark(
        "tp_bench.py", "tensor parallel", "2+ gpus",
        "TP=2 logits against TP=1, B1 / B3 at TP=2", "TP=1 on the same host (--baseline)"),
    "cpu": Benchmark(
        "cpu_engine.py", "CPU", "cpu",
        "batch-1 CPU decode through Engine.step and a long prefill's stall of a running stream",
        "fairness: the 8192-token budget (the whole prompt in one step) in the same run"),
    "library": Benchmark(
        "library_decode.py", "engine", "cpu or gpu",
        "batch-1 decode of the library API (`LLM()` with its defaults)",
        "the engine as the engine service builds and steps it, in the same run"),
    "cpu-llamacpp": Benchmark(
        "cpu_vs_llamacpp.py", "CPU", "cpu",
        "batch-1 decode, 512-token prefill, 8 sequences and perplexity of the default GGUF, "
        "flotilla's engine and llama.cpp's in lock-step rounds, same threads",
        "llama.cpp (llama-cpp-python) on the same file in the same run"),
    "cpu-llamacpp-server": Benchmark(
        "cpu_server_vs_llamacpp.py", "CPU", "cpu",
        "1-stream decode tok/s, 8 / 32-stream aggregate tok/s and TTFT through `flotilla up` and "
        "llama.cpp's `llama-server` (built from the llama-cpp-python sdist) on the default GGUF: "
        "one HTTP client, lock-step rounds, same threads, same cores (taskset)",
        "llama-server on the same file in the same run"),
    "gpu-llamacpp": Benchmark(
        "gpu_vs_llamacpp.py", "peers", "gpu (or --smoke on cpu)",
        "pp512, tg128 and batch-16 prefill / decode of a Llama-3-8B-shaped Q4_K_M GGUF (random "
        "weights, our quantizer) through flotilla's engine", "llama.cpp's llama-bench / "
        "llama-batched-bench built with CUDA from the llama-cpp-python sdist, same GPU and file, "
        "same run; the device copy bandwidth (batch-1 limit)"),
    "host": Benchmark(
        "host_overhead.py", "engine", "cpu or gpu",
        "the engine's host work per step (forward made negligible), per phase",
        "none: absolute ms per phase, against a step's device time from `profile`"),
    "gateway": Benchmark(
        "gateway_overhead.py", "suite", "cpu",
        "the gateway's CPU cost per streamed request and per token event", "a saved baseline "
        "(--baseline) and each piece alone (gateway_pieces.py)"),
    "tokenizer": Benchmark(
        "tokenizer_burst.py", "suite", "cpu",
        "how late a burst of requests reaches the engine through the tokenizer service",
        "variants of the tokenizer A/B'd in the same run (--variant NAME:FLOTILLA_X=..)"),
    "kernels": Benchmark(
        "kernels.py", "kernels", "gpu",
        "each Triton kernel's time, GB/s or TFLOP/s", "the torch reference; for attention "
        "also torch SDPA over contiguous K/V"),
    "gemv": Benchmark(
        "gemv_sweep.py", "kernels", "gpu",
        "decode GEMVs of Llama-3-8B's matrices for every weight format, M in {1..16}",
        "cuBLAS bf16, and the device copy bandwidth measured first"),
    "attention": Benchmark(
        "attention_tiles.py", "kernels", "gpu",
        "decode / prefill attention tilings on the engine's shapes", "the default tiles "
        "(marked *)"),
    "fp8-kv": Benchmark(
        "fp8_kv_cache.py", "kernels", "gpu",
        "fp8 vs bf16 KV cache: attention and cache-write kernel times", "the bf16 cache"),
    "gated-delta": Benchmark(
        "gated_delta.py", "kernels", "gpu (or --cpu)",
        "Gated DeltaNet prefill / decode and its causal conv at Qwen3-Next-80B sizes: time, "
        "GB/s and error against the fp32 torch path", "the device copy bandwidth measured first"),
    "profile": Benchmark(
        "profile_decode.py", "engine", "gpu",
        "where a decode step (graph replay vs host work) or one prefill goes, kernel by kernel",
        "the step's wall time"),
    "parity": Benchmark(
        "family_parity.py", "correctness", "gpu (or --device cpu)",
        "every supported family at real hidden sizes in bf16", "transformers on the same "
        "weights"),
    "admission": Benchmark(
        "admission_probe.py", "suite", "gpu",
        "a burst's latency per hop (client, gateway, tokenizer, engine, first token) from the "
        "services' spans, the burst's prefill steps, each service's CPU per request",
        "the first token's whole latency, split by hop"),
    "peer": Benchmark(
        "peer_transformers.py", "peers", "gpu",
        "transformers' continuous batching on B2/B3's shape", "(it is the peer of `engine`)"),
}

# runs the GPU benchmarks and tests in one device call (bash bench/gpu_run.sh [quick|perf|full])
RUNNERS = frozenset({"run.py", "gpu_run.sh"})
# imported by the benchmarks above or by tests, never run alone
HELPERS = frozenset({"__init__.py", "family_shapes.py", "moe_pass_rule.py",
                     "routing_flips.py", "gateway_pieces.py", "sse_client.py", "step_log.py",
                     "gguf_moe_file.py", "llamacpp_build.py"})


def table() -> str:
    rows = ["| name | area | runs on | measures | read against |", "|---|---|---|---|---|"]
    for name, b in SUITE.items():
        rows.append(f"| `{name}` (`{b.script}`) | {b.area} | {b.device} | {b.measures} | "
                    f"{b.against} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print(table())
        return 0
    name, rest = argv[0], [a for a in argv[1:] if a != "--"]
    if name not in SUITE:
        print(f"unknown benchmark {name!r}; one of: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.call([sys.executable, str(BENCH / SUITE[name].script), *rest], env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
