"""`flotilla up` against llama.cpp's `llama-server` on the CPU: the same GGUF (the default model),
the same thread count, pinned to the same cores, one HTTP client, in lock-step rounds (issue 26,
the server level of bench/cpu_vs_llamacpp.py).

    python bench/cpu_server_vs_llamacpp.py [--threads 2] [--cores 0,1] [--streams 1,8,32]
                                           [--rounds 3] [--tokens 64] [--slots 32] [--json PATH]

llama-server is built CPU-only from the llama-cpp-python sdist's sources (bench/llamacpp_build.py,
cached in build/llamacpp-cpu) and started as `llama-server -m GGUF -t T -tb T -np SLOTS -c
SLOTS*512`; flotilla as `flotilla up` with FLOTILLA_NUM_THREADS=T (OMP_NUM_THREADS=T). Both are
started under `taskset -c CORES` (every flotilla process, NATS included, and every llama-server
thread share those cores). Each round runs every stream count on each server in turn (who goes
first alternates), so background load hits both alike. One httpx client streams chat
completions (/v1/chat/completions, stream: true) with distinct prompts; every stream makes
exactly --tokens tokens (flotilla: min_tokens, llama-server: ignore_eos). Measured:
1 stream: decode tok/s, (tokens - 1) / (last token - first token);
N streams: aggregate tok/s, N * tokens / (last stream's end - first request), and TTFT (median
over the streams). Prints medians over the rounds, the ratios flotilla / llama-server, the date,
CPU, threads, cores and the load average around the run (this benchmark is only as quiet as the
machine: read the load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_build  # noqa: E402
from bench.cpu_vs_llamacpp import _cpu  # noqa: E402
from bench.sse_client import stream_chat  # noqa: E402

TOPICS = ("a lighthouse", "the sea", "a clockmaker", "winter", "a garden", "a train", "bees",
          "the moon")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pin(cores: str | None) -> list[str]:
    return ["taskset", "-c", cores] if cores else []


def start_flotilla(threads: int, cores: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    state = Path(tempfile.mkdtemp(prefix="flotilla-srv-")) / "state.json"
    env = {k: v for k, v in os.environ.items() if k != "FLOTILLA_NATS_URL"}
    env.update(FLOTILLA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    cmd = [*_pin(cores), sys.executable, "-m", "flotilla.services.launcher", "up", "--port", "0",
           "--model", "default", "--state-file", str(state)]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            cwd=llamacpp_build.ROOT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flotilla up exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if "flotilla is serving" in log.read_text(errors="replace"):
            return proc, json.loads(state.read_text())["gateway_url"].removesuffix("/v1")
        time.sleep(0.5)
    raise RuntimeError("flotilla up did not start in 600 s")


def start_llama_server(binary: Path, gguf: Path, threads: int, cores: str | None, slots: int,
                       log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [*_pin(cores), str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(slots * 512), "--host", "127.0.0.1", "--port", str(port)]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy in 300 s")


def _body(side: str, model: str, tokens: int, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": tokens, "temperature": 0.0,
                            "messages": [{"role": "user", "content": prompt}]}
    if side == "flotilla":
        body["min_tokens"] = tokens
    else:
        body["ignore_eos"] = True
    return body


async def level(client: httpx.AsyncClient, side: str, url: str, model: str, streams: int,
                tokens: int, tag: str) -> dict[str, Any]:
    client.base_url = httpx.URL(url)  # stream_chat posts to a relative path
    prompts = [f"Request {tag}-{i}: write a long story about {TOPICS[i % len(TOPICS)]}, "
               f"number {i}." for i in range(streams)]
    t0 = time.monotonic()
    outs = await asyncio.gather(*(stream_chat(client, _body(side, model, tokens, p), 120.0)
                                  for p in prompts))
    bad = [o for o in outs if o.kind != "finished" or not o.token_times]
    if bad:
        raise RuntimeError(f"{side}: {len(bad)} of {streams} streams failed: {bad[0].kind} "
                           f"{bad[0].status} {bad[0].detail[:300]}")
    end = max(o.ended for o in outs)
    res = {"aggregate_tok_s": streams * tokens / (end - t0),
           "ttft_s": statistics.median(o.ttft or 0.0 for o in outs),
           "events": statistics.median(len(o.token_times) for o in outs)}
    if streams == 1:
        times = outs[0].token_times
        res["decode_tok_s"] = (tokens - 1) / (times[-1] - times[0])
    return res


async def rounds(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: dict[str, Any] = {str(n): {s: [] for s in urls} for n in args.streams}
    async with httpx.AsyncClient(limits=limits) as client:
        models = {}
        for side, url in urls.items():
            listed = (await client.get(f"{url}/v1/models")).json()["data"]
            models[side] = listed[0]["id"]
        for side in urls:  # warm-up: one stream and one burst each
            for n in (1, max(args.streams)):
                await level(client, side, urls[side], models[side], n, 8, f"w{side}{n}")
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            line = []
            for n in args.streams:
                for side in order:
                    out = await level(client, side, urls[side], models[side], n, args.tokens,
                                      f"{r}")
                    results[str(n)][side].append(out)
                a, b = (results[str(n)][s][-1] for s in urls)
                key = "decode_tok_s" if n == 1 else "aggregate_tok_s"
                line.append(f"{n}: {a[key]:.1f}/{b[key]:.1f} tok/s ttft "
                            f"{a['ttft_s'] * 1e3:.0f}/{b['ttft_s'] * 1e3:.0f} ms")
            print(f"round {r + 1}/{args.rounds} (flotilla/llama-server)  " + "  ".join(line),
                  flush=True)
    return results


def report(results: dict[str, Any], args: argparse.Namespace, load: list[Any]) -> dict:
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {_cpu()}, {args.threads} "
          f"threads, cores {args.cores or 'all'}, {args.rounds} lock-step rounds, {args.tokens} "
          f"tokens a stream, llama-server -np {args.slots}, load average {load[0][0]:.1f} "
          f"before / {load[1][0]:.1f} after")
    print(f"{'streams':<9}{'metric':<16}{'flotilla':>10}{'llama-srv':>11}{'ratio':>8}")
    summary: dict[str, Any] = {}
    for n, sides in results.items():
        metrics = ("decode_tok_s", "ttft_s") if n == "1" else ("aggregate_tok_s", "ttft_s")
        for m in metrics:
            a, b = (statistics.median(r[m] for r in sides[s]) for s in ("flotilla", "llama"))
            summary[f"{n}/{m}"] = {"flotilla": a, "llama-server": b, "ratio": a / b}
            value = (lambda x: f"{x * 1e3:.0f} ms") if m == "ttft_s" else (lambda x: f"{x:.1f}")
            note = "  (lower is better)" if m == "ttft_s" else ""
            print(f"{n:<9}{m:<16}{value(a):>10}{value(b):>11}{a / b:>7.2f}x{note}")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cores", default=None,
                    help="taskset core list for both servers (default: the first --threads "
                         "cores this process may use)")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32, help="llama-server -np")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="build jobs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.cores is None:
        args.cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:args.threads])
    from flotilla.libs.common.model_cache import ensure_default_model

    gguf = ensure_default_model()
    bins = llamacpp_build.build(llamacpp_build.ROOT / "build" / "llamacpp-cpu", ["llama-server"],
                                cuda=False, jobs=args.jobs)
    logs = Path(tempfile.mkdtemp(prefix="server-bench-"))
    procs = []
    try:
        proc, llama_url = start_llama_server(bins["llama-server"], gguf, args.threads,
                                             args.cores, args.slots, logs / "llama-server.log")
        procs.append(proc)
        proc, flotilla_url = start_flotilla(args.threads, args.cores, logs / "flotilla.log")
        procs.append(proc)
        print(f"servers up (logs {logs}): flotilla {flotilla_url}, llama-server {llama_url}",
              flush=True)
        before = os.getloadavg()
        results = asyncio.run(rounds({"flotilla": flotilla_url, "llama": llama_url}, args))
        load = [before, os.getloadavg()]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the session each was started in
    summary = report(results, args, load)
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cpu": _cpu(), "threads": args.threads,
            "cores": args.cores, "tokens": args.tokens, "slots": args.slots, "load": load,
            "summary": summary, "rounds": results}, indent=1))


if __name__ == "__main__":
    main()
