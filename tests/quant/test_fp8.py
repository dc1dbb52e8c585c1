"""FP8 (e4m3) weights: the kernels, and tiny fp8 checkpoints in the published layouts (AutoFP8
per-tensor, compressed-tensors per-channel, DeepSeek-style 2D blocks) against float twins."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flotilla.kernels.fp8 import FP8, fp8_matmul_ref, fp8_matmul_triton, quantize_fp8_per_channel
from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, save_tiny_llama
from tests.quant.conftest import DEVICE, rel_err

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("groups", [1, 13], ids=["per-channel", "groups-of-40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kernel,m", [("gemv", 1), ("gemv", 2), ("gemm", 5), ("gemm", 40)])
def test_kernel_matches_dequantize_then_matmul(kernel: str, m: int, dtype: torch.dtype,
                                               groups: int) -> None:
    g = torch.Generator().manual_seed(m)
    weight, _ = quantize_fp8_per_channel(torch.randn(24, 520, generator=g))
    scale = torch.rand(24, groups, generator=g) * 0.01
    x = torch.randn(m, 520, generator=g).to(dtype)
    ref = x.double() @ (weight.double() * scale.double().repeat_interleave(520 // groups, 1)).T
    out = fp8_matmul_triton(x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE), kernel=kernel)
    assert out.dtype == dtype
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_per_channel_quantization_error_is_e4m3_rounding() -> None:
    w = torch.randn(64, 256)
    weight, scale = quantize_fp8_per_channel(w)
    assert weight.dtype == FP8 and scale.shape == (64, 1)
    assert rel_err(weight.float() * scale, w) < 0.04  # 3 mantissa bits


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 256])
def test_gpu_kernels_real_sizes(m: int) -> None:
    weight, scale = quantize_fp8_per_channel(torch.randn(4096, 14336, device="cuda"))
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    ref = fp8_matmul_ref(x.double(), weight, scale.double())
    # m > 2 uses torch._scaled_mm (fp8 activations): e4m3 rounding of x as well
    assert rel_err(fp8_matmul_triton(x, weight, scale), ref) < (1e-2 if m <= 2 else 5e-2)
    assert rel_err(fp8_matmul_triton(x, weight, scale, use_scaled_mm=False), ref) < 1e-2


# ------------------------------------------------------------------ checkpoints


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8_base")
    save_tiny_llama(path, seed=5)
    return path


def quantize(w: torch.Tensor, layout: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Reference e4m3 quantization in each published layout -> (tensors, dequantized)."""
    if layout == "tensor":
        scale = w.abs().amax() / 448
        q = (w / scale).to(FP8)
        return ({"weight": q, "weight_scale": scale.reshape(()),
                 "input_scale": torch.tensor(0.05)}, q.float() * scale)
    if layout == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        q = (w / scale).to(FP8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    b = 32  # 2D blocks of b x b
    n, k = w.shape
    blocks = w.reshape(n // b, b, k // b, b).abs().amax((1, 3)) / 448
    full = blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)
    q = (w / full).to(FP8)
    return {"weight": q, "weight_scale_inv": blocks}, q.float() * full


QUANT_CONFIGS = {
    "tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "strategy": "channel"}}},
                "ignore": ["lm_head"]},
    "block": {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [32, 32]},
}


def write_pair(base: Path, out: Path, layout: str) -> tuple[Path, Path]:
    state = load_file(str(base / "model.safetensors"))
    quant, dense = {}, {}
    for name, tensor in state.items():
        if not any(f".{p}.weight" in name for p in LINEARS):
            quant[name] = dense[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        tensors, deq = quantize(tensor.float(), layout)
        quant.update({f"{prefix}.{key}": v.contiguous() for key, v in tensors.items()})
        dense[name] = deq.contiguous()
    qdir, ddir = out / "fp8", out / "dequantized"
    for d, tensors in ((qdir, quant), (ddir, dense)):
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        shutil.copy(base / "config.json", d / "config.json")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = QUANT_CONFIGS[layout]
    (qdir / "config.json").write_text(json.dumps(config))
    return qdir, ddir


@pytest.mark.parametrize("mode", ["kernels_mode", "dequant_mode"])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_checkpoint_matches_dequantized_twin(tiny_llama: Path, tmp_path: Path, layout: str,
                                                 mode: str, request: pytest.FixtureRequest
                                                 ) -> None:
    selection = request.getfixturevalue(mode)
    qdir, ddir = write_pair(tiny_llama, tmp_path, layout)
    quantized = load_model(qdir, device=DEVICE, kernel_selection=selection).model
    twin = load_model(ddir, device=DEVICE, kernel_selection=selection).model
    if mode == "kernels_mode":
        assert quantized.model.layers[0].mlp.down_proj.weight_fp8.dtype == FP8
    ids = list(range(5, 40))
    ours = SingleSequenceRunner(quantized).forward(ids)
    ref = SingleSequenceRunner(twin).forward(ids)
    assert rel_err(ours, ref) < 1e-5
