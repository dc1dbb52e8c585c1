"""Tensor-parallel benchmark and logits check on GPUs (run on nvidia-h200-x2 for --tp 2).

    python bench/tp_bench.py --tp 2 [--baseline] [--layers 32] [--only check,B1,B3] [--out FILE]

- check: a few-layer Llama-3-8B-shaped model with random bf16 weights written as safetensors
  (so every rank loads its real slice), prompt logits at TP=N against TP=1 (bf16 tolerance) and
  greedy tokens, each pod in its own process so GPU memory and the process group start clean.
- B1 (batch 1, 128 in / 256 out, decode tok/s) and B3 (256 x 128 in / 128 out, output tok/s) of
  bench/engine_bench.py on the full-depth Llama-3-8B shape with `load_format="dummy"`.
  --baseline also runs them at TP=1 (separate process) and prints the speed-up.
Writes JSON to --out (default $OUT/tp_bench.json). NCCL_NVLS_ENABLE=0 and the other multicast-off
variables are set for every rank.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import LLAMA3_8B, model_dir, rand_prompts, run  # noqa: E402
from flotilla.libs.common.settings import EngineSettings  # noqa: E402
from flotilla.services.engine.distributed import disable_multicast_env  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.factory import kernel_selection  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402

CHECK_PROMPT_LEN = 96
CHECK_TIMEOUT_S = float(os.environ.get("TP_CHECK_TIMEOUT_S", "150"))
# --smoke: the same code paths on CPU with a tiny shape (checks the script, not the speed)
SMOKE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=512)
_SHAPE: dict = dict(LLAMA3_8B)
# the kernel switches of the environment (FLOTILLA_GEMV=triton, ...), as a server would read them
_ENGINE: dict = dict(dtype="bfloat16", device="cuda",
                     kernel_selection=kernel_selection(EngineSettings()))
_SIZES = {"B1": (1, 128, 256), "B3": (256, 128, 128)}  # requests, prompt, output tokens


def write_random_checkpoint(layers: int) -> str:
    """An 8B-shaped HF safetensors directory with `layers` layers of random bf16 weights."""
    from safetensors.torch import save_file

    cfg = dict(_SHAPE, num_hidden_layers=layers)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
              "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,)})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            std = 1.0 if "embed" in name else shape[1] ** -0.5
            t = (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16).cpu()
        tensors[name] = t
    d = Path(tempfile.mkdtemp(prefix="llama3-8b-ckpt-"))
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    return str(d)


def check_one(path: str, tp: int, out: str) -> None:
    """One pod: prompt logits and 16 greedy tokens, saved to `out`."""
    engine = Engine(EngineConfig(model=path, tp=tp, kvcache_mem_mib=2048, max_num_seqs=8,
                                 **_ENGINE))
    try:
        prompt = rand_prompts(1, CHECK_PROMPT_LEN, _SHAPE["vocab_size"], 11)[0]
        logits = engine.prompt_logits(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engine.add_request("g", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens.extend(o.new_token_ids)
        torch.save({"logits": logits, "tokens": tokens}, out)
    finally:
        engine.shutdown()


def _run_dumping_on_hang(cmd: list[str], timeout_s: float) -> None:
    """Run `cmd` in its own process group; past `timeout_s` every process in it prints its
    threads' stacks (SIGUSR1 → faulthandler) before the group is killed."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        print(f"--- {cmd[2:6]} still running after {timeout_s:.0f}s: stacks", flush=True)
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"hung: {' '.join(cmd[1:6])}") from None
    if code:
        raise subprocess.CalledProcessError(code, cmd)


def logits_check(tp: int, layers: int) -> dict:
    path = write_random_checkpoint(layers)
    results = {}
    for n in (1, tp):
        out = os.path.join(path, f"tp{n}.pt")
        _run_dumping_on_hang([sys.executable, __file__, "--check-one", path, "--tp", str(n),
                              "--out", out, *_child_flags()], CHECK_TIMEOUT_S)
        results[n] = torch.load(out)
    ref, ours = results[1]["logits"], results[tp]["logits"]
    rel = float((ours - ref).abs().max() / ref.abs().max())
    argmax = float((ours.argmax(-1) == ref.argmax(-1)).float().mean())
    same_prefix = 0
    for a, b in zip(results[1]["tokens"], results[tp]["tokens"], strict=True):
        if a != b:
            break
        same_prefix += 1
    return {"layers": layers, "rel_error": rel, "argmax_agreement": argmax,
            "greedy_same_prefix": same_prefix, "greedy_tokens": len(results[1]["tokens"]),
            "ok": rel < 3e-2 and argmax > 0.97}


def speed(tp: int, layers: int, only: set[str]) -> dict:
    t = time.perf_counter()
    path = model_dir(layers)
    (Path(path) / "config.json").write_text(json.dumps(dict(_SHAPE, num_hidden_layers=layers)))
    engine = Engine(EngineConfig(model=path, tp=tp, load_format="dummy", max_num_seqs=256,
                                 max_num_batched_tokens=8192, **_ENGINE))
    res: dict = {"tp": tp, "startup_s": time.perf_counter() - t,
                 "kv_capacity_tokens": engine.runner.num_blocks * engine.config.block_size}
    try:
        vocab = _SHAPE["vocab_size"]
        run(engine, rand_prompts(2, 64, vocab, 0), 8)  # warm-up
        for seed, key in enumerate(("B1", "B3"), start=1):
            if key in only:
                n, prompt_len, out_len = _SIZES[key]
                res[key] = run(engine, rand_prompts(n, prompt_len, vocab, seed), out_len)
    finally:
        engine.shutdown()
    return res


def _child_flags() -> list[str]:
    return (["--smoke"] if _ENGINE["device"] == "cpu" else []) + (
        ["--enforce-eager"] if _ENGINE.get("enforce_eager") else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--check-layers", type=int, default=2)
    ap.add_argument("--only", default="check,B1,B3")
    ap.add_argument("--baseline", action="store_true", help="also measure TP=1 (subprocess)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/tp_bench.json")
    ap.add_argument("--check-one", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (script check)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--all-reduce", default="auto", help="EngineConfig.tp_all_reduce")
    args = ap.parse_args()
    disable_multicast_env()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.enforce_eager:
        _ENGINE["enforce_eager"] = True
    _ENGINE["tp_all_reduce"] = args.all_reduce
    if args.smoke:
        _SHAPE.update(SMOKE)
        _ENGINE.update(dtype="float32", device="cpu", quantization=None)
        _SIZES.update(B1=(1, 16, 32), B3=(8, 16, 8))
    if args.check_one:
        check_one(args.check_one, args.tp, args.out)
        return
    only = set(args.only.split(","))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res: dict = {"gpu": gpu, "gpus": torch.cuda.device_count(),
                 "date": datetime.date.today().isoformat(), "torch": torch.__version__,
                 "tp": args.tp}
    if "check" in only:
        res["check"] = logits_check(args.tp, args.check_layers)
        print(f"logits check TP={args.tp} vs TP=1 ({args.check_layers} layers): "
              f"rel error {res['check']['rel_error']:.2e}, argmax agreement "
              f"{res['check']['argmax_agreement']:.1%}, greedy same for "
              f"{res['check']['greedy_same_prefix']}/{res['check']['greedy_tokens']} tokens "
              f"-> {'OK' if res['check']['ok'] else 'MISMATCH'}", flush=True)
    if only & {"B1", "B3"}:
        if args.baseline and args.tp != 1:
            base_out = args.out + ".tp1.json"
            subprocess.run([sys.executable, __file__, "--tp", "1", "--layers", str(args.layers),
                            "--only", ",".join(sorted(only & {"B1", "B3"})), "--out",
                            base_out, *_child_flags()], check=True)
            res["baseline"] = json.loads(Path(base_out).read_text())["speed"]
        res["speed"] = speed(args.tp, args.layers, only)
        s = res["speed"]
        print(f"TP={args.tp} {args.layers} layers, startup {s['startup_s']:.0f}s, "
              f"KV {s['kv_capacity_tokens']} tokens", flush=True)
        for key, metric, label in (("B1", "decode_tok_s", "B1 batch 1 decode tok/s"),
                                   ("B3", "output_tok_s", "B3 256x128/128 output tok/s")):
            if key in s:
                line = f"{label:32s} {s[key][metric]:10.1f}"
                base = res.get("baseline", {}).get(key)
                if base:
                    line += f"   TP=1 {base[metric]:10.1f}   x{s[key][metric] / base[metric]:.2f}"
                print(line, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
