"""GPTQ / AWQ 4-bit: the w4a16 kernels, and tiny checkpoints quantized and packed here the way
AutoGPTQ / AutoAWQ publish them, loaded and compared with their dequantized float twins."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.kernels.w4a16 import pack_int4, unpack_int4, w4a16_dequantize_ref, w4a16_matmul_triton
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, save_tiny_llama
from tests.quant.conftest import DEVICE, rel_err

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# GPTQ's act-order sorts input features by the Hessian of the layer input, so projections that
# read the same input (q/k/v; gate/up) share one order.
SHARED_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2,
                "down_proj": 3}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i holds column 8c + ORDER[i]


# ------------------------------------------------------------------ kernels


@pytest.mark.parametrize("kernel,m", [("gemv", 1), ("gemv", 2), ("gemm", 5), ("gemm", 40)])
@pytest.mark.parametrize("group", [32, 64, 192])  # 32: "gemv" falls back to the GEMM
@pytest.mark.parametrize("with_perm", [False, True], ids=["plain", "perm"])
def test_kernel_matches_dequantize_then_matmul(kernel: str, m: int, group: int,
                                               with_perm: bool) -> None:
    g = torch.Generator().manual_seed(group + m)
    n, k = 24, 384
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    perm = torch.randperm(k, generator=g).int() if with_perm else None
    qweight = pack_int4(codes)
    assert torch.equal(unpack_int4(qweight), codes)
    w = (codes.double() - zeros.double().repeat_interleave(group, 1)) \
        * scales.double().repeat_interleave(group, 1)
    x = torch.randn(m, k, generator=g)
    ref = (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T
    to = {"device": DEVICE}
    out = w4a16_matmul_triton(x.to(**to), qweight.to(**to), scales.to(**to), zeros.to(**to),
                              group, None if perm is None else perm.to(**to), kernel=kernel)
    assert rel_err(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("m,k,group,config", [
    (2, 256, 128, {}),  # two rows padded to a 16-row tile; one group a step
    (16, 512, 128, {"SPLIT_K": 2}),  # split-K finished in the launch (ws + counters)
    (5, 512, 32, {"BLOCK_K": 256, "SPLIT_K": 2}),  # groups shorter than a step: scale per word
    (37, 256, 256, {"BLOCK_N": 32}),  # 37 rows -> a 64-row tile; rows past N clamped
    (64, 512, 512, {"BLOCK_K": 256}),  # per-channel group spanning two steps
    (16, 256, 128, {"SWAP": False}),  # x rows as the MMA's M
    (16, 256, 128, {"SWAP": False, "X_TILE": True}),  # x as one tile split into planes
    (3, 512, 32, {"X_TILE": True, "BLOCK_K": 256}),
])
@pytest.mark.parametrize("with_perm", [False, True], ids=["plain", "perm"])
def test_mma_gemm_matches_reference(m: int, k: int, group: int, config: dict,
                                    with_perm: bool) -> None:
    """kernels/w4a16_mma.py: each nibble plane is its own MMA operand against x's stride-8
    columns; every tile/split/group layout sums to the dequantize-then-matmul product."""
    from flotilla.kernels.w4a16_mma import w4a16_mma

    g = torch.Generator().manual_seed(m + k + group)
    n = 40
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    perm = torch.randperm(k, generator=g).int() if with_perm else None
    x = torch.randn(m, k, generator=g)
    w = w4a16_dequantize_ref(pack_int4(codes), scales, zeros, group).double()
    ref = (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T
    to = {"device": DEVICE}
    out = w4a16_mma(x.to(**to), pack_int4(codes).to(**to), scales.to(**to), zeros.to(**to),
                    group, None if perm is None else perm.to(**to), config=config)
    assert out.shape == (m, n)
    assert rel_err(out.cpu().double(), ref) < 1e-5
    # the dispatcher routes 2..64 rows here when asked (on a GPU: by default)
    out2 = w4a16_matmul_triton(x.to(**to), pack_int4(codes).to(**to), scales.to(**to),
                               zeros.to(**to), group, None if perm is None else perm.to(**to),
                               kernel="mma")
    assert rel_err(out2.cpu().double(), ref) < 1e-5


@pytest.mark.parametrize("k,group,nsb,prefetch", [
    (512, 128, 2, False),  # K a multiple of 256 * NSB: no clamped runs
    (512, 128, 1, True),  # the next step's words loaded ahead
    (320, 64, 1, False),  # K not a multiple of 256: the last step's runs past K clamped
    (448, 448, 2, True),  # one group per row (per-channel), ragged steps with prefetch
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_perm", [False, True], ids=["plain", "perm"])
def test_gemv_tiles(k: int, group: int, nsb: int, prefetch: bool, dtype: torch.dtype,
                    with_perm: bool) -> None:
    """kernels/w4a16_gemv.py over its tile shapes: rows past N (13 rows, 8 per program), steps
    past K, prefetch, 16-bit x read as vectors of pairs or fp32 x element by element, act-order
    gathers; two x rows (one program row each)."""
    from flotilla.kernels.w4a16_gemv import w4a16_gemv

    g = torch.Generator().manual_seed(k + group + nsb)
    n = 13
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    perm = torch.randperm(k, generator=g).int() if with_perm else None
    x = torch.randn(2, k, generator=g).to(dtype)
    w = w4a16_dequantize_ref(pack_int4(codes), scales, zeros, group).double()
    ref = (x.double() if perm is None else x.double()[:, perm.long()]) @ w.T
    to = {"device": DEVICE}
    args = (x.to(**to), pack_int4(codes).to(**to), scales.to(**to), zeros.to(**to), group,
            None if perm is None else perm.to(**to))
    out = w4a16_gemv(*args, block_n=8, nsb=nsb, prefetch=prefetch)
    assert out.dtype == dtype
    assert rel_err(out.cpu().double(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd-offset-view"])
def test_gemv_bf16_rows_as_pairs_or_gathered(offset: int) -> None:
    """bf16 x is read as int32 words of bf16 pairs only when its rows start at 4-byte
    boundaries; a view starting at an odd element takes the gather path (on a GPU the pair
    loads would fault there). Both match dequantize-then-matmul."""
    g = torch.Generator().manual_seed(7)
    n, k, group = 16, 256, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // group, generator=g) * 0.01 + 1e-3).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=g)
    base = torch.randn(1, k + 1, generator=g).to(torch.bfloat16)
    x = base[:, offset:offset + k]
    assert (x.data_ptr() % 4 == 0) == (offset == 0)
    ref = x.double() @ w4a16_dequantize_ref(pack_int4(codes), scales, zeros, group).double().T
    to = {"device": DEVICE}
    out = w4a16_matmul_triton(x if DEVICE == "cpu" else base.to(**to)[:, offset:offset + k],
                              pack_int4(codes).to(**to), scales.to(**to), zeros.to(**to), group,
                              kernel="gemv")
    assert rel_err(out.cpu().double(), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 128])
def test_gpu_kernel_real_sizes(m: int) -> None:
    n, k, group = 4096, 14336, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // group, device="cuda") * 0.01).half()
    zeros = torch.full((n, k // group), 8, dtype=torch.uint8, device="cuda")
    qweight = pack_int4(codes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w4a16_dequantize_ref(qweight, scales, zeros, group).double().T
    assert rel_err(w4a16_matmul_triton(x, qweight, scales, zeros, group), ref) < 1e-2
    perm = torch.randperm(k, device="cuda").int()
    ref = x.double()[:, perm.long()] @ w4a16_dequantize_ref(qweight, scales, zeros,
                                                            group).double().T
    assert rel_err(w4a16_matmul_triton(x, qweight, scales, zeros, group, perm), ref) < 1e-2


# ------------------------------------------------------------------ reference quantizers


def _int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((words & 0xFFFFFFFF).astype(np.uint32).view(np.int32))


def gptq_quantize(w: torch.Tensor, group: int, act_order: bool, seed: int
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric round-to-nearest in GPTQ's layout (v1: zeros stored minus one). act_order:
    columns are grouped in a random order, as GPTQ's descending-Hessian order would."""
    n, k = w.shape
    g = k if group == -1 else group
    order = (torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order
             else torch.arange(k))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // g).int()
    scales = torch.empty(k // g, n, dtype=torch.float16)
    q = torch.empty(n, k, dtype=torch.int64)
    for grp in range(k // g):
        cols = order[grp * g:(grp + 1) * g]
        scales[grp] = (2 * w[:, cols].abs().amax(1).clamp(min=1e-8) / 15).half()
        s = scales[grp].float()[:, None]
        q[:, cols] = (torch.round(w[:, cols] / s) + 8).clamp(0, 15).long()
    dense = scales.float()[g_idx.long()].T * (q - 8).float()
    qn = q.numpy()
    words = sum(qn[:, i::8].astype(np.int64) << (4 * i) for i in range(8))  # [N, K/8]
    zero_words = sum(np.full((k // g, n // 8), 7, dtype=np.int64) << (4 * j) for j in range(8))
    tensors = {"qweight": _int32(words.T.copy()), "qzeros": _int32(zero_words),
               "scales": scales, "g_idx": g_idx}
    return tensors, dense


def awq_quantize(w: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Asymmetric round-to-nearest with zero points, packed along N in AutoAWQ's order."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    mx, mn = wg.amax(-1), wg.amin(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = (-torch.round(mn / s)).clamp(0, 15)
    q = (torch.round(wg / s[..., None]) + zeros[..., None]).clamp(0, 15)
    dense = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
    q = q.reshape(n, k).long().T.numpy()  # [K, N]
    z = zeros.long().T.numpy()  # [K/G, N]

    def pack(a: np.ndarray) -> torch.Tensor:
        return _int32(sum(a[:, AWQ_PACK_ORDER[i]::8].astype(np.int64) << (4 * i)
                          for i in range(8)))

    return {"qweight": pack(q), "qzeros": pack(z), "scales": scales.T.contiguous()}, dense


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("w4_base")
    save_tiny_llama(path, seed=3)
    return path


def write_pair(base: Path, out: Path, fmt: str, group: int, act_order: bool,
               same_order: bool = True) -> tuple[Path, Path]:
    """(quantized checkpoint, its dequantized float32 twin)."""
    state = load_file(str(base / "model.safetensors"))
    qdir, ddir = out / "quantized", out / "dequantized"
    quant, dense = {}, {}
    for i, (name, tensor) in enumerate(sorted(state.items())):
        if not any(f".{p}.weight" in name for p in LINEARS):
            quant[name] = dense[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        if fmt == "gptq":
            proj = prefix.rsplit(".", 1)[1]
            seed = SHARED_INPUT[proj] + 10 * int(prefix.split(".")[2]) if same_order else i
            packed, deq = gptq_quantize(tensor.float(), group, act_order, seed=seed)
            if group == -1:
                packed.pop("g_idx")  # checkpoints without g_idx load too
        else:
            packed, deq = awq_quantize(tensor.float(), group)
        quant.update({f"{prefix}.{key}": v.contiguous() for key, v in packed.items()})
        dense[name] = deq.contiguous()
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": True, "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"})
    for d, tensors in ((qdir, quant), (ddir, dense)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        shutil.copy(base / "config.json", d / "config.json")
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, ddir


# groups of 32 keep the K-order layout; 64 and per-channel take the re-packed one
# (kernels/w4a16_marlin.py) where the selection's w4_layout asks for it
CHECKPOINTS = [("gptq", 32, False), ("gptq", 32, True), ("gptq", -1, False), ("awq", 32, False),
               ("gptq", 64, True), ("awq", 64, False)]


@pytest.mark.parametrize("mode", ["kmajor", "marlin", "both", "dequant"])
@pytest.mark.parametrize("fmt,group,act_order", CHECKPOINTS,
                         ids=["gptq-g32", "gptq-g32-actorder", "gptq-perchannel", "awq-g32",
                              "gptq-g64-actorder", "awq-g64"])
def test_checkpoint_loads_and_matches_dequantized_twin(
    tiny_llama: Path, tmp_path: Path, fmt: str, group: int, act_order: bool, mode: str,
    request: pytest.FixtureRequest,
) -> None:
    selection = request.getfixturevalue("dequant_mode" if mode == "dequant" else "kernels_mode")
    if mode != "dequant":
        selection = dataclasses.replace(selection, w4_layout=mode)
    qdir, ddir = write_pair(tiny_llama, tmp_path, fmt, group, act_order)
    quantized = load_model(qdir, device=DEVICE, kernel_selection=selection).model
    twin = load_model(ddir, device=DEVICE, kernel_selection=selection).model
    layer = quantized.model.layers[0].self_attn.qkv_proj
    assert not hasattr(layer, "qweight") and not any(
        p.dtype.is_floating_point and p.dim() == 2 for p in layer.parameters())
    if act_order and mode != "dequant":  # groups of 64: only down_proj has two (K=128)
        ordered = layer if group == 32 else quantized.model.layers[0].mlp.down_proj
        assert ordered.w4_perm is not None
    assert layer.quant_method.marlin == (mode == "marlin" and group != 32)
    assert layer.quant_method.marlin_rows == (mode == "both" and group != 32)
    for ids in [list(range(3, 40))] + ([[5]] if mode == "both" else []):  # 1 row: K-order copy
        ours = SingleSequenceRunner(quantized).forward(ids)
        ref = SingleSequenceRunner(twin).forward(ids)
        assert rel_err(ours, ref) < 1e-5


def test_gptq_rejects_fused_shards_with_different_orders(tiny_llama: Path, tmp_path: Path
                                                        ) -> None:
    qdir, _ = write_pair(tiny_llama, tmp_path, "gptq", 32, True, same_order=False)
    with pytest.raises(ValueError, match="different g_idx"):
        load_model(qdir)


def test_gptq_rejects_other_bit_widths(tiny_llama: Path, tmp_path: Path) -> None:
    qdir, _ = write_pair(tiny_llama, tmp_path, "gptq", 32, False)
    config = json.loads((qdir / "config.json").read_text())
    config["quantization_config"]["bits"] = 3
    (qdir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4 bits"):
        load_model(qdir)
