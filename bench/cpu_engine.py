"""The CPU engine through `Engine.step()` (scheduler, sampler, postprocess included): batch-1
decode speed, and how long a long prompt's prefill stalls a running stream.

    python bench/cpu_engine.py [--only decode,fairness] [--budgets 8192,512,256]
                               [--tokens 128] [--prompt 3000] [--threads 2] [--rounds 3]

decode: one greedy request, `--tokens` new tokens, through the CPU decode path and through the
modules, taking turns for `--rounds` rounds; prints the median tokens/s of the decode steps (the
prefill step left out) and the best 16-token window (a shared machine is noisy). The comparison
against llama.cpp is bench/cpu_vs_llamacpp.py.
fairness: stream A decodes; after 8 of its tokens a `--prompt`-token prompt B arrives. For each
step token budget (`max_num_batched_tokens`, which caps the prefill tokens a step takes) prints
A's worst gap between two tokens while B prefills, A's median gap, and B's time to first token.
The first budget is the reference (8192: the whole prompt in one step, as before the CPU default
was chosen).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402

WINDOW = 16
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]


def _engine(budget: int) -> Engine:
    return Engine(EngineConfig(model="default", device="cpu", max_num_batched_tokens=budget,
                               prefill_chunk_size=budget, kvcache_mem_mib=512,
                               quantization="auto"))


def _decode_once(engine: Engine, tokens: int) -> tuple[float, float]:
    """(tok/s of the decode steps, best WINDOW-token window's tok/s) of one greedy request."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.add_request(f"decode-{time.monotonic_ns()}", PROMPT, params)
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    stamps = stamps[1:]  # from the first token on: decode steps only
    n = len(stamps) - 1
    best = min(stamps[i + WINDOW] - stamps[i] for i in range(n - WINDOW + 1))
    return n / (stamps[-1] - stamps[0]), WINDOW / best


def decode(engine: Engine, tokens: int, rounds: int) -> None:
    """The CPU decode path (services/engine/cpu_decode.py) and the module forward it replaces,
    taking turns on one engine for `rounds` rounds; medians."""
    engine.add_request("warm-up", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    while engine.has_unfinished():
        engine.step()
    fast = engine.runner.cpu_decode
    runs: dict[str, list[tuple[float, float]]] = {"cpu_decode path": [], "modules": []}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            engine.runner.cpu_decode = fast if name == "cpu_decode path" else None
            runs[name].append(_decode_once(engine, tokens))
    engine.runner.cpu_decode = fast
    for name, rs in runs.items():
        print(f"decode, {name:>15}: {statistics.median(r[0] for r in rs):.1f} tok/s (median of "
              f"{rounds}); best {WINDOW}-token window {max(r[1] for r in rs):.1f} tok/s")


def fairness(budget: int, prompt_len: int) -> None:
    engine = _engine(budget)
    long_prompt = [(i * 7919) % 40000 + 100 for i in range(prompt_len)]
    engine.add_request("A", PROMPT, SamplingParams(temperature=0.0, max_tokens=10_000,
                                                   ignore_eos=True))
    a_times: list[float] = []
    b_added = b_first = 0.0
    while True:
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "A" and out.new_token_ids:
                a_times.append(now)
            if out.request_id == "B" and out.new_token_ids and not b_first:
                b_first = now
        if len(a_times) == 8 and not b_added:
            engine.add_request("B", long_prompt, SamplingParams(temperature=0.0, max_tokens=4))
            b_added = time.perf_counter()
        if b_first and len(a_times) > 8 and a_times[-1] > b_first + 0.2:
            break
    during = [b - a for a, b in zip(a_times, a_times[1:], strict=False) if b > b_added
              and a < b_first]
    calm = [b - a for a, b in zip(a_times[:8], a_times[1:8], strict=False)]
    print(f"budget {budget:>5}: A's worst gap while B prefills {max(during) * 1e3:8.0f} ms "
          f"(A's median gap alone {statistics.median(calm) * 1e3:5.0f} ms, "
          f"{len(during)} gaps); B's TTFT {(b_first - b_added) * 1e3:6.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="decode,fairness")
    parser.add_argument("--budgets", default="8192,512,256")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    if "decode" in only:
        decode(_engine(8192), args.tokens, args.rounds)
    if "fairness" in only:
        for budget in (int(b) for b in args.budgets.split(",")):
            fairness(budget, args.prompt)


if __name__ == "__main__":
    main()
