"""flotilla's CPU engine against llama.cpp (llama-cpp-python) on the same GGUF with the same
thread count, in lock-step rounds: each side runs in its own process (its own thread pool) and
the two take turns case by case, so background load on a shared machine hits both alike.

    python bench/cpu_vs_llamacpp.py [--threads 2] [--rounds 5] [--tokens 64]
                                    [--only decode,prefill,batch8,perplexity] [--json PATH]

decode: one sequence, a 16-token prompt, `--tokens` greedy tokens; tok/s of the decode steps.
prefill: a 512-token prompt (new tokens each round: no prefix cache) to its first token; tok/s.
batch8: 8 sequences (16-token prompts) decoding `--tokens` tokens each; generated tok/s over the
whole run. perplexity: the fixed text (tests/quant/fixed_text.py) token by token through each
side's decode step (flotilla's CPU decode path, llama.cpp's batch-1 decode).
flotilla: Engine.step() with the server's defaults (quantization auto: int4 for Q4_1), greedy
sampling included. llama.cpp: llama_decode through the low-level API (argmax of the logits in
numpy), default context (flash attention auto). Prints per-case medians over the rounds, the
ratio flotilla / llama.cpp, the date, CPU, threads and the load average around the run.
Needs `pip install llama-cpp-python` (compiles llama.cpp from source).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_LEN, PREFILL_LEN, BATCH = 16, 512, 8


def _prompt(seed: int, n: int) -> list[int]:
    return [1] + [(seed * 7919 + i * 104729) % 40000 + 200 for i in range(n - 1)]


class Flotilla:
    def __init__(self, threads: int) -> None:
        import torch

        from flotilla.services.engine.engine import Engine, EngineConfig

        torch.set_num_threads(threads)
        self.engine = Engine(
            EngineConfig(model="default", device="cpu", quantization="auto", kvcache_mem_mib=512)
        )
        self.name = "flotilla"

    def _run(self, prompts: list[list[int]], tokens: int) -> list[float]:
        from flotilla.services.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
        stamps = [time.perf_counter()]
        while self.engine.has_unfinished():
            if self.engine.step():
                stamps.append(time.perf_counter())
        return stamps

    def decode(self, seed: int, tokens: int) -> float:
        stamps = self._run([_prompt(seed, PROMPT_LEN)], tokens)[1:]  # from the first token
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def prefill(self, seed: int) -> float:
        stamps = self._run([_prompt(seed, PREFILL_LEN)], 1)
        return PREFILL_LEN / (stamps[1] - stamps[0])

    def batch8(self, seed: int, tokens: int) -> float:
        stamps = self._run([_prompt(seed + i, PROMPT_LEN) for i in range(BATCH)], tokens)
        return BATCH * tokens / (stamps[-1] - stamps[0])

    def perplexity(self, ids: list[int]) -> float:
        import torch

        from flotilla.services.engine.forward_context import forward_context
        from tests.engine.conftest import SingleSequenceRunner

        runner = self.engine.runner
        fast = runner.cpu_decode
        assert fast is not None, "the CPU decode path does not cover the default model"
        seq = SingleSequenceRunner(runner.model, max_tokens=len(ids) + 16)
        nll = 0.0
        with torch.inference_mode():
            for pos in range(len(ids) - 1):
                meta = seq.metadata(pos, 1)
                with forward_context(meta):
                    logits = fast.logits(
                        torch.tensor(ids[pos : pos + 1]), torch.tensor([pos]), meta
                    )
                nll -= float(torch.log_softmax(logits[0].double(), -1)[ids[pos + 1]])
        for attn in runner.attention:  # give the engine its own caches back
            attn.bind_kv_cache(*self._caches[id(attn)])
        return math.exp(nll / (len(ids) - 1))

    def keep_caches(self) -> None:
        self._caches = {id(a): (a.k_cache, a.v_cache) for a in self.engine.runner.attention}


class LlamaCpp:
    def __init__(self, threads: int) -> None:
        import llama_cpp as lib

        from flotilla.libs.common.model_cache import ensure_default_model

        self.lib, self.name = lib, "llama.cpp"
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(ensure_default_model()).encode(), mparams)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = 8192, 512, 512
        cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = BATCH, threads, threads
        cparams.kv_unified = True
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(PREFILL_LEN, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _logits(self, i: int) -> Any:
        import numpy as np

        return np.ctypeslib.as_array(
            self.lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)
        )

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _generate(self, prompts: list[list[int]], tokens: int) -> list[float]:
        self._clear()
        entries = [
            (t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)
        ]
        stamps = [time.perf_counter()]
        self._decode(entries)
        ends = [sum(len(p) for p in prompts[: s + 1]) - 1 for s in range(len(prompts))]
        last = [int(self._logits(i).argmax()) for i in ends]  # batch index of each last token
        stamps.append(time.perf_counter())
        for step in range(1, tokens):
            self._decode(
                [
                    (t, len(pr) + step - 1, s, True)
                    for s, (t, pr) in enumerate(zip(last, prompts, strict=True))
                ]
            )
            last = [int(self._logits(i).argmax()) for i in range(len(prompts))]
            stamps.append(time.perf_counter())
        return stamps

    def decode(self, seed: int, tokens: int) -> float:
        stamps = self._generate([_prompt(seed, PROMPT_LEN)], tokens)[1:]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def prefill(self, seed: int) -> float:
        stamps = self._generate([_prompt(seed, PREFILL_LEN)], 1)
        return PREFILL_LEN / (stamps[1] - stamps[0])

    def batch8(self, seed: int, tokens: int) -> float:
        stamps = self._generate([_prompt(seed + i, PROMPT_LEN) for i in range(BATCH)], tokens)
        return BATCH * tokens / (stamps[-1] - stamps[0])

    def perplexity(self, ids: list[int]) -> float:
        import numpy as np

        self._clear()
        nll = 0.0
        for pos in range(len(ids) - 1):
            self._decode([(ids[pos], pos, 0, True)])
            logits = self._logits(0).astype(np.float64)
            top = logits.max()
            nll -= logits[ids[pos + 1]] - top - math.log(np.exp(logits - top).sum())
        return math.exp(nll / (len(ids) - 1))

    def keep_caches(self) -> None:
        pass


def _worker(side: str, threads: int, conn: Connection) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    runner = Flotilla(threads) if side == "flotilla" else LlamaCpp(threads)
    runner.keep_caches()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        case, args = msg
        conn.send(getattr(runner, case)(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--only", default="decode,prefill,batch8,perplexity")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = args.only.split(",")
    ctx = mp.get_context("spawn")
    sides = {}
    for side in ("flotilla", "llama.cpp"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(side, args.threads, child), daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        sides[side] = parent
    load_before = os.getloadavg()
    results: dict[str, dict[str, list[float]]] = {c: {s: [] for s in sides} for c in cases}
    ids: list[int] = []
    if "perplexity" in cases:
        from flotilla.libs.common.model_cache import ensure_default_model
        from flotilla.services.tokenizer.tokenizer import Tokenizer
        from tests.quant.fixed_text import TEXT

        ids = Tokenizer.from_path(ensure_default_model()).encode(TEXT)
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]  # alternate who goes first
        for case in cases:
            if case == "perplexity" and r:
                continue  # deterministic: one round
            call = {
                "decode": (r, args.tokens),
                "prefill": (1000 + r,),
                "batch8": (2000 + 10 * r, args.tokens),
                "perplexity": (ids,),
            }[case]
            for side in order:
                sides[side].send((case, call))
                results[case][side].append(sides[side].recv())
        print(
            f"round {r + 1}/{args.rounds}: "
            + "  ".join(
                f"{c} {results[c]['flotilla'][-1]:.1f}/{results[c]['llama.cpp'][-1]:.1f}"
                for c in cases
                if c != "perplexity" or not r
            ),
            flush=True,
        )
    for conn in sides.values():
        conn.send(None)
    load_after = os.getloadavg()
    print(
        f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_cpu()}, "
        f"{args.threads} threads, {args.rounds} lock-step rounds, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after"
    )
    print(f"{'case':<12}{'flotilla':>12}{'llama.cpp':>12}{'ratio':>8}   unit")
    units = {
        "decode": "tok/s",
        "prefill": "prompt tok/s",
        "batch8": "tok/s (8 seqs)",
        "perplexity": "perplexity (lower is better)",
    }
    summary = {}
    for case in cases:
        ours, theirs = (statistics.median(results[case][s]) for s in sides)
        summary[case] = {
            "flotilla": ours,
            "llama.cpp": theirs,
            "ratio": ours / theirs,
            "rounds": results[case],
        }
        print(f"{case:<12}{ours:>12.2f}{theirs:>12.2f}{ours / theirs:>7.2f}x   {units[case]}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "cpu": _cpu(),
                    "threads": args.threads,
                    "load": [load_before, load_after],
                    "results": summary,
                },
                indent=1,
            )
        )


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return platform.processor()


if __name__ == "__main__":
    main()
