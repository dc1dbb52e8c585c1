"""Every supported family at real hidden sizes on the GPU in bf16 against transformers.

    python bench/family_parity.py [--only llama,gemma2] [--smoke] [--device cpu] [--out FILE]

Per family (shapes and reductions: bench/family_shapes.py): transformers builds the model from a
fixed seed on the device, rounds it to bf16 and saves it as safetensors, then loads it back with
`from_pretrained` in bf16 (its reference) and in fp32 (the truth; see `load_reference`); our
Engine loads that directory (bf16, paged KV cache, CUDA graphs on) and gives
- prompt logits (64 tokens, eager paged prefill), compared with transformers' bf16 forward and
  with its fp32 forward of the same bf16 weights (the truth): rel. error ||ours - ref|| / ||ref||;
  a dense family passes with both below 2e-2, a MoE family by the rule below;
- 8 greedy tokens, decode steps replaying the CUDA graphs, against transformers' bf16 `generate`:
  `eq` is the number of equal leading tokens. Each of our decode steps up to the first difference
  (same prefix on both sides) is checked against the fp32 truth: `dec` is the largest error of
  our sampled token's logprob in units of that step's logit std, must be below 0.1; a differing
  token must be a near tie in the truth (logit gap below 0.1 std, `gap`).
transformers' bf16 error against its own fp32 truth is printed as `hf`, the noise floor, and
`x hf` is our error against the truth divided by it (1: as close to fp32 as transformers' bf16).
One table row per family, JSON to --out (default $OUT/family_parity.json). --smoke runs the same
code on CPU in fp32 at the CPU parity tests' tiny sizes (a check of the script, not of the GPU).
`--device cpu` runs the real sizes in bf16 on the CPU (unquantized; ~13 GB of memory for the
largest family): the engine then serves with its torch reference kernels, so this checks the
model code and the references, not the Triton kernels (and no CUDA graphs).

For MoE families the top-k expert set of every router call in the prompt forward is recorded
(bench/routing_flips.py): `flips` counts prompt tokens whose experts in some layer differ from
the fp32 truth's, transformers' bf16 / ours. bf16 moves near ties among router scores, and a
flipped token runs another MLP (error ~0.1-0.3 on that token), so which and how many tokens
flip decides the overall error of two correct bf16 runs. A MoE family's prompt logits therefore
pass (bench/moe_pass_rule.py) when
1. our error against the truth over the tokens we route as the truth does is below 2e-2,
2. our flip count is at most transformers' bf16 count + max(2, ceil(25% of it)), and
3. our overall error against the truth is at most 1.25 x transformers' bf16 own, or below 2e-2;
the decode checks are the dense ones. The plain overall numbers are printed and written as for a
dense family, with `plain` (would the dense rule pass) and errors split by routing (`routed` /
`flipped` for each run, and all three pairs over the tokens both runs route as the truth does).

transformers 5.17 runs Gemma 2 through SDPA, which silently drops the attention soft-cap (5.23
marks Gemma 2 as not SDPA-capable); configs with an attention soft-cap are therefore built with
eager attention, the definition of the model.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.family_shapes import FAMILIES, REDUCTIONS, Family, config_dict  # noqa: E402
from bench.moe_pass_rule import (  # noqa: E402
    FLIP_SLACK,
    FLIP_SLACK_FRACTION,
    LOGITS_TOL,
    X_HF,
    MoeVerdict,
    TokenSplit,
    moe_verdict,
    rel_error,
    rows_error,
    split_by_routing,
)
from bench.routing_flips import capture_routing, routing_flips  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 64, 8
DECODE_TOL = 0.1


class Reference(NamedTuple):
    bf16_logits: torch.Tensor  # [P, V] transformers in the run dtype
    tokens: list[int]  # transformers' greedy tokens in the run dtype
    truth: torch.Tensor  # [P + N, V] fp32 forward of prompt + tokens, same weights
    routing_bf16: list[torch.Tensor]  # per MoE layer [P, K] expert ids (empty: dense)
    routing_truth: list[torch.Tensor]  # per MoE layer [P + N, K] expert ids of the truth


class Ours(NamedTuple):
    logits: torch.Tensor  # [P, V]
    tokens: list[int]
    logprobs: list[float]  # of each sampled token
    graphs: bool  # decode steps replayed CUDA graphs
    routing: list[torch.Tensor]  # per MoE layer [P, K] expert ids of the prompt forward


def build_reference(family: Family, smoke: bool, path: Path, prompt: list[int],
                    device: str, dtype: torch.dtype, seed: int = 0) -> Reference:
    """Random-init the model in transformers, save it in `dtype`, and run it loaded back in
    `dtype` (the bf16 reference) and in float32 (the truth: an exact upcast of the weights)."""
    import transformers

    config = transformers.AutoConfig.for_model(family.case.model_type,
                                               **config_dict(family, smoke))
    kwargs = {}
    if getattr(config, "attn_logit_softcapping", None):
        kwargs["attn_implementation"] = "eager"  # 5.17's SDPA path ignores the soft-cap
    torch.manual_seed(seed)
    with torch.device(device):
        if family.case.hf_class.startswith("Auto"):
            hf = getattr(transformers, family.case.hf_class).from_config(config, **kwargs)
        else:
            hf = getattr(transformers, family.case.hf_class)(config)
        with torch.no_grad():
            for param in hf.parameters():
                if param.dim() == 1:  # norm scales and biases start constant: make them count
                    param.add_(torch.randn_like(param) * 0.2)
            for module in hf.modules():  # a zero correction bias would go untested
                bias = getattr(module, "e_score_correction_bias", None)
                if bias is not None:
                    bias.normal_(0.0, 0.1)
    hf = hf.to(dtype)
    _keep_fp32(hf)
    hf.save_pretrained(path)
    del hf
    _free()
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        hf = load_reference(family, path, dtype, device, kwargs)
        with capture_routing(hf) as routing_bf16:
            bf16_logits = hf(ids).logits[0].float().cpu()
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        del hf
        _free()
        hf = load_reference(family, path, torch.float32, device, kwargs)
        with capture_routing(hf) as routing_truth:
            truth = hf(out).logits[0].float().cpu()
    del hf
    return Reference(bf16_logits, tokens, truth, routing_bf16, routing_truth)


def load_reference(family: Family, path: Path, dtype: torch.dtype, device: str,
                   kwargs: dict[str, Any]) -> Any:  # a transformers PreTrainedModel
    """transformers' model of the saved checkpoint, loaded as a user loads it.

    Never `.to(dtype)` a built model instead: that also casts the buffers transformers computes
    at load time rather than reading them from the checkpoint (the rotary `inv_freq`, kept
    float32 by `from_pretrained`). Rounded to bf16 they move every rotary angle by up to 2^-9
    relative, and a truth upcast from such a model shares those angles with transformers' bf16
    run: at Llama-3's rope theta that alone is a 1.7e-2 logits error (as large as bf16's own),
    counted against any engine that rotates by the exact frequencies."""
    import transformers

    cls = getattr(transformers, family.case.hf_class)
    return cls.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


def _keep_fp32(hf: torch.nn.Module) -> None:
    """Buffers transformers keeps in fp32 when loading a bf16 checkpoint (DeepSeek-V3's
    correction bias) go back to fp32, as a real checkpoint stores them."""
    keep = getattr(hf, "_keep_in_fp32_modules_strict", None) or []
    for module in hf.modules():
        for name, buf in module._buffers.items():
            if buf is not None and name in keep:
                module._buffers[name] = buf.float()


def run_ours(path: Path, prompt: list[int], device: str, dtype: str) -> Ours:
    engine = Engine(EngineConfig(model=str(path), device=device, dtype=dtype, max_num_seqs=2,
                                 max_model_len=256, kvcache_mem_mib=256, quantization=None))
    try:
        with capture_routing(engine.runner.model) as routing:
            logits = engine.prompt_logits(prompt)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=0)
        engine.add_request("greedy", prompt, params)
        tokens: list[int] = []
        logprobs: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                logprobs.extend(lp.logprob for lp in out.logprobs or [])
        return Ours(logits, tokens, logprobs, engine.runner.graphs is not None, routing)
    finally:
        engine.shutdown()


def compare(ref: Reference, ours: Ours) -> dict[str, Any]:
    prompt_len = ref.bf16_logits.shape[0]
    equal = 0
    while equal < NEW_TOKENS and ours.tokens[equal] == ref.tokens[equal]:
        equal += 1
    dec_err, gap = 0.0, 0.0
    for i in range(min(equal + 1, NEW_TOKENS)):  # steps with the same prefix on both sides
        row = ref.truth[prompt_len - 1 + i]
        std = float(row.std())
        want = float(torch.log_softmax(row, -1)[ours.tokens[i]])
        if i < len(ours.logprobs):
            dec_err = max(dec_err, abs(ours.logprobs[i] - want) / std)
        if i == equal:
            gap = abs(float(row[ref.tokens[i]] - row[ours.tokens[i]])) / std
    err_bf16 = rel_error(ours.logits, ref.bf16_logits)
    err_fp32 = rel_error(ours.logits, ref.truth[:prompt_len])
    res: dict[str, Any] = dict(
        err_bf16=err_bf16, err_fp32=err_fp32,
        hf_bf16_vs_fp32=rel_error(ref.bf16_logits, ref.truth[:prompt_len]),
        tokens_equal=equal, decode_err=dec_err, tie_gap=gap, cuda_graphs=ours.graphs,
        tokens=ours.tokens, hf_tokens=ref.tokens, logprobs_returned=len(ours.logprobs))
    res["x_hf"] = err_fp32 / max(res["hf_bf16_vs_fp32"], 1e-12)  # our bf16 error / transformers'
    decode_ok = dec_err < DECODE_TOL and gap < DECODE_TOL and len(ours.logprobs) == NEW_TOKENS
    logits_ok = err_bf16 < LOGITS_TOL and err_fp32 < LOGITS_TOL
    res["plain"] = bool(logits_ok and decode_ok)  # the dense rule, reported for every family
    res["rule"] = "moe" if ref.routing_truth else "dense"
    if ref.routing_truth:
        routing = routing_report(ref, ours)
        verdict = moe_verdict(routing.ours, routing.hf, err_fp32, res["hf_bf16_vs_fp32"])
        res["routing"] = routing.report
        res["moe_rule"] = dict(verdict._asdict(), ok=verdict.ok)
        logits_ok = verdict.ok
    res["ok"] = bool(logits_ok and decode_ok)
    return res


class Routing(NamedTuple):
    ours: TokenSplit  # our prompt logits against the truth, split by our routing
    hf: TokenSplit  # transformers' bf16 against the truth, split by its routing
    report: dict[str, Any]  # for the JSON


def routing_report(ref: Reference, ours: Ours) -> Routing:
    """Routing flips against the truth (transformers' bf16, ours) and between the bf16 runs, each
    run's error against the truth over its tokens routed as the truth does / its flipped tokens,
    and all three pairs over the tokens both runs route as the truth does. A flip also reaches
    later tokens a little through attention; those tokens still count as routed."""
    n = ref.bf16_logits.shape[0]
    truth = ref.truth[:n]
    our = split_by_routing(ours.logits, truth, ours.routing, ref.routing_truth)
    hf = split_by_routing(ref.bf16_logits, truth, ref.routing_bf16, ref.routing_truth)
    both = sorted(set(range(n)) - set(hf.flipped) - set(our.flipped))
    return Routing(our, hf, dict(
        ours_vs_truth=_split(our), hf_bf16_vs_truth=_split(hf),
        ours_vs_hf_bf16=routing_flips(ours.routing, ref.routing_bf16, n),
        both_routed_tokens=len(both),
        err_fp32_both_routed=rows_error(ours.logits, truth, both),
        hf_bf16_vs_fp32_both_routed=rows_error(ref.bf16_logits, truth, both),
        err_bf16_both_routed=rows_error(ours.logits, ref.bf16_logits, both)))


def _split(split: TokenSplit) -> dict[str, Any]:
    return dict(tokens=split.flips, per_layer=split.per_layer, flipped=split.flipped,
                err_routed=split.err_routed, err_flipped=split.err_flipped)


def run_family(name: str, smoke: bool, device: str, seed: int = 0,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    family = FAMILIES[name]
    dtype = torch.float32 if smoke else dtype
    vocab = config_dict(family, smoke).get("vocab_size") or config_dict(
        family, smoke)["text_config"]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, vocab, (PROMPT_LEN,), generator=gen).tolist()
    path = Path(tempfile.mkdtemp(prefix=f"parity-{name}-", dir=_scratch_dir(device)))
    start = time.perf_counter()
    try:
        ref = build_reference(family, smoke, path, prompt, device, dtype, seed)
        _free()
        ours = run_ours(path, prompt, device, str(dtype).removeprefix("torch."))
        return dict(compare(ref, ours), seconds=time.perf_counter() - start)
    finally:
        shutil.rmtree(path, ignore_errors=True)
        _free()


def _scratch_dir(device: str) -> str | None:
    """/dev/shm when it has room for a checkpoint (the largest is ~6 GB), else the default. Not
    on CPU: /dev/shm is memory, which the CPU run needs for the models themselves."""
    if device == "cpu":
        return None
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 16 << 30 else None
    except OSError:
        return None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif sys.platform == "linux":  # give freed model memory back before the next one loads
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _row(name: str, res: dict[str, Any]) -> str:
    note = FAMILIES[name].note
    if "error" in res:
        return f"{name:12s} {note[:44]:44s} ERROR {res['error'][:60]}"
    return (f"{name:12s} {note[:44]:44s} {res['err_bf16']:8.2e} {res['err_fp32']:8.2e} "
            f"{res['hf_bf16_vs_fp32']:8.2e} {min(res['x_hf'], 99):5.2f} "
            f"{res['tokens_equal']:>2d}/{NEW_TOKENS} "
            f"{res['decode_err']:6.3f} {res['tie_gap']:6.3f} "
            f"{'PASS' if res['ok'] else 'FAIL':4s} {res['seconds']:5.1f}s"
            f"{_moe(res)}")


def _moe(res: dict[str, Any]) -> str:
    """MoE: flips (transformers / ours, allowed), our error over routed / flipped tokens, and
    which MoE condition failed; `plain` says whether the dense rule alone would pass."""
    if "moe_rule" not in res:
        return ""
    routing, rule = res["routing"], res["moe_rule"]
    ours = routing["ours_vs_truth"]
    failed = [k for k in MoeVerdict._fields if k != "flip_allowance" and not rule[k]]
    return (f"  flips {routing['hf_bf16_vs_truth']['tokens']}/{ours['tokens']} "
            f"(<={rule['flip_allowance']}) routed {_e(ours['err_routed'])} flipped "
            f"{_e(ours['err_flipped'])} plain {'PASS' if res['plain'] else 'FAIL'}"
            f"{' moe failed: ' + ','.join(failed) if failed else ''}")


def _e(err: float | None) -> str:
    return "-" if err is None else f"{err:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families")
    ap.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny sizes (script check)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: real sizes in bf16 through the torch reference kernels")
    ap.add_argument("--seed", type=int, default=0, help="weights' seed (another model instance)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="float32: reference and truth coincide; a check of routing and model code")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/family_parity.json")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    import transformers

    device = "cpu" if args.smoke else args.device
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none (CPU)"
    kernels = ("Triton" if device == "cuda" else
               "torch references (CPU: checks model code and references, not Triton kernels)")
    head: dict[str, Any] = dict(gpu=gpu, device=device, kernels=kernels, seed=args.seed,
                                torch=torch.__version__,
                                transformers=transformers.__version__, smoke=args.smoke,
                                dtype="float32" if args.smoke else args.dtype,
                                reductions=REDUCTIONS, prompt_len=PROMPT_LEN,
                                new_tokens=NEW_TOKENS, logits_tol=LOGITS_TOL,
                                decode_tol=DECODE_TOL, moe_rule=dict(
                                    routed_tol=LOGITS_TOL, flip_slack=FLIP_SLACK,
                                    flip_slack_fraction=FLIP_SLACK_FRACTION, x_hf=X_HF))
    print(f"GPU {gpu}, {head['dtype']}, seed {args.seed}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}"
          f"{', SMOKE (CPU fp32 tiny)' if args.smoke else ''}\nreductions: {REDUCTIONS}\n"
          f"engine kernels: {kernels}")
    print(f"{'family':12s} {'shape':44s} {'vs bf16':>8s} {'vs fp32':>8s} {'hf':>8s} {'x hf':>5s} "
          f"{'eq':>4s} {'dec':>6s} {'gap':>6s} {'':4s} {'time':>6s}  MoE: flips hf/ours "
          "(allowed), ours over routed / flipped tokens, dense rule", flush=True)
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_family(name, args.smoke, device, args.seed,
                                       getattr(torch, args.dtype))
        except Exception as exc:  # noqa: BLE001 - one family's failure must not stop the rest
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
            _free()
        results[name]["note"] = FAMILIES[name].note
        print(_row(name, results[name]), flush=True)
    passed = sum(bool(r["ok"]) for r in results.values())
    plain = sum(bool(r.get("plain")) for r in results.values())
    print(f"{passed}/{len(results)} families pass ({plain} by the plain 2e-2 rule alone)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(head, results=results), indent=2))
    sys.exit(0 if passed == len(results) else 1)


if __name__ == "__main__":
    main()
