"""kernels/dense_attention.py: fused causal attention of one prompt over its own fresh K/V
(torch SDPA; cuDNN on the GPU, the math backend on CPU) against the paged reference, GQA
natively or with K/V expanded, and the conditions under which the engine takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flotilla.kernels import dense_attention
from flotilla.kernels.dense_attention import dense_causal_attention, dense_prefill_ok
from flotilla.kernels.prefill_attention import prefill_attention_ref
from flotilla.kernels.selection import KernelSelection
from tests.kernels.attention_cases import make_case
from tests.kernels.conftest import DEVICE, tolerance


def _contiguous_kv(case, length: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The sequence's K/V rows gathered from its cache blocks, in position order."""
    block_size = case.k_cache.shape[1]
    blocks = case.meta.block_tables[0, : -(-length // block_size)].long()
    k = case.k_cache[blocks].flatten(0, 1)[:length]
    v = case.v_cache[blocks].flatten(0, 1)[:length]
    return k, v


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("native_gqa", [True, False], ids=["enable_gqa", "expanded"])
def test_matches_paged_reference(group: int, native_gqa: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    length = 45  # not a multiple of the block size
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    case = make_case([length], [length], 2 * group, 2, 64, 16, dtype)
    k, v = _contiguous_kv(case, length)
    ref = prefill_attention_ref(case.q, case.k_cache, case.v_cache, case.meta, 0.2)
    calls: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(bool(kwargs.get("enable_gqa")))
        if kwargs.get("enable_gqa") and not native_gqa:
            raise RuntimeError("No available kernel")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(dense_attention, "_native_gqa", None)
    monkeypatch.setattr(dense_attention.F, "scaled_dot_product_attention", spy)
    out = dense_causal_attention(case.q, k, v, 0.2)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    if group == 1:
        assert calls == [False]
    else:  # tried natively once; on refusal expanded, and later calls go straight there
        assert calls == ([True] if native_gqa else [True, False])
        dense_causal_attention(case.q, k, v, 0.2)
        assert calls[-1] is native_gqa


def test_engine_conditions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only one CUDA prompt without a cached prefix, >= DENSE_MIN_TOKENS, 16-bit, plain causal
    attention over a 16-bit cache, whose padded length has a warmed-up plan and costs at most
    MAX_PAD_COST of its attention work, takes the dense path, where the selection's
    dense_prefill allows it."""
    n = dense_attention.DENSE_MIN_TOKENS
    monkeypatch.setattr(dense_attention, "_warm_max", 4 * n)
    if not torch.cuda.is_available():
        case = make_case([n], [n], 4, 2, 64, 16, torch.bfloat16)
        assert not dense_prefill_ok(case.q, case.meta, None, None, None)  # CPU
        return
    q = torch.zeros(n, 4, 64, dtype=torch.bfloat16, device="cuda")
    one = make_case([n], [n], 4, 2, 64, 16, torch.bfloat16).meta
    assert dense_prefill_ok(q, one, None, None, None, "1")
    assert not dense_prefill_ok(q, one, None, None, None, "0")  # the selection turns it off
    assert not dense_prefill_ok(q.float(), one, None, None, None)
    assert not dense_prefill_ok(q, one, None, 128, None)  # sliding window
    assert not dense_prefill_ok(q, one, None, None, 30.0)  # soft-capping
    assert not dense_prefill_ok(q, one, (q, q), None, None)  # type: ignore[arg-type]  # fp8 KV
    prefix = make_case([n], [n + 16], 4, 2, 64, 16, torch.bfloat16).meta
    assert not dense_prefill_ok(q, prefix, None, None, None)
    two = make_case([n // 2, n // 2], [n // 2, n // 2], 4, 2, 64, 16, torch.bfloat16).meta
    assert not dense_prefill_ok(q, two, None, None, None)
    short = make_case([n - 1], [n - 1], 4, 2, 64, 16, torch.bfloat16).meta
    assert not dense_prefill_ok(q[: n - 1], short, None, None, None)
    past = dense_attention.BUCKET + 1  # a bucket's worth of padding: too much work wasted
    over = make_case([n + past], [n + past], 4, 2, 64, 16, torch.bfloat16).meta
    assert not dense_prefill_ok(q, over, None, None, None)
    monkeypatch.setattr(dense_attention, "_warm_max", 0)  # no plan built
    assert not dense_prefill_ok(q, one, None, None, None)


def test_padding_rows_change_nothing() -> None:
    """Zero rows appended after the prompt (the padding up to a plan's bucket) are never seen by
    a real query under causal masking: the first T rows equal the unpadded result."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(37, h, 32, generator=g) for h in (4, 2, 2))
    pad = [torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 27)) for x in (q, k, v)]
    torch.testing.assert_close(dense_causal_attention(*pad, 0.3)[:37],
                               dense_causal_attention(q, k, v, 0.3))


def test_enabled_by_default_only_on_hopper_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """dense_prefill (FLOTILLA_DENSE_PREFILL): auto (default) on compute capability >= 9, 1 on
    any GPU, 0 off; never on CPU (no plans to build); a bad value is refused."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    default = KernelSelection().dense_prefill
    assert not dense_attention.enabled(cpu, default)
    for capability, expected in (((8, 0), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        assert dense_attention.enabled(gpu, default) is expected
        assert dense_attention.enabled(gpu) is expected  # the argument's default is the same
    assert not dense_attention.enabled(gpu, "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d: (8, 0))
    assert dense_attention.enabled(gpu, "1") and not dense_attention.enabled(cpu, "1")
    with pytest.raises(ValueError, match="dense_prefill"):
        KernelSelection(dense_prefill="yes")  # type: ignore[arg-type]
