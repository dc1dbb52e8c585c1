"""The Gated DeltaNet ops' torch paths (kernels/gated_delta.py on CPU) against transformers'
Qwen3-Next functions and an fp64 token-by-token recurrence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from flotilla.kernels.gated_delta import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
)
from tests.kernels.gated_delta_cases import delta_inputs, naive_gated_delta

LENGTHS = [1, 63, 64, 65, 130]


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 32), (1, 1, 32, 16)])
@pytest.mark.parametrize("initial", [False, True])
def test_chunk_matches_transformers_per_sequence(
    hk: int, hv: int, dk: int, dv: int, initial: bool
) -> None:
    inp = delta_inputs(LENGTHS, hk, hv, dk, dv, seed=hk + dk + initial)
    init = inp.initial_state if initial else None
    o, final = chunk_gated_delta_rule(
        inp.q,
        inp.k,
        inp.v,
        inp.g,
        inp.beta,
        scale=dk**-0.5,
        initial_state=init,
        cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=True,
    )
    bounds = inp.cu_seqlens.tolist()
    for i in range(len(LENGTHS)):
        lo, hi = bounds[i], bounds[i + 1]
        ref_o, ref_state = hf.torch_chunk_gated_delta_rule(
            inp.q[None, lo:hi],
            inp.k[None, lo:hi],
            inp.v[None, lo:hi],
            inp.g[None, lo:hi],
            inp.beta[None, lo:hi],
            initial_state=None if init is None else init[i : i + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(o[lo:hi], ref_o[0], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(final[i], ref_state[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("use_qk_l2norm,scale", [(True, 0.25), (False, 0.05)])
def test_chunk_matches_naive_recurrence(use_qk_l2norm: bool, scale: float) -> None:
    inp = delta_inputs([130, 5, 64, 1], 2, 6, 16, 16, seed=3)
    if not use_qk_l2norm:  # keep the unnormalised recurrence stable: |k|^2 * beta < 2
        inp = inp._replace(k=F.normalize(inp.k, dim=-1) * 0.9)
    o, final = chunk_gated_delta_rule(
        inp.q,
        inp.k,
        inp.v,
        inp.g,
        inp.beta,
        scale=scale,
        initial_state=inp.initial_state,
        cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
    )
    ref_o, ref_state = naive_gated_delta(inp, scale, use_qk_l2norm)
    torch.testing.assert_close(o.double(), ref_o, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final.double(), ref_state, atol=2e-4, rtol=2e-4)


def test_chunk_bf16_inputs_keep_v_dtype() -> None:
    inp = delta_inputs([70, 3], 1, 2, 16, 16, dtype=torch.bfloat16, seed=4)
    o, final = chunk_gated_delta_rule(
        inp.q,
        inp.k,
        inp.v,
        inp.g,
        inp.beta,
        scale=0.25,
        initial_state=None,
        cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=True,
    )
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref_o, ref_state = naive_gated_delta(inp, 0.25, True, initial=False)
    torch.testing.assert_close(o.double(), ref_o, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final.double(), ref_state, atol=1e-4, rtol=1e-4)


def test_recurrent_update_writes_scattered_rows_and_skips_padding() -> None:
    n, hk, hv, dk, dv = 5, 2, 4, 16, 32
    inp = delta_inputs([1] * n, hk, hv, dk, dv, seed=5)
    pool = torch.randn(9, hv, dk, dv)
    indices = torch.tensor([7, -1, 0, 4, -1], dtype=torch.int32)
    before = pool.clone()
    o = fused_recurrent_gated_delta_rule_update(
        inp.q,
        inp.k,
        inp.v,
        inp.g,
        inp.beta,
        scale=dk**-0.5,
        state=pool,
        state_indices=indices,
        use_qk_l2norm=True,
    )
    live = [0, 2, 3]
    rows = indices[live].long()
    ref_o, ref_state = hf.torch_recurrent_gated_delta_rule(
        inp.q[live][:, None],
        inp.k[live][:, None],
        inp.v[live][:, None],
        inp.g[live][:, None],
        inp.beta[live][:, None],
        initial_state=before[rows],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o[live], ref_o[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[rows], ref_state, atol=1e-5, rtol=1e-5)
    untouched = [i for i in range(9) if i not in rows.tolist()]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.equal(o[[1, 4]], torch.zeros(2, hv, dv))


def test_decode_steps_continue_a_prefill() -> None:
    """Prefill of L tokens, then one decode step per token, equals a prefill of all of them."""
    steps, hk, hv, d = 4, 1, 2, 16
    inp = delta_inputs([67 + steps], hk, hv, d, d, seed=6)
    cut = 67
    full_o, full_state = chunk_gated_delta_rule(
        inp.q,
        inp.k,
        inp.v,
        inp.g,
        inp.beta,
        scale=0.25,
        initial_state=inp.initial_state,
        cu_seqlens=inp.cu_seqlens,
        use_qk_l2norm=True,
    )
    _, state = chunk_gated_delta_rule(
        inp.q[:cut],
        inp.k[:cut],
        inp.v[:cut],
        inp.g[:cut],
        inp.beta[:cut],
        scale=0.25,
        initial_state=inp.initial_state,
        cu_seqlens=torch.tensor([0, cut], dtype=torch.int32),
        use_qk_l2norm=True,
    )
    pool = torch.zeros(3, hv, d, d)
    pool[2] = state[0]
    slot = torch.tensor([2], dtype=torch.int32)
    for t in range(cut, cut + steps):
        o = fused_recurrent_gated_delta_rule_update(
            inp.q[t : t + 1],
            inp.k[t : t + 1],
            inp.v[t : t + 1],
            inp.g[t : t + 1],
            inp.beta[t : t + 1],
            scale=0.25,
            state=pool,
            state_indices=slot,
            use_qk_l2norm=True,
        )
        torch.testing.assert_close(o[0], full_o[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], full_state[0], atol=1e-5, rtol=1e-5)


def _conv_inputs(
    lengths: list[int], channels: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, bias, cu


@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_varlen_matches_transformers(use_bias: bool) -> None:
    """New sequences equal causal_conv1d_fn; continued ones equal the tail of causal_conv1d_fn
    over the previous inputs and the new ones; the state holds the last W-1 inputs."""
    lengths, channels, width = [5, 1, 2, 9], 8, 4
    x, weight, bias_t, cu = _conv_inputs(lengths, channels, width, seed=7)
    bias = bias_t if use_bias else None
    gen = torch.Generator().manual_seed(8)
    history = [torch.randn(channels, 6, generator=gen) for _ in lengths]
    pool = torch.randn(6, channels, width - 1, generator=gen)
    indices = torch.tensor([3, 0, -1, 5], dtype=torch.int32)
    initial = torch.tensor([True, True, True, False])
    for i, slot in enumerate(indices.tolist()):
        if slot >= 0:
            pool[slot] = history[i][:, -(width - 1) :]
    before = pool.clone()
    y = causal_conv1d_varlen(
        x,
        weight,
        bias,
        conv_state=pool,
        state_indices=indices,
        cu_seqlens=cu,
        has_initial_state=initial,
    )
    bounds = cu.tolist()
    for i, slot in enumerate(indices.tolist()):
        new = x[bounds[i] : bounds[i + 1]].T
        continued = slot >= 0 and bool(initial[i])
        seq = torch.cat([history[i], new], dim=1) if continued else new
        ref = hf.causal_conv1d_fn(seq[None], weight, bias, activation="silu")[0]
        torch.testing.assert_close(
            y[bounds[i] : bounds[i + 1]], ref[:, -new.shape[1] :].T, atol=1e-5, rtol=1e-5
        )
        if slot >= 0:
            padded = F.pad(seq, (width - 1, 0))
            torch.testing.assert_close(pool[slot], padded[:, -(width - 1) :])
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


def test_conv_update_matches_transformers() -> None:
    channels, width = 8, 4
    x, weight, bias, _ = _conv_inputs([3], channels, width, seed=9)
    pool = torch.randn(5, channels, width - 1)
    indices = torch.tensor([4, -1, 1], dtype=torch.int32)
    before = pool.clone()
    y = causal_conv1d_update(x, weight, bias, conv_state=pool, state_indices=indices)
    live = [0, 2]
    rows = indices[live].long()
    hf_state = F.pad(before[rows], (1, 0))  # transformers keeps W columns; the first is unused
    ref = hf.causal_conv1d_update(x[live][:, :, None], hf_state, weight, bias, "silu")
    torch.testing.assert_close(y[live], ref[:, :, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[rows], hf_state[..., 1:])
    assert torch.equal(y[1], torch.zeros(channels))
    assert torch.equal(pool[[0, 2, 3]], before[[0, 2, 3]])


def test_arguments_are_checked() -> None:
    inp = delta_inputs([3], 1, 2, 16, 16)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(
            inp.q,
            inp.k,
            inp.v,
            inp.g,
            inp.beta,
            scale=0.25,
            initial_state=inp.initial_state.double(),
            cu_seqlens=inp.cu_seqlens,
            use_qk_l2norm=True,
        )
    with pytest.raises(ValueError, match="must be on cpu"):
        chunk_gated_delta_rule(
            inp.q,
            inp.k,
            inp.v,
            inp.g,
            inp.beta,
            scale=0.25,
            initial_state=None,
            cu_seqlens=inp.cu_seqlens.to("meta"),
            use_qk_l2norm=True,
        )
    with pytest.raises(ValueError, match="Hv a multiple"):
        chunk_gated_delta_rule(
            inp.q.repeat(1, 3, 1),
            inp.k.repeat(1, 3, 1),
            inp.v,
            inp.g,
            inp.beta,
            scale=0.25,
            initial_state=None,
            cu_seqlens=inp.cu_seqlens,
            use_qk_l2norm=True,
        )


@pytest.mark.slow
def test_bench_script_runs_its_cpu_smoke_mode() -> None:
    """bench/gated_delta.py (run unattended on a GPU) gets through every case on the CPU."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, str(root / "bench" / "gated_delta.py"), "--cpu", "--reps", "1"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = [
        line for line in result.stdout.splitlines() if line.startswith("| ") and "us" not in line
    ]
    assert len(rows) == 6 and all(line.endswith("| ok |") for line in rows), result.stdout
