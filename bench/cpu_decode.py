"""Batch-1 CPU decode speed of the engine's model path (paged KV cache, kernels' torch refs).

    python bench/cpu_decode.py [--model PATH] [--dtype float32|bfloat16]
                               [--quantization cpu|int8|int4] [--tokens 128] [--threads 2]

Prefills a short prompt, then decodes greedily one token per forward (cached K/V) and prints
decode tokens/second: overall, and the best window of 16 tokens (other processes on a small
shared CPU make the overall number noisy). Uses the engine tests' single-sequence helper as the
model runner.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libs.common.model_cache import resolve_model  # noqa: E402
from services.engine.loader import load_model  # noqa: E402
from tests.engine.conftest import SingleSequenceRunner  # noqa: E402

WINDOW = 16
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="path or hub id; default: embedded model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None,
                        choices=[None, "none", "cpu", "int8", "int4"],
                        help="cpu: the engine's CPU default (int4 for a Q4_1 GGUF, else int8)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, config = load_model(resolve_model(args.model), dtype=getattr(torch, args.dtype),
                               device="cpu", quantization=args.quantization)
    runner = SingleSequenceRunner(model, max_tokens=len(PROMPT) + args.tokens + 8)
    runner.greedy_cached(PROMPT, 8)  # warm-up (allocator, first-call paths)

    with torch.inference_mode():
        start = time.perf_counter()
        logits = runner.forward(PROMPT, 0, all_logits=False)
        prefill_s = time.perf_counter() - start
        token, pos = int(logits[-1].argmax()), len(PROMPT)
        stamps = [time.perf_counter()]
        for _ in range(args.tokens):
            token = int(runner.forward([token], pos, all_logits=False)[-1].argmax())
            pos += 1
            stamps.append(time.perf_counter())
    decode_s = stamps[-1] - stamps[0]
    window = min(WINDOW, args.tokens)
    best_s = min(stamps[i + window] - stamps[i] for i in range(len(stamps) - window))
    print(f"model={config.architecture} layers={config.num_layers} dtype={args.dtype} "
          f"quantization={args.quantization or 'none'} threads={args.threads}")
    print(f"prefill {len(PROMPT)} tokens: {prefill_s * 1e3:.1f} ms")
    print(f"decode {args.tokens} tokens: {args.tokens / decode_s:.1f} tok/s "
          f"({decode_s / args.tokens * 1e3:.2f} ms/token); best {window}-token window: "
          f"{window / best_s:.1f} tok/s")


if __name__ == "__main__":
    main()
