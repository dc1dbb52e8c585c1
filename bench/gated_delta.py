"""Gated DeltaNet ops (kernels/gated_delta.py) on the GPU: correctness and time at Qwen3-Next-80B
sizes (Hk=16, Hv=32, Dk=Dv=128; conv over 2*16*128 + 32*128 = 8192 channels, width 4).

    python bench/gated_delta.py            # CUDA: the Triton kernels
    python bench/gated_delta.py --cpu      # tiny shapes on the CPU (the torch paths): a smoke run

Each op is checked against its torch path run in fp32 on the same inputs (the torch paths are
tested against transformers' Qwen3-Next functions in tests/kernels/test_gated_delta.py): the
relative error ||out - ref|| / ||ref|| of the output and of the states. Times are medians of
CUDA-event-timed calls; "GB/s" counts the bytes an op must move at least (inputs, outputs, the
states it reads and writes; not the prefill's fp32 scratch), read against the device copy
bandwidth measured first in the same run. Prints one table; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a script: import the `kernels` package, not this file
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from flotilla.kernels import gated_delta_torch as ref  # noqa: E402
from flotilla.kernels.causal_conv1d import causal_conv1d_update_torch, causal_conv1d_varlen_torch  # noqa: E402
from flotilla.kernels.gated_delta import (  # noqa: E402
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
)
from tests.kernels.gated_delta_cases import delta_inputs  # noqa: E402

REAL = dict(
    hk=16, hv=32, d=128, width=4, prefill=4096, ragged=[1, 63, 700, 1500, 1832], batch=64, slots=256
)
TINY = dict(hk=2, hv=4, d=16, width=4, prefill=130, ragged=[1, 63, 64, 2], batch=5, slots=9)
ROWS: list[str] = []
BREAKDOWN: list[str] = []
FAILED: list[str] = []


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median microseconds of `reps` calls after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (out.double() - expected.double()).norm()
    return float(diff / expected.double().norm().clamp_min(1e-30))


def row(
    name: str, us: float, nbytes: float, errors: dict[str, float], limit: float, copy_gbs: float
) -> None:
    gbs = nbytes / us / 1e3
    bad = [f"{k}={v:.1e}" for k, v in errors.items() if not v <= limit]
    status = "ok" if not bad else "FAIL " + " ".join(bad)
    if bad:
        FAILED.append(name)
    errs = " ".join(f"{k} {v:.1e}" for k, v in errors.items())
    ROWS.append(
        f"| {name} | {us:,.1f} | {nbytes / 1e6:,.1f} | {gbs:,.0f} "
        f"({100 * gbs / copy_gbs:.0f}% of copy) | {errs} | {status} |"
    )


def copy_bandwidth(device: str, mib: int) -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), device, 10)
    return 2 * src.numel() * 4 / us / 1e3


def bench_prefill(
    cfg: dict, device: str, dtype: torch.dtype, lengths: list[int], copy_gbs: float, reps: int
) -> None:
    d, hv = cfg["d"], cfg["hv"]
    initial = len(lengths) > 1
    inp = delta_inputs(lengths, cfg["hk"], hv, d, d, dtype=dtype, device=device, seed=1)
    init = inp.initial_state if initial else None
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    kw = dict(scale=d**-0.5, initial_state=init, cu_seqlens=inp.cu_seqlens, use_qk_l2norm=True)
    expected = ref.chunk_gated_delta_rule_torch(
        *(x.float() for x in args), d**-0.5, init, inp.cu_seqlens, True
    )
    name = f"prefill T={sum(lengths)} N={len(lengths)}{' +init' if initial else ''}"
    nbytes = sum(x.numel() * x.element_size() for x in args) + inp.v.numel() * dtype.itemsize
    nbytes += (2 if initial else 1) * len(lengths) * hv * d * d * 4
    variants: list[tuple[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = [
        ("", lambda: chunk_gated_delta_rule(*args, **kw))
    ]
    if device == "cuda":
        from flotilla.kernels.gated_delta_chunk import chunk_gated_delta_rule_triton

        for label, precision, block in (
            ("tf32x3", "tf32x3", 32),
            ("ieee", "ieee", 32),
            ("walk BV=16", "tf32", 16),
            ("walk BV=64", "tf32", 64),
        ):
            variants.append((f" [{label}]", lambda p=precision, b=block: (
                chunk_gated_delta_rule_triton(*args, d**-0.5, init, inp.cu_seqlens, True,
                                              precision=p, block_v_state=b))))  # fmt: skip
        variants.append(
            (
                " [torch path]",
                lambda: ref.chunk_gated_delta_rule_torch(
                    *args, d**-0.5, init, inp.cu_seqlens, True
                ),
            )
        )
    for label, fn in variants:
        o, final = fn()
        errors = {"o": rel_err(o, expected[0]), "state": rel_err(final, expected[1])}
        row(name + label, timed(fn, device, reps), nbytes, errors, 2e-2, copy_gbs)
    if device == "cuda":
        try:
            BREAKDOWN.append(f"{name}: " + kernel_times(variants[0][1]))
        except Exception as exc:  # the breakdown is extra: keep the case's rows
            BREAKDOWN.append(f"{name}: profiler failed ({exc!r})")


def kernel_times(fn: Callable[[], object]) -> str:
    """Each CUDA kernel's time in one call of fn (torch.profiler), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name[:40]} {us:,.1f} us" for name, us in ranked[:6])


def bench_repeated_keys(cfg: dict, device: str, copy_gbs: float, reps: int) -> None:
    """The prefill's hard case for the UT transform: near-identical keys, beta ~ 1, no decay."""
    d, hv, total = cfg["d"], cfg["hv"], cfg["prefill"]
    inp = delta_inputs([total], cfg["hk"], hv, d, d, device=device, seed=4)
    keys = torch.randn(1, cfg["hk"], d, device=device)
    inp = inp._replace(
        k=keys + 0.01 * torch.randn_like(inp.k),
        g=torch.zeros_like(inp.g),
        beta=torch.full_like(inp.beta, 0.99),
    )
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    kw = dict(
        scale=d**-0.5,
        initial_state=inp.initial_state,
        cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=True,
    )
    expected = ref.chunk_gated_delta_rule_torch(
        *args, d**-0.5, inp.initial_state, inp.cu_seqlens, True
    )
    o, final = chunk_gated_delta_rule(*args, **kw)
    errors = {"o": rel_err(o, expected[0]), "state": rel_err(final, expected[1])}
    nbytes = sum(x.numel() * x.element_size() for x in args) + 2 * o.numel() * 4
    us = timed(lambda: chunk_gated_delta_rule(*args, **kw), device, reps)
    row(f"prefill T={total} fp32, repeated keys", us, nbytes, errors, 2e-2, copy_gbs)


def bench_decode(cfg: dict, device: str, dtype: torch.dtype, copy_gbs: float, reps: int) -> None:
    d, hv, n = cfg["d"], cfg["hv"], cfg["batch"]
    inp = delta_inputs([1] * n, cfg["hk"], hv, d, d, dtype=dtype, device=device, seed=2)
    pool = torch.randn(cfg["slots"], hv, d, d, device=device) * 0.3
    slots = torch.randperm(cfg["slots"], device=device)[:n].to(torch.int32)
    slots[-2:] = -1  # padding rows of a CUDA-graph batch
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    expected_pool = pool.clone()
    expected = ref.fused_recurrent_gated_delta_rule_update_torch(
        *(x.float() for x in args), d**-0.5, expected_pool, slots, True
    )
    work = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(
        *args, scale=d**-0.5, state=work, state_indices=slots, use_qk_l2norm=True
    )
    errors = {"o": rel_err(o, expected), "state": rel_err(work, expected_pool)}
    live = int((slots >= 0).sum())
    nbytes = sum(x.numel() * x.element_size() for x in args) + live * hv * d * d * 4 * 2
    us = timed(
        lambda: fused_recurrent_gated_delta_rule_update(
            *args, scale=d**-0.5, state=work, state_indices=slots, use_qk_l2norm=True
        ),
        device,
        reps,
    )
    row(f"decode B={n} (2 padded)", us, nbytes, errors, 2e-2, copy_gbs)


def bench_conv(cfg: dict, device: str, dtype: torch.dtype, copy_gbs: float, reps: int) -> None:
    channels = 2 * cfg["hk"] * cfg["d"] + cfg["hv"] * cfg["d"]
    width, lengths, n = cfg["width"], cfg["ragged"], cfg["batch"]
    gen = torch.Generator().manual_seed(3)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    weight, bias = randn(channels, width), randn(channels)
    pool = randn(cfg["slots"], channels, width - 1)
    total = sum(lengths)
    x = randn(total, channels)
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    slots = torch.randperm(cfg["slots"], device=device)[: len(lengths)].to(torch.int32)
    has_init = torch.arange(len(lengths), device=device) % 2 == 0
    ref_pool, work = pool.clone(), pool.clone()
    expected = causal_conv1d_varlen_torch(x, weight, bias, ref_pool, slots, cu, has_init)
    y = causal_conv1d_varlen(
        x,
        weight,
        bias,
        conv_state=work,
        state_indices=slots,
        cu_seqlens=cu,
        has_initial_state=has_init,
    )
    errors = {"y": rel_err(y, expected), "state": rel_err(work, ref_pool)}
    us = timed(
        lambda: causal_conv1d_varlen(
            x,
            weight,
            bias,
            conv_state=work,
            state_indices=slots,
            cu_seqlens=cu,
            has_initial_state=has_init,
        ),
        device,
        reps,
    )
    nbytes = 2 * x.numel() * dtype.itemsize
    row(f"conv prefill T={total} C={channels}", us, nbytes, errors, 1e-2, copy_gbs)

    xd = randn(n, channels)
    slots = torch.randperm(cfg["slots"], device=device)[:n].to(torch.int32)
    ref_pool, work = pool.clone(), pool.clone()
    expected = causal_conv1d_update_torch(xd, weight, bias, ref_pool, slots)
    y = causal_conv1d_update(xd, weight, bias, conv_state=work, state_indices=slots)
    errors = {"y": rel_err(y, expected), "state": rel_err(work, ref_pool)}
    us = timed(
        lambda: causal_conv1d_update(xd, weight, bias, conv_state=work, state_indices=slots),
        device,
        reps,
    )
    nbytes = (2 * xd.numel() + 2 * n * channels * (width - 1)) * dtype.itemsize
    row(f"conv decode B={n} C={channels}", us, nbytes, errors, 1e-2, copy_gbs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (smoke run)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    cfg = TINY if device == "cpu" else REAL
    dtype = torch.bfloat16
    torch.manual_seed(0)
    if device == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    copy_gbs = copy_bandwidth(device, 1024 if device == "cuda" else 64)
    print(f"device copy bandwidth: {copy_gbs:,.0f} GB/s (read + write)")
    cases: list[tuple[str, Callable[[], None]]] = [
        (
            "prefill",
            lambda: bench_prefill(cfg, device, dtype, [cfg["prefill"]], copy_gbs, args.reps),
        ),
        (
            "prefill ragged",
            lambda: bench_prefill(cfg, device, dtype, cfg["ragged"], copy_gbs, args.reps),
        ),
        ("prefill repeated keys", lambda: bench_repeated_keys(cfg, device, copy_gbs, args.reps)),
        ("decode", lambda: bench_decode(cfg, device, dtype, copy_gbs, args.reps)),
        ("conv", lambda: bench_conv(cfg, device, dtype, copy_gbs, args.reps)),
    ]
    for name, case in cases:
        try:
            case()
        except Exception:  # one broken case must not hide the others' numbers
            FAILED.append(name)
            ROWS.append(f"| {name} | error | | | | FAIL (traceback above) |")
            traceback.print_exc()
    print(
        f"\nbf16 inputs, Hk={cfg['hk']} Hv={cfg['hv']} Dk=Dv={cfg['d']}, {device}; errors: "
        "relative to the torch path in fp32"
    )
    print("| op | us | MB moved | GB/s | rel. error | check |\n|---|---|---|---|---|---|")
    print("\n".join(ROWS))
    if BREAKDOWN:
        print("\nprefill kernels (one call, torch.profiler):")
        print("\n".join(BREAKDOWN))
    if FAILED:
        print("FAILED:", ", ".join(FAILED))
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
