"""Bounded load: at multiples of the concurrency that saturates the engine, every request ends
well (a finish_reason, or 429/503 with Retry-After, quickly); none is lost or hung.

    python bench/load_test.py [--state-file FILE | --model default] [--levels 1,2,4,8,16,32]
                              [--level-s 20] [--multiples 2,4] [--duration-s 90]
                              [--max-tokens 64] [--stall-s 30] [--refusal-bound-s 1]

Without --state-file it starts its own suite (`flotilla up --port 0`, private NATS) and stops
it at the end. Phases, all on loopback with an asyncio + httpx client of closed-loop workers
(each sends a streaming chat completion, reads it to its end, and sends the next; a refused
worker waits the Retry-After it was given):
1. saturation: each of --levels for --level-s; output tok/s per level; the saturating
   concurrency is the smallest level within 10% of the best level's tok/s;
2. overload: each multiple of it for --duration-s, then every request still open is read to
   its end.
A phase passes when every request finished with a finish_reason or was refused (429/503)
with Retry-After within --refusal-bound-s, none hung (no byte for --stall-s), none was lost
(an error event, another error status, a broken or unterminated stream). Prints the date, the
machine, the saturation point, p50/p99 TTFT and inter-token latency per phase and each
service's RSS (with its child processes) over time; exits 1 if any phase failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.sse_client import Outcome, stream_chat  # noqa: E402

PROMPT = "Tell me about the history of lighthouses and the people who kept them."


@dataclass
class Phase:
    name: str
    concurrency: int
    seconds: float
    outcomes: list[Outcome]

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o.token_times) for o in self.outcomes) / self.seconds


def body(model: str, max_tokens: int, i: int) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
            "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}]}


async def run_phase(http: httpx.AsyncClient, model: str, name: str, concurrency: int,
                    seconds: float, max_tokens: int, stall_s: float) -> Phase:
    """`concurrency` closed-loop workers for `seconds`; requests open at the end are read to
    their end (their outcomes count)."""
    stop_at = time.monotonic() + seconds
    outcomes: list[Outcome] = []

    async def worker(w: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            outcome = await stream_chat(http, body(model, max_tokens, w * 100_000 + i), stall_s)
            outcomes.append(outcome)
            i += 1
            if outcome.refused and outcome.retry_after:
                await asyncio.sleep(min(float(outcome.retry_after), max(0.0, stop_at
                                                                        - time.monotonic())))
            elif outcome.kind != "finished":
                await asyncio.sleep(0.1)  # a failing suite: do not spin

    started = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return Phase(name, concurrency, time.monotonic() - started, outcomes)


def saturation(levels: Sequence[Phase]) -> int:
    """The smallest concurrency whose output tok/s is within 10% of the best level's (more
    streams no longer buy throughput; robust to one noisy level, unlike "the first doubling
    that gains less than 10%")."""
    best = max(p.tokens_per_s for p in levels)
    return min(p.concurrency for p in levels if p.tokens_per_s >= 0.9 * best)


def violations(phase: Phase, refusal_bound_s: float) -> list[str]:
    """What broke the property (empty: every request ended well)."""
    bad = []
    for o in phase.outcomes:
        if o.kind == "finished" and o.finish_reason:
            continue
        if o.refused and o.retry_after is not None and o.ended - o.started <= refusal_bound_s:
            continue
        what = (f"refused after {o.ended - o.started:.2f}s, Retry-After {o.retry_after}"
                if o.refused else f"{o.kind} {o.status or ''} {o.detail[:120]}")
        bad.append(f"{phase.name}: {what}")
    return bad


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def describe(phase: Phase) -> str:
    kinds: dict[str, int] = {}
    for o in phase.outcomes:
        key = f"{o.kind}:{o.status}" if o.kind == "http_error" else o.kind
        kinds[key] = kinds.get(key, 0) + 1
    ttft = [o.ttft for o in phase.outcomes if o.ttft is not None]
    gaps = [g for o in phase.outcomes for g in o.gaps]
    refusals = [o.ended - o.started for o in phase.outcomes if o.refused]
    return (f"{phase.name:<12} c={phase.concurrency:<4} {len(phase.outcomes):>5} requests "
            f"{phase.tokens_per_s:7.1f} tok/s  TTFT p50 {pct(ttft, .5) * 1e3:7.0f} ms "
            f"p99 {pct(ttft, .99) * 1e3:7.0f} ms  ITL p50 {pct(gaps, .5) * 1e3:6.1f} ms "
            f"p99 {pct(gaps, .99) * 1e3:7.1f} ms  "
            + (f"refusal max {max(refusals) * 1e3:.0f} ms  " if refusals else "")
            + json.dumps(kinds))


# ---------------------------------------------------------------- memory


def tree_rss_mib(pid: int) -> float:
    """RSS of a process and its descendants (the engine's core process, MCP servers)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text()
                                               .rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    family, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in family]
        family.update(kids)
        frontier += kids
    total = 0
    for p in family:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def sample_rss(pids: dict[str, int], every_s: float,
                     into: list[tuple[float, dict[str, float]]]) -> None:
    t0 = time.monotonic()
    while True:
        into.append((time.monotonic() - t0, {n: tree_rss_mib(p) for n, p in pids.items()}))
        await asyncio.sleep(every_s)


def rss_table(samples: list[tuple[float, dict[str, float]]], rows: int = 12) -> str:
    if not samples:
        return ""
    names = list(samples[0][1])
    step = max(1, -(-len(samples) // rows))
    picked = samples[::step] + ([samples[-1]] if (len(samples) - 1) % step else [])
    lines = ["  t (s)  " + "".join(f"{n:>13}" for n in names) + "   (RSS MiB, with children)"]
    for t, rss in picked:
        lines.append(f"{t:7.0f}  " + "".join(f"{rss.get(n, 0):13.0f}" for n in names))
    return "\n".join(lines)


# ---------------------------------------------------------------- suite and report


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{platform.node()}: {platform.platform()}, {os.cpu_count()} CPUs ({cpu}), "
            f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def start_suite(model: str, state_file: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLOTILLA_NATS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "flotilla.services.launcher", "up",
                             "--port", "0",
                             "--model", model, "--state-file", str(state_file)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if "flotilla is serving" in line:
            return proc
    raise SystemExit("the suite did not start")


async def load_test(state: dict[str, Any], args: argparse.Namespace) -> int:
    base = state["gateway_url"].removesuffix("/v1")
    pids = {n: p for n, p in state["pids"].items() if p}
    rss: list[tuple[float, dict[str, float]]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, limits=limits) as http:
        sampler = asyncio.create_task(sample_rss(pids, args.rss_interval_s, rss))
        try:
            levels = []
            for c in args.levels:
                phase = await run_phase(http, state["model"], f"level {c}", c, args.level_s,
                                        args.max_tokens, args.stall_s)
                print(describe(phase), flush=True)
                levels.append(phase)
            sat = saturation(levels)
            print(f"saturation: {sat} concurrent streams "
                  f"({max(p.tokens_per_s for p in levels):.1f} tok/s at best)", flush=True)
            phases = []
            for m in args.multiples:
                phase = await run_phase(http, state["model"], f"{m}x ({m * sat})", m * sat,
                                        args.duration_s, args.max_tokens, args.stall_s)
                print(describe(phase), flush=True)
                phases.append(phase)
        finally:
            sampler.cancel()
    print(rss_table(rss))
    bad = [v for p in [*levels, *phases] for v in violations(p, args.refusal_bound_s)]
    for line in bad[:20]:
        print("VIOLATION", line)
    print(f"{'FAIL' if bad else 'PASS'}: {len(bad)} requests did not end well "
          f"(of {sum(len(p.outcomes) for p in [*levels, *phases])})")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-file", type=Path, help="a running suite's state file")
    ap.add_argument("--model", default="default", help="model of the suite started here")
    ap.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--level-s", type=float, default=20.0)
    ap.add_argument("--multiples", type=lambda s: [int(x) for x in s.split(",")],
                    default=[2, 4])
    ap.add_argument("--duration-s", type=float, default=90.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stall-s", type=float, default=30.0)
    ap.add_argument("--refusal-bound-s", type=float, default=1.0)
    ap.add_argument("--rss-interval-s", type=float, default=5.0)
    args = ap.parse_args()
    print(f"load test {datetime.datetime.now().isoformat(timespec='seconds')} on {machine()}")
    proc = None
    state_file = args.state_file
    if state_file is None:
        state_file = Path(tempfile.mkdtemp(prefix="flotilla-load-")) / "state.json"
        proc = start_suite(args.model, state_file)
    try:
        code = asyncio.run(load_test(json.loads(state_file.read_text()), args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    sys.exit(code)


if __name__ == "__main__":
    main()
