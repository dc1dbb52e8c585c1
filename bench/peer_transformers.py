"""Peer for B2/B3: transformers' own continuous batching (`generate_batch`) on the same shape.

Random bf16 Llama-3-8B-shaped weights built on the GPU. Prints output tok/s for the given
workload; run in the same session as bench/engine_bench.py so both use the same GPU.

    python bench/peer_transformers.py --requests 256 --prompt 128 --new 128 [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import LLAMA3_8B, rand_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--attn", default="paged|sdpa")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/peer_transformers.json")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.generation import GenerationConfig

    cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                 attn_implementation=args.attn)
    model.eval()
    prompts = rand_prompts(args.requests, args.prompt, cfg["vocab_size"], 3)
    gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    model.generate_batch(inputs=prompts[:4], generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = sum(len(o.generated_tokens) for o in out.values())
    res = {"gpu": torch.cuda.get_device_name(), "attn": args.attn, "requests": args.requests,
           "output_tokens": n, "seconds": dt, "output_tok_s": n / dt,
           "transformers": __import__("transformers").__version__}
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"transformers generate_batch ({args.attn}) {args.requests} x {args.prompt}/{args.new}: "
          f"{n / dt:.0f} out tok/s ({n} tokens in {dt:.1f}s)")


if __name__ == "__main__":
    main()
