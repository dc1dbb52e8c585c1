"""A Qwen3-MoE-shaped GGUF in llama.cpp's Q4_K_M type mix (random weights, our quantizer;
bench/gguf_moe_file.py) is served with every matrix still quantized: the q/k/v layers whose
v_proj is Q6_K as two block matrices (quant/gguf_parts.py), the experts as their stacks' blocks
(quant/gguf_moe.py, kernels/gguf_moe.py under the interpreter), the LM head as its Q6_K
blocks. Its logits equal those of the same file loaded the reference way (every tensor
dequantized by gguf.quants at load time); so do those of the dequantizing CPU path
(quantization "gguf" without the kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gguf_moe_file import MoEShape, file_types, write_qwen3_moe_gguf
from flotilla.kernels.gguf_dequant import Q4_K, Q6_K
from flotilla.kernels.selection import KernelSelection
from flotilla.services.engine.layers.moe_offload import ExpertOffload
from flotilla.services.engine.loader import load_model
from flotilla.services.engine.quant import GGUFLinearMethod
from flotilla.services.engine.quant.gguf_moe import GGUFExpertMethod
from flotilla.services.engine.quant.gguf_parts import GGUFPartsLinearMethod
from tests.engine.conftest import SingleSequenceRunner
from tests.quant.conftest import DEVICE

SHAPE = MoEShape(vocab=256, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, experts=4,
                 top_k=2, moe_inter=256, context=256)
# float tensors a GGUF-served model keeps: norms, the token embedding, the routers
FLOAT_OK = ("norm.weight", "embed_tokens.weight", "mlp.gate.weight")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_gguf(tmp_path_factory.mktemp("q4km") / "qwen3moe-Q4_K_M.gguf", SHAPE)


def test_file_has_llama_cpp_q4_k_m_mix(gguf_file: Path) -> None:
    types = file_types(gguf_file)
    assert types["blk.0.attn_v.weight"] == Q4_K and types["blk.3.attn_v.weight"] == Q6_K
    assert types["blk.2.ffn_down_exps.weight"] == Q6_K
    assert types["blk.1.ffn_down_exps.weight"] == Q4_K


def test_every_matrix_stays_quantized_and_logits_match_dequantized(
        gguf_file: Path, kernels_mode: KernelSelection) -> None:
    reference = load_model(gguf_file).model  # gguf.quants-dequantized float32
    model = load_model(gguf_file, quantization="gguf", device=DEVICE,
                       kernel_selection=kernels_mode).model
    floats = [name for name, t in (*model.named_parameters(), *model.named_buffers())
              if t.is_floating_point() and t.dim() >= 2 and not name.endswith(FLOAT_OK)
              and "rotary" not in name and "cos_sin" not in name]
    assert floats == []
    methods = {type(m.quant_method) for m in model.modules() if hasattr(m, "quant_method")
               and m.quant_method is not None}
    assert {GGUFLinearMethod, GGUFPartsLinearMethod, GGUFExpertMethod} <= methods
    assert model.lm_head.qweight.dtype == torch.uint8  # output.weight's Q6_K blocks
    assert model.lm_head.qweight.shape == (SHAPE.vocab, SHAPE.hidden // 256 * 210)
    layer3 = model.model.layers[3]
    assert [p[2] for p in layer3.self_attn.qkv_proj.quant_method.parts] == [Q4_K, Q6_K]
    assert layer3.mlp.experts.quant_method.quant_types == {2: [Q4_K], 1: [Q6_K]}
    assert layer3.mlp.experts.w2.qweight_0.shape == (SHAPE.experts, SHAPE.hidden, 210)
    ids = [3, 17, 250, 9, 64, 128, 7]
    ours = SingleSequenceRunner(model, max_tokens=32).forward(ids).cpu()
    ref = SingleSequenceRunner(reference, max_tokens=32).forward(ids)
    err = float((ours - ref).norm() / ref.norm())
    assert err < 1e-4, err
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_gguf_without_kernels_dequantizes_after_loading(gguf_file: Path,
                                                       dequant_mode: KernelSelection) -> None:
    reference = load_model(gguf_file).model
    model = load_model(gguf_file, quantization="gguf", kernel_selection=dequant_mode).model
    assert model.model.layers[0].mlp.experts.w13.weight.dtype == torch.float32
    ids = [1, 2, 3, 200]
    ours = SingleSequenceRunner(model, max_tokens=16).forward(ids)
    ref = SingleSequenceRunner(reference, max_tokens=16).forward(ids)
    assert float((ours - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_offloaded_gguf_experts_match_dequantized(gguf_file: Path, mode: str) -> None:
    """Half of each layer's experts in host memory (layers/moe_offload.py): the host set is a
    second GGUFExpertMethod (CPU: dequantized there; stream: the blocks, staged per step)."""
    reference = load_model(gguf_file).model
    # on a GPU the host set runs its CPU path (the kernels' auto choice); on CPU the interpreter
    selection = KernelSelection(quant_kernels="triton" if DEVICE == "cpu" else "auto")
    model = load_model(gguf_file, quantization="gguf", device=DEVICE,
                       expert_offload=ExpertOffload(experts_per_rank=2, mode=mode),
                       kernel_selection=selection).model
    experts = model.model.layers[0].mlp.experts
    assert experts.host is not None and experts.w13.qweight_0.shape[0] == 2
    ids = [3, 17, 250, 9]
    ours = SingleSequenceRunner(model, max_tokens=16).forward(ids).cpu()
    ref = SingleSequenceRunner(reference, max_tokens=16).forward(ids)
    assert float((ours - ref).norm() / ref.norm()) < 1e-4
