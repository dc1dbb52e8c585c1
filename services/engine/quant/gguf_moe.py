"""GGUF MoE experts kept in the file's blocks (Qwen3-MoE, Mixtral, DeepSeek GGUFs, ...).

Rules:
- A GGUF stores each layer's experts as three stacks (ffn_gate_exps, ffn_up_exps,
  ffn_down_exps), each of one ggml type; llama.cpp's mixed recipes (Q4_K_M) give down a wider
  type than gate / up in some layers. When every stack of a layer has a type the kernels decode
  (kernels/gguf_dequant.py), `GGUFConfig.get_expert_method` gives that layer a
  `GGUFExpertMethod` and the loader passes the stacks' blocks per expert (QuantBytes).
- While loading, each MoEExperts stack (w13 = [gate; up], w2 = down) is `weight` uint8
  [E_local, rows, widest row_bytes]; an expert's block rows fill the first row_bytes of its
  type. After loading, runs of rows of one type become `QuantPart`s (kernels/gguf_moe.py): one
  contiguous uint8 [E_local, rows, row_bytes] buffer each (`qweight_{i}` on the stack); a stack
  of one type keeps its loading buffer as it is (no copy).
- Where the quantized kernels run (CUDA, or FLOTILLA_QUANT_KERNELS=triton) the experts run
  kernels/gguf_moe.py's fused MoE, decoding blocks in registers; elsewhere (the CPU engine) the
  stacks are dequantized once after loading to the model dtype and run through the float fused
  MoE (as quant/mxfp4.py does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from flotilla import kernels
from flotilla.kernels.gguf_dequant import GGUF_TYPES, gguf_type
from flotilla.kernels.gguf_moe import QuantPart, dequantize_parts, fused_moe_gguf_triton
from flotilla.services.engine.quant.base import ExpertQuantMethod, layer_tensor, use_kernels

if TYPE_CHECKING:  # layers import the quant package: no import at run time
    from flotilla.services.engine.layers.moe import ExpertStack, MoEExperts

EXPERT_ROLES = ("gate", "up", "down")
# HF expert projection names (Mixtral's w1 / w3 / w2) -> role
_ROLE_OF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate",
            "w3": "up", "w2": "down"}


def expert_stack(ckpt_name: str) -> tuple[str, str] | None:
    """(MoE experts module prefix, role) of a per-expert checkpoint name
    (`model.layers.3.mlp.experts.{e}.up_proj.weight` -> (`model.layers.3.mlp.experts`, "up")),
    None for other names. Mixtral's `block_sparse_moe` is the model's `mlp` slot."""
    head, sep, tail = ckpt_name.partition(".experts.")
    if not sep or tail.count(".") != 2 or not tail.endswith(".weight"):
        return None
    role = _ROLE_OF.get(tail.split(".")[1])
    if role is None:
        return None
    return f"{head.replace('.block_sparse_moe', '.mlp')}.experts", role


def _row_bytes(in_size: int, qtype: int) -> int:
    t = GGUF_TYPES[qtype]
    return in_size // t.qk * t.type_size


class GGUFExpertMethod(ExpertQuantMethod):
    """`types`: the ggml type of the gate, up and down stacks (see the module rules)."""

    def __init__(self, types: Sequence[int]) -> None:
        gate, up, down = (int(t) for t in types)
        for t in (gate, up, down):
            gguf_type(t)  # raises for a type without kernels
        self.part_types = {2: (gate, up), 1: (down,)}  # stack parts -> type of each part
        self.in_size: dict[int, int] = {}  # stack parts -> input size
        self.quant_types: dict[int, list[int]] = {}  # stack parts -> type of each QuantPart
        self.kernels = False
        self.dtype = torch.get_default_dtype()  # the model's: models are built under it

    def create_weights(self, stack: nn.Module, num_local: int, out_size: int,
                       in_size: int) -> None:
        parts = out_size // cast("ExpertStack", stack).part_rows
        types = self.part_types[parts]
        for t in types:
            if in_size % GGUF_TYPES[t].qk:
                raise ValueError(f"{GGUF_TYPES[t].name} experts need an input size divisible by "
                                 f"{GGUF_TYPES[t].qk}, got {in_size}")
        self.in_size[parts] = in_size
        widest = max(_row_bytes(in_size, t) for t in types)
        stack.register_parameter("weight", nn.Parameter(
            torch.zeros(num_local, out_size, widest, dtype=torch.uint8), requires_grad=False))

    @staticmethod
    def _count(stack: nn.Module) -> int:
        """Row blocks of the stack: 2 (w13: gate, up) or 1 (w2: down)."""
        s = cast("ExpertStack", stack)
        return int(layer_tensor(s, "weight").shape[1]) // s.part_rows

    def load(self, stack: nn.Module, dst: torch.Tensor, loaded: torch.Tensor, part: int) -> None:
        count = self._count(stack)
        want = self.part_types[count][part]
        qtype = getattr(loaded, "qtype", None)
        if qtype != want:
            found = GGUF_TYPES[qtype].name if qtype in GGUF_TYPES else f"{loaded.dtype} floats"
            raise ValueError(f"expected {GGUF_TYPES[want].name} expert blocks, got {found}")
        row_bytes = _row_bytes(self.in_size[count], want)
        if tuple(loaded.shape) != (dst.shape[0], row_bytes):
            raise ValueError(f"expert blocks {tuple(loaded.shape)} do not fit {dst.shape[0]} "
                             f"rows of {row_bytes} bytes")
        dst[:, :row_bytes].copy_(loaded.as_subclass(torch.Tensor))

    def _parts(self, stack: nn.Module) -> list[QuantPart]:
        weight = layer_tensor(stack, "weight").data
        count = self._count(stack)
        types = self.part_types[count]
        rows, in_size = cast("ExpertStack", stack).part_rows, self.in_size[count]
        if len(set(types)) == 1 and weight.shape[2] == _row_bytes(in_size, types[0]):
            return [QuantPart(weight, types[0])]
        parts: list[QuantPart] = []
        first = 0
        for i, t in enumerate(types):
            if i + 1 < len(types) and types[i + 1] == t:
                continue  # joined with the next part
            end = (i + 1) * rows
            parts.append(QuantPart(
                weight[:, first:end, :_row_bytes(in_size, t)].contiguous(), t))
            first = end
        return parts

    def process_after_loading(self, experts: nn.Module) -> None:
        moe = cast("MoEExperts", experts)
        self.kernels = use_kernels(layer_tensor(moe.w13, "weight").device,
                                   self.selection.quant_kernels)
        for stack in (moe.w13, moe.w2):
            count = self._count(stack)
            parts = self._parts(stack)
            del stack.weight
            if self.kernels:
                self.quant_types[count] = [p.qtype for p in parts]
                for i, part in enumerate(parts):
                    stack.register_buffer(f"qweight_{i}", part.blocks, persistent=False)
            else:
                stack.register_buffer("weight", dequantize_parts(parts, self.dtype),
                                      persistent=False)

    def quant_parts(self, stack: nn.Module, count: int) -> list[QuantPart]:
        """The kernels' parts of stack w13 (count 2) or w2 (count 1)."""
        return [QuantPart(layer_tensor(stack, f"qweight_{i}"), t)
                for i, t in enumerate(self.quant_types[count])]

    def apply(self, experts: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        moe = cast("MoEExperts", experts)
        if not self.kernels:
            return kernels.fused_moe(x, layer_tensor(moe.w13, "weight"),
                                     layer_tensor(moe.w2, "weight"), topk_weights, topk_ids,
                                     selection=self.selection)
        return fused_moe_gguf_triton(x, self.quant_parts(moe.w13, 2),
                                     self.quant_parts(moe.w2, 1), topk_weights, topk_ids)


__all__ = ["EXPERT_ROLES", "GGUFExpertMethod", "expert_stack"]
