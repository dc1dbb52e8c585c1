"""GPU memory and decode speed of a Qwen3-30B-A3B-shaped Q4_K_M GGUF served from its blocks.

    python bench/gguf_moe_bench.py [--layers 6] [--split 0] [--out FILE]
    python bench/gguf_moe_bench.py --smoke     # same code on CPU at tiny sizes (script check)

The file is written by bench/gguf_moe_file.py (random weights, our quantizer, llama.cpp's
Q4_K_M type mix; --layers of the 48, since writing all 48 takes minutes and ~18 GB of disk;
--split N writes a split set of N tensors a part). Measured:
- weights: GPU memory the loaded model holds (torch.cuda.memory_allocated after load_model minus
  before), against the file's size; the ratio is what "GGUF stays quantized" means (the token
  embedding is held in bf16, ~0.6 GB at this vocabulary: most of the part above 1.0 with few
  layers). Peak memory while loading too.
- KV: bytes of the KV cache for --context tokens (bf16), beside file size + KV.
- decode: batch-1 and batch-16 decode tok/s through the Engine (128-token prompts).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import gpu_state, rand_prompts, run  # noqa: E402
from bench.gguf_moe_file import QWEN3_30B_A3B, MoEShape, write_qwen3_moe_gguf  # noqa: E402
from flotilla.libs.common.gguf_files import gguf_parts  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.loader import load_model  # noqa: E402

SMOKE = MoEShape(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=8,
                 top_k=2, moe_inter=256, context=512)


def kv_bytes(shape: MoEShape, tokens: int) -> int:
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * 2 * tokens


def float_bytes(shape: MoEShape) -> int:
    """bf16 bytes of the same model with every matrix in bf16 (what the file held before)."""
    s = shape
    attn = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden
    experts = s.experts * 3 * s.hidden * s.moe_inter
    return 2 * (s.layers * (attn + experts + s.experts * s.hidden) + 2 * s.vocab * s.hidden)


def measure_weights(path: Path, device: str) -> dict[str, float]:
    if device != "cuda":
        load_model(path, dtype=torch.float32, device=device, quantization="gguf")
        return {}
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_model(path, dtype=torch.bfloat16, device=device).model
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    floats = sum(t.numel() * t.element_size()
                 for t in (*model.parameters(), *model.buffers()) if t.is_floating_point())
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"weights_GB": held / 1e9, "load_peak_GB": peak / 1e9, "float_tensors_GB": floats / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--split", type=int, default=0, help="tensors per part (0: one file)")
    ap.add_argument("--context", type=int, default=32768, help="KV tokens for file + KV")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: a script check")
    ap.add_argument("--dir", default=None, help="where to write the GGUF (default: a temp dir)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/gguf_moe_bench.json")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else replace(QWEN3_30B_A3B, layers=args.layers)
    device = "cpu" if args.smoke else "cuda"
    res: dict[str, Any] = {"date": datetime.date.today().isoformat(), "shape": asdict(shape),
                           "torch": torch.__version__}
    if device == "cuda":
        res.update(gpu=torch.cuda.get_device_name(), gpu_state_before=gpu_state())
    t = time.perf_counter()
    where = Path(args.dir or tempfile.mkdtemp(prefix="gguf-moe-"))
    path = write_qwen3_moe_gguf(where / "qwen3moe-Q4_K_M.gguf", shape, device=device,
                                split_max_tensors=args.split)
    res["write_s"] = time.perf_counter() - t
    res["file_GB"] = sum(p.stat().st_size for p in gguf_parts(path)) / 1e9
    res["bf16_model_GB"] = float_bytes(shape) / 1e9
    res["kv_GB"] = kv_bytes(shape, args.context) / 1e9
    t = time.perf_counter()
    res.update(measure_weights(path, device))
    res["load_s"] = time.perf_counter() - t
    engine = Engine(EngineConfig(model=str(path), dtype="float32" if args.smoke else "bfloat16",
                                 device=device, max_num_seqs=32, max_num_batched_tokens=4096,
                                 num_kv_blocks=256 if args.smoke else 2048))
    new_tokens = 8 if args.smoke else 128
    run(engine, rand_prompts(2, 32, shape.vocab, 0), 4)  # warm-up
    res["B1"] = run(engine, rand_prompts(1, 128, shape.vocab, 1), new_tokens)
    res["B16"] = run(engine, rand_prompts(16, 128, shape.vocab, 2), new_tokens)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"\n{res.get('gpu', 'cpu (smoke)')}  {res['date']}  layers {shape.layers}  "
          f"file {res['file_GB']:.3f} GB  (bf16 model {res['bf16_model_GB']:.3f} GB)")
    if "weights_GB" in res:
        ratio = res["weights_GB"] / res["file_GB"]
        total = (res["weights_GB"] + res["kv_GB"]) / (res["file_GB"] + res["kv_GB"])
        print(f"GPU weights {res['weights_GB']:.3f} GB = {ratio:.3f} x file  (float tensors "
              f"{res['float_tensors_GB']:.3f} GB, load peak {res['load_peak_GB']:.3f} GB)")
        print(f"weights + KV({args.context}) {res['weights_GB'] + res['kv_GB']:.3f} GB = "
              f"{total:.3f} x (file + KV)")
    print(f"decode B1 {res['B1']['decode_tok_s']:.1f} tok/s   B16 {res['B16']['decode_tok_s']:.1f} "
          f"tok/s   (load {res['load_s']:.1f}s, write {res['write_s']:.1f}s)")


if __name__ == "__main__":
    main()
