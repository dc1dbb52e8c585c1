"""The engine's host-side work per step, on CPU, with the model forward made negligible.

The ModelRunner's forward is replaced by a preallocated zero-logits tensor (vocab 1024), so what
a step costs here is the host's own work: scheduling (prefix hashes, block allocation), input
building, sampling-batch preparation, launching and postprocessing. Async scheduling is on, as on
CUDA. On CPU the host-to-device copies are no-ops and no CUDA graph is replayed; those GPU-only
costs are not in these numbers.

    python bench/host_overhead.py [--repeats N] [--decode-steps N] [--profile]

(a) B4: one 4,096-token prompt, add_request through its first token (prefill + postprocess).
(b) B3: 256 requests x 128 prompt tokens, max_tokens = decode steps + 1: the prefill steps and
    the decode steps at batch 256.
Prints per phase the median over repeats (ms); `--profile` adds cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flotilla.services.engine import model_runner as mr  # noqa: E402
from flotilla.services.engine.engine import Engine, EngineConfig  # noqa: E402
from flotilla.services.engine.sampling_params import SamplingParams  # noqa: E402
from flotilla.services.engine.step_output import LaunchedStep  # noqa: E402

VOCAB = 1024
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32", "hidden_act": "silu",
}
# Phases that are device work on a GPU (here: CPU tensor ops), left out of the host total.
DEVICE_PHASES = ("forward", "sample")


class Timers:
    """Accumulated seconds per phase since the last `reset`."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        # CUDA only: (host time, event) before each forward and after each sampler call
        self.marks: list[tuple[float, Any]] = []

    def reset(self) -> dict[str, float]:
        acc, self.acc = dict(self.acc), defaultdict(float)
        return acc

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.acc[name] += time.perf_counter() - t

        return timed


def make_engine(args: argparse.Namespace) -> Engine:
    d = Path(tempfile.mkdtemp(prefix="host-overhead-"))
    if args.device == "cpu":
        (d / "config.json").write_text(json.dumps(TINY_LLAMA))
        return Engine(EngineConfig(model=str(d), load_format="dummy", device="cpu",
                                   dtype="float32", block_size=16, num_kv_blocks=4096,
                                   max_num_seqs=256, max_num_batched_tokens=8192,
                                   async_scheduling=True))
    from bench.engine_bench import LLAMA3_8B

    (d / "config.json").write_text(json.dumps(dict(LLAMA3_8B, num_hidden_layers=args.layers)))
    return Engine(EngineConfig(model=str(d), load_format="dummy", device="cuda",
                               dtype="bfloat16", block_size=16, kvcache_mem_mib=8192,
                               max_num_seqs=256, max_num_batched_tokens=8192,
                               enforce_eager=args.enforce_eager, async_scheduling=True))


@contextmanager
def instrumented(engine: Engine, timers: Timers, kv_detail: bool) -> Iterator[None]:
    """Time the engine's phases; the forward returns zero logits at once. kv_detail: also the
    per-request prefix lookup and allocation (their wrappers cost ~0.1 ms a step at 256)."""
    runner = engine.runner
    logits = torch.zeros(runner.max_num_seqs, VOCAB)

    def fake_logits(input_ids: torch.Tensor, inputs: Any, decode_only: bool) -> torch.Tensor:
        return logits[: int(inputs.logits_rows.shape[0])]

    forward: Callable[..., Any] = fake_logits
    sampler: Callable[..., Any] = runner.sampler
    if runner.device.type == "cuda":  # the real model; events around each step's device work
        real_forward, real_sampler = runner._logits, runner.sampler

        def forward_marked(*a: Any) -> torch.Tensor:
            timers.marks.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
            timers.marks[-1][1].record()
            return real_forward(*a)

        def sampler_marked(*a: Any) -> Any:
            out = real_sampler(*a)
            timers.marks.append((time.perf_counter(), torch.cuda.Event(enable_timing=True)))
            timers.marks[-1][1].record()
            return out

        forward, sampler = forward_marked, sampler_marked

    patches: list[tuple[Any, str, Any]] = [
        (engine, "add_request", timers.wrap("add_request", engine.add_request)),
        (engine, "_postprocess", timers.wrap("postprocess", engine._postprocess)),
        (engine, "_add_placeholders", timers.wrap("placeholders", engine._add_placeholders)),
        (engine.scheduler, "schedule", timers.wrap("schedule", engine.scheduler.schedule)),
        (runner.inputs, "build", timers.wrap("build inputs", runner.inputs.build)),
        (runner, "_input_ids", timers.wrap("input ids", runner._input_ids)),
        (runner, "_logits", timers.wrap("forward", forward)),
        (runner, "sampler", timers.wrap("sample", sampler)),
        (mr.SamplingBatch, "build",
         staticmethod(timers.wrap("sampling batch", mr.SamplingBatch.build))),
        (mr.LaunchedStep, "start",
         staticmethod(timers.wrap("launched step", LaunchedStep.start))),
    ]
    if kv_detail:
        patches += [
            (engine.kv, "get_computed_blocks",
             timers.wrap("  prefix lookup", engine.kv.get_computed_blocks)),
            (engine.kv, "allocate_slots", timers.wrap("  allocate", engine.kv.allocate_slots)),
        ]
    saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in saved:
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def rand_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n, length), generator=g).tolist()


def timed_step(engine: Engine, timers: Timers, rows: list[dict[str, float]]) -> list[Any]:
    t = time.perf_counter()
    outs = engine.step()
    rec = timers.reset()
    rec["step"] = time.perf_counter() - t
    rows.append(rec)
    return outs


def b4(engine: Engine, timers: Timers, seed: int) -> dict[str, float]:
    """add_request + steps until the first token of one 4,096-token prompt."""
    engine.reset_prefix_cache()
    (prompt,) = rand_prompts(1, 4096, seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timers.reset()
    timers.marks.clear()
    t = time.perf_counter()
    engine.add_request(f"b4-{seed}", prompt, params)
    steps: list[dict[str, float]] = [timers.reset()]
    while engine.has_unfinished():
        timed_step(engine, timers, steps)
    total = time.perf_counter() - t
    rec: dict[str, float] = defaultdict(float)
    for s in steps:
        for k, v in s.items():
            rec[k] += v
    rec["step"] = total
    if timers.marks:  # CUDA: the device span of the step and the host time around it
        (t0, first), (t1, last) = timers.marks[0], timers.marks[-1]
        last.synchronize()
        rec["to forward (host)"] = t0 - t
        rec["forward+sample launch (host)"] = t1 - t0
        rec["device span"] = first.elapsed_time(last) / 1e3
        rec["wall - device span"] = total - rec["device span"]
    return rec


def b3(engine: Engine, timers: Timers, seed: int, decode_steps: int
       ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Per-step records of the prefill steps and of the decode steps at batch 256."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i, p in enumerate(rand_prompts(256, 128, seed)):
        engine.add_request(f"b3-{seed}-{i}", p, params)
    timers.reset()
    prefill: list[dict[str, float]] = []
    decode: list[dict[str, float]] = []
    while engine.has_unfinished():
        waiting = bool(engine.scheduler.waiting) or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running)
        batch = len(engine.scheduler.running)
        rows: list[dict[str, float]] = []
        timed_step(engine, timers, rows)
        if waiting:
            prefill.extend(rows)
        elif batch == 256 and engine.scheduler.running:
            decode.extend(rows)
    return prefill, decode


def host_ms(rec: dict[str, float]) -> float:
    return (rec["step"] - sum(rec.get(k, 0.0) for k in DEVICE_PHASES)) * 1e3


def medians(records: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in records for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in records) * 1e3 for k in keys}


PHASE_ORDER = ("add_request", "schedule", "  prefix lookup", "  allocate", "build inputs",
               "input ids", "forward", "sampling batch", "sample", "launched step",
               "placeholders", "postprocess", "step", "to forward (host)",
               "forward+sample launch (host)", "device span", "wall - device span")


def table(columns: dict[str, list[dict[str, float]]], cuda: bool) -> str:
    """On CUDA the forward / sample rows are their host launch times, and postprocess includes
    the wait for the device, so no host total is printed."""
    columns = {name: recs for name, recs in columns.items() if recs}
    meds = {name: medians(recs) for name, recs in columns.items()}
    head = f"{'phase (median ms)':<30}" + "".join(f"{n:>16}" for n in columns)
    lines = [head, "-" * len(head)]
    for phase in PHASE_ORDER:
        if not any(phase in m for m in meds.values()):
            continue
        label = phase + ((" (launch)" if cuda else " (device)") if phase in DEVICE_PHASES else "")
        lines.append(f"{label:<30}" + "".join(f"{m.get(phase, 0.0):>16.3f}"
                                              for m in meds.values()))
    if not cuda:
        lines.append(f"{'host total':<30}" + "".join(
            f"{statistics.median(host_ms(r) for r in recs):>16.3f}" for recs in columns.values()))
    lines.append(f"{'samples':<30}" + "".join(f"{len(recs):>16d}" for recs in columns.values()))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions too")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the real Llama-3-8B-shaped model (dummy weights), with events")
    ap.add_argument("--layers", type=int, default=32, help="cuda: decoder layers")
    ap.add_argument("--enforce-eager", action="store_true", help="cuda: no decode graphs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    engine = make_engine(args)
    timers = Timers()
    with instrumented(engine, timers, kv_detail=True):
        b4(engine, timers, 0)  # warm-up
        a = [b4(engine, timers, 100 + i) for i in range(args.repeats)]
    with instrumented(engine, timers, kv_detail=False):
        b3(engine, timers, 0, 2)
        prefill, decode = [], []
        for i in range(max(1, args.repeats // 5)):
            p, d = b3(engine, timers, 200 + i, args.decode_steps)
            prefill += p
            decode += d
        if args.profile:
            profile(engine, timers, args.decode_steps, args.top)
    print(table({"(a) B4 4096": a, "(b) B3 prefill": prefill, "(b) B3 decode": decode},
                args.device == "cuda"))


def profile(engine: Engine, timers: Timers, decode_steps: int, top: int) -> None:
    """cProfile of five (a) runs and one (b) run (the phase wrappers show up as `timed`)."""
    for name, fn in (("(a) B4", lambda: [b4(engine, timers, 300 + i) for i in range(5)]),
                     ("(b) B3", lambda: b3(engine, timers, 400, decode_steps))):
        prof = cProfile.Profile()
        prof.runcall(fn)
        print(f"\ncProfile {name}, top {top} by own time")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
