"""Per-hop admission latency of a burst: N simultaneous /v1/completions through the suite.

    python bench/admission_probe.py [--streams 64] [--prompt 128] [--new 8] [--layers 4]
                                    [--device cpu] [--full] [--repeat 3] [--clients 16]

Starts a private nats-server and the gateway, tokenizer and engine as separate processes (as the
launcher does, with suite_bench's generated model: tiny hidden sizes unless --full), each
exporting its spans as JSON to its log (FLOTILLA_OTEL_EXPORTER=console). Fires --streams
streaming requests at once from --clients client processes (each connected beforehand), then
reads the spans back and joins them by trace id:

    client send → gateway.request start → tokenizer.generate start → engine.request start
                → first token (engine span event)

and prints percentiles of each hop, the spread of engine arrivals (last − first), how many
engine steps the burst's prefills took (distinct first-token times: every request prefilled in
one step gets its first token from the same step output; the ideal is one step), and the CPU
time each service spent per request of the burst (user + system, the process and its children:
several gateway workers count together; span export included).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import string
import sys
import tempfile
import time
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.suite_bench import (  # noqa: E402
    MODEL_NAME,
    cpu_seconds,
    start_services,
    wait_ready,
    write_model_dir,
)
from flotilla.services.launcher.nats_server import NatsServer, free_port  # noqa: E402

SERVICES = ("engine", "tokenizer", "gateway")  # start_services' order


def _ts(value: str) -> float:
    """A console span timestamp (ISO 8601, UTC) as epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def read_spans(log: Path) -> list[dict[str, Any]]:
    """Every span JSON object a ConsoleSpanExporter wrote into `log` (other lines skipped)."""
    text = log.read_text(errors="replace")
    decoder = json.JSONDecoder()
    spans, i = [], 0
    while (i := text.find('{\n    "name"', i)) >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        spans.append(obj)
        i = end
    return spans


async def _client_burst(base: str, prompts: list[str], new: int, ready: Any, go: Any
                        ) -> tuple[list[float], list[float]]:
    """One client process's share of the burst, sent when `go` is set: (when each request
    was written, when its first token arrived), epoch seconds."""
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    sent: list[float] = []

    async def on_request(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append(time.time())

    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits,
                                 event_hooks={"request": [on_request]}) as http:

        async def one(prompt: str) -> float:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": new,
                    "temperature": 0.0, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                first = 0.0
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and not first:
                        first = time.time()
            return first

        # open connections, then wait for the other clients
        await asyncio.gather(*(http.get("/v1/models") for _ in range(min(8, len(prompts)))))
        ready.release()
        await asyncio.to_thread(go.wait)
        firsts = await asyncio.gather(*(one(p) for p in prompts))
    return sent, list(firsts)


def _client(base: str, prompts: list[str], new: int, ready: Any, go: Any, out: Any) -> None:
    out.put(asyncio.run(_client_burst(base, prompts, new, ready, go)))


def burst(base: str, prompts: list[str], new: int, clients: int
          ) -> tuple[float, list[float], list[float]]:
    """Send all requests at once from `clients` processes (dealt round-robin: one Python client
    needs ~0.5 ms of CPU a request, which would spread the burst by itself); (t0, when each
    request was written, client TTFTs), s after t0."""
    ctx = multiprocessing.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
    procs = [ctx.Process(target=_client, args=(base, prompts[i::clients], new, ready, go, out))
             for i in range(clients)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a client process did not start")
    t0 = time.time()
    go.set()
    parts = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(30)
    sent = [t - t0 for s, _ in parts for t in s]
    firsts = [t - t0 for _, f in parts for t in f]
    return t0, sent, firsts


def pct(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    if not s:
        return {}

    def at(q: float) -> float:
        return s[min(len(s) - 1, int(q * len(s)))] * 1e3

    return {"p50": at(0.5), "p90": at(0.9), "max": s[-1] * 1e3, "min": s[0] * 1e3}


def analyse(spans: dict[str, list[dict[str, Any]]], t0: float, n: int) -> dict[str, Any]:
    """Join the burst's spans by trace id into per-hop latencies (ms)."""
    by_trace: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for items in spans.values():
        for s in items:
            if _ts(s["start_time"]) < t0 - 0.005:
                continue  # warm-up and readiness requests
            name = s["name"]
            if name in ("gateway.request", "tokenizer.generate", "engine.request"):
                if name == "gateway.request" and s["attributes"].get("url.path") != \
                        "/v1/completions":
                    continue
                by_trace[s["context"]["trace_id"]][name] = s
    rows = [t for t in by_trace.values() if len(t) == 3]
    hops: dict[str, list[float]] = defaultdict(list)
    engine_starts, firsts = [], []
    for t in rows:
        g = _ts(t["gateway.request"]["start_time"])
        k = _ts(t["tokenizer.generate"]["start_time"])
        e = _ts(t["engine.request"]["start_time"])
        first = [_ts(ev["timestamp"]) for ev in t["engine.request"].get("events", [])
                 if ev["name"] == "first_token"]
        hops["send→gateway"].append(g - t0)
        hops["gateway→tokenizer"].append(k - g)
        hops["tokenizer→engine"].append(e - k)
        hops["send→engine"].append(e - t0)
        engine_starts.append(e)
        if first:
            hops["engine→first token"].append(first[0] - e)
            firsts.append(round(first[0], 4))
    return {
        "joined": len(rows), "expected": n,
        "hops_ms": {k: pct(v) for k, v in hops.items()},
        "engine_arrival_spread_ms": (max(engine_starts) - min(engine_starts)) * 1e3
        if engine_starts else None,
        "prefill_steps": len(set(firsts)),
    }


def run_once(base: str, prompts: list[str], new: int, logs: Path,
             pids: dict[str, int], clients: int) -> dict[str, Any]:
    sizes = {name: (logs / f"{name}.log").stat().st_size for name in
             ("gateway", "tokenizer", "engine")}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0, sent, ttfts = burst(base, prompts, new, clients)
    time.sleep(2.0)  # the span processors export every 0.5 s
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) / len(prompts) * 1e3
           for name, pid in pids.items()}
    spans = {}
    for name, size in sizes.items():
        text_path = logs / f"{name}.log"
        tail = logs / f"{name}.tail"
        with open(text_path, "rb") as f:
            f.seek(size)
            tail.write_bytes(f.read())
        spans[name] = read_spans(tail)
    res = analyse(spans, t0, len(prompts))
    res["client_send_ms"] = pct(sent)  # the client itself needs time to issue the burst
    res["client_ttft_ms"] = pct(ttfts)
    res["cpu_ms_per_request"] = cpu
    return res


def show(res: dict[str, Any]) -> None:
    print(f"  joined {res['joined']}/{res['expected']} traces; engine arrivals spread "
          f"{res['engine_arrival_spread_ms']:.0f} ms; burst prefilled in "
          f"{res['prefill_steps']} engine step(s)")
    for hop, p in {"client send": res["client_send_ms"], **res["hops_ms"],
                   "client TTFT": res["client_ttft_ms"]}.items():
        print(f"  {hop:22s} p50 {p['p50']:7.1f}  p90 {p['p90']:7.1f}  max {p['max']:7.1f} ms")
    print("  CPU per request (incl. its 2 s export wait): " + ", ".join(
        f"{name} {ms:.2f} ms" for name, ms in res["cpu_ms_per_request"].items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full", action="store_true", help="Llama-3-8B sizes (GPU)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16,
                    help="client processes sharing the burst (1: one Python client)")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                    help="extra FLOTILLA_* settings for the services")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/admission_probe.json")
    args = ap.parse_args()
    model = write_model_dir(args.layers, tiny=not args.full)
    rng = random.Random(0)

    def fresh(n: int) -> list[str]:
        """New random prompts: a burst that repeats earlier ones would hit the prefix cache
        (the engine would skip their prefill and the probe would time something else)."""
        return ["".join(rng.choice(string.ascii_letters) for _ in range(args.prompt))
                for _ in range(n)]

    os.environ.update(FLOTILLA_OTEL_EXPORTER="console", OTEL_BSP_SCHEDULE_DELAY="500",
                      OTEL_BSP_MAX_QUEUE_SIZE="65536")
    os.environ.update(kv.split("=", 1) for kv in args.env)
    logs = Path(tempfile.mkdtemp(prefix="admission-probe-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    runs = []
    with NatsServer(log_path=logs / "nats.log") as nats:
        procs = start_services(model, nats.url, port, logs, args.device, None)
        try:
            asyncio.run(wait_ready(base, procs, timeout=300))
            burst(base, fresh(8), 2, 2)  # warm-up through every hop
            for i in range(args.repeat):
                prompts = fresh(args.streams)
                res = run_once(base, prompts, args.new, logs,
                               {name: p.pid for name, p in zip(SERVICES, procs, strict=True)},
                               args.clients)
                print(f"burst {i + 1}/{args.repeat}, {args.streams} x {args.prompt} tokens:")
                show(res)
                runs.append(res)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2))
    print(f"logs in {logs}; JSON in {args.out}")


if __name__ == "__main__":
    main()
