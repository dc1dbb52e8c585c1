"""The library API against the server's engine: batch-1 greedy decode speed of `LLM()` and of
the engine as the engine service runs it, on the same machine (issue 21: within 10%).

    python bench/library_decode.py [--model default] [--tokens 128] [--rounds 3] [--device cpu]
                                   [--threads N]

library: `LLM(model)` with its defaults (services/engine/llm.py: the server's EngineConfig),
warmed up with `generate`, timed through `stream` (steps on the event loop's thread, the one
that built the engine).
server: `build_engine(EngineSettings)` built and stepped on one worker thread by the service's
`EngineLoop.for_service` (services/engine/service.py does exactly this), outputs timed as the
service's event loop receives them.

Each side runs in a fresh process (two engines in one process would share cores with two
OpenMP pools), alternating for `--rounds` rounds; a round prints tokens/s of the decode steps
(the prefill left out). The summary is each side's best round and the library's ratio to the
server (1.00 = as fast; a shared machine is noisy, so read the best rounds). `--threads` sets
`num_threads` on both sides (default: unset, the server's default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]


def _rate(stamps: list[float]) -> float:
    """Tokens per second from the first token's stamp on (decode steps only)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


async def _library(model: str, tokens: int, device: str, threads: int | None) -> float:
    from flotilla.services.engine.llm import LLM
    from flotilla.services.engine.sampling_params import SamplingParams

    llm = LLM(model, device=device, num_threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    stamps = []
    async for out in llm.stream(PROMPT, params):
        if out.new_token_ids:
            stamps.append(time.perf_counter())
    return _rate(stamps)


async def _server(model: str, tokens: int, device: str, threads: int | None) -> float:
    from flotilla.libs.common.model_cache import resolve_model
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.factory import build_engine
    from flotilla.services.engine.loop import EngineLoop
    from flotilla.services.engine.sampling_params import SamplingParams

    settings = EngineSettings.model_construct(model=model, device=device, num_threads=threads)
    path = resolve_model(model)
    thread = ThreadPoolExecutor(1, thread_name_prefix="engine-loop")
    loop = asyncio.get_running_loop()
    engine = await loop.run_in_executor(thread, build_engine, settings, path)
    stamps: dict[str, list[float]] = {"warm-up": [], "decode": []}
    done: dict[str, asyncio.Event] = {"warm-up": asyncio.Event(), "decode": asyncio.Event()}

    def on_outputs(outputs: list) -> None:  # type: ignore[type-arg]
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                stamps[out.request_id].append(now)
            if out.finished:
                done[out.request_id].set()

    def on_crash(exc: BaseException) -> None:
        raise SystemExit(f"engine crashed: {exc!r}")

    engine_loop = EngineLoop.for_service(
        engine, loop, on_outputs, on_crash, settings, executor=thread
    )
    engine_loop.start()
    engine_loop.add("warm-up", PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    await done["warm-up"].wait()
    engine_loop.add(
        "decode", PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    )
    await done["decode"].wait()
    engine_loop.stop()
    return _rate(stamps["decode"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--side", choices=["library", "server"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side is not None:  # one measurement in this (fresh) process
        run = _library if args.side == "library" else _server
        print(json.dumps(asyncio.run(run(args.model, args.tokens, args.device, args.threads))))
        return
    best = {"library": 0.0, "server": 0.0}
    for r in range(args.rounds):
        for side in ("server", "library"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--side",
                    side,
                    "--model",
                    args.model,
                    "--tokens",
                    str(args.tokens),
                    "--device",
                    args.device,
                    *(["--threads", str(args.threads)] if args.threads else []),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rate = float(out.stdout.strip().splitlines()[-1])
            best[side] = max(best[side], rate)
            print(f"round {r + 1}: {side:7s} {rate:7.1f} tok/s", flush=True)
    print(
        f"best: library {best['library']:.1f} tok/s, server {best['server']:.1f} tok/s; "
        f"library / server = {best['library'] / best['server']:.2f}"
    )


if __name__ == "__main__":
    main()
