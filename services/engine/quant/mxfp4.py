"""MXFP4 experts (gpt-oss checkpoints, config.json `quantization_config` quant_method "mxfp4").

Rules:
- Only the routed experts are MXFP4 (the checkpoint's `*_blocks` / `*_scales`); everything else
  (attention, router, embeddings, LM head: `modules_to_not_convert`) is float and served as such.
- Each expert stack keeps `blocks` uint8 [E_local, out, in / 2] and `scales` uint8
  [E_local, out, in / 32] (kernels/mxfp4_moe.py layout; gpt-oss's interleaved gate/up rows are
  split by the model into the stack's gate and up halves while loading).
- GGUF files (llama.cpp's gpt-oss conversion) store MXFP4 in ggml blocks of 17 bytes: the E8M0
  scale, then 16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31;
  `from_ggml_mxfp4` repacks them into the layout above.
- Where the quantized kernels run (CUDA, or FLOTILLA_QUANT_KERNELS=triton) the weights stay
  MXFP4 in memory and kernels/mxfp4_moe.py decodes them in registers (about 4.25 bits a
  weight); elsewhere (the CPU engine) they are dequantized once after loading to the model
  dtype and run through the float fused MoE.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from flotilla import kernels
from flotilla.kernels.mxfp4_moe import MXFP4_BLOCK, dequantize_mxfp4_ref, fused_moe_mxfp4_triton
from flotilla.services.engine.quant.base import (
    ExpertQuantMethod,
    QuantConfig,
    QuantMethod,
    UnquantizedLinearMethod,
    layer_tensor,
    use_kernels,
)

GGML_MXFP4_BYTES = 1 + MXFP4_BLOCK // 2  # scale + 16 bytes of nibbles


def from_ggml_mxfp4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 [..., K / 32 * 17] -> (blocks [..., K / 2], scales [..., K / 32])."""
    groups = raw.unflatten(-1, (-1, GGML_MXFP4_BYTES))
    scales, nibbles = groups[..., 0], groups[..., 1:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)  # values 0..31 in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.flatten(-2).contiguous(), scales.contiguous()


if TYPE_CHECKING:  # layers import the quant package: no import at run time
    from flotilla.services.engine.layers.moe import MoEExperts


class Mxfp4ExpertMethod(ExpertQuantMethod):
    def __init__(self) -> None:
        self.kernels = False
        self.dtype = torch.get_default_dtype()  # the model's: models are built under it

    def create_weights(self, stack: nn.Module, num_local: int, out_size: int,
                       in_size: int) -> None:
        if in_size % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts need an input size divisible by {MXFP4_BLOCK}, "
                             f"got {in_size}")
        for name, cols in (("blocks", in_size // 2), ("scales", in_size // MXFP4_BLOCK)):
            stack.register_parameter(name, nn.Parameter(
                torch.empty(num_local, out_size, cols, dtype=torch.uint8), requires_grad=False))

    def process_after_loading(self, experts: nn.Module) -> None:
        moe = cast("MoEExperts", experts)
        self.kernels = use_kernels(layer_tensor(moe.w13, "blocks").device,
                                   self.selection.quant_kernels)
        if self.kernels:
            return
        for stack in (moe.w13, moe.w2):
            dense = dequantize_mxfp4_ref(layer_tensor(stack, "blocks").data,
                                         layer_tensor(stack, "scales").data, self.dtype)
            delattr(stack, "blocks")
            delattr(stack, "scales")
            stack.register_buffer("weight", dense, persistent=False)

    def apply(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        moe = cast("MoEExperts", experts)
        w13, w2 = moe.w13, moe.w2
        if not self.kernels:
            return kernels.fused_moe(x, layer_tensor(w13, "weight"), layer_tensor(w2, "weight"),
                                     topk_weights, topk_ids, w13.bias, w2.bias, moe.swiglu,
                                     selection=self.selection)
        return fused_moe_mxfp4_triton(
            x, layer_tensor(w13, "blocks"), layer_tensor(w13, "scales"),
            layer_tensor(w2, "blocks"), layer_tensor(w2, "scales"), topk_weights, topk_ids,
            w13.bias, w2.bias, moe.swiglu)


class Mxfp4Config(QuantConfig):
    name = "mxfp4"

    def get_method(self, layer: nn.Module, prefix: str) -> QuantMethod:
        return UnquantizedLinearMethod()

    def get_expert_method(self, prefix: str) -> ExpertQuantMethod | None:
        return Mxfp4ExpertMethod()

    @classmethod
    def from_hf(cls, qcfg: dict[str, Any], tensor_names: Collection[str]) -> Mxfp4Config:
        """Only gpt-oss-style MXFP4 experts exist: a checkpoint whose model has none fails
        loading with its expert weights missing."""
        return cls()
