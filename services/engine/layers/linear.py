"""Tensor-parallel linear layers (nano-vllm / vLLM style) over a pluggable `QuantMethod`.

Rules:
- Every parameter carries `weight_loader(param, loaded_weight[, shard_id])`: the layer narrows
  the full checkpoint tensor to this rank's shard (and, for fused layers, to the sub-block named by
  `shard_id`) and hands both views to `quant_method.load`.
- Column-parallel layers split the output dimension across ranks; their output stays sharded.
  Row-parallel layers split the input dimension and all-reduce the output (bias added once).
- Fused layers: `QKVParallelLinear` packs q, k, v (shard ids "q", "k", "v");
  `MergedColumnParallelLinear` packs several column blocks (shard ids 0, 1, ...). Shard id None
  means the checkpoint tensor is already fused in the same order; it is split and loaded per block.
- Parameters are created in the torch default dtype and device, so the loader sets those once.
"""

from __future__ import annotations

import torch
from torch import nn

from flotilla.services.engine.distributed import divide, get_tp_rank, get_tp_size, tp_all_reduce
from flotilla.services.engine.quant.base import QuantConfig, get_quant_method


class LinearBase(nn.Module):
    """y = x W^T + b on this rank's shard; `input_size`/`output_size` are per-rank sizes."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        quant_config: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.quant_method = get_quant_method(quant_config, self, prefix)
        self.quant_method.create_weights(self, input_size, output_size, torch.get_default_dtype())
        self.weight.weight_loader = self.weight_loader  # type: ignore[union-attr]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.quant_method.load(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        tp = get_tp_size()
        super().__init__(input_size, divide(output_size, tp, "output size"), bias, quant_config,
                         prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.data.size(0)
        self.quant_method.load(param.data, loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel blocks in one matmul (e.g. gate and up); shard id = block index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None:  # checkpoint already fused (phi3 / glm gate_up_proj)
            for i, block in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, block, i)
            return
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        dst = param.data.narrow(0, offset, size)
        self.quant_method.load(dst, loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks.

    With fewer kv heads than ranks, kv heads are replicated: rank r holds kv head
    r // (tp_size // total_num_kv_heads).
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp, "attention head count")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "kv head count")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, total_num_kv_heads, "tp size over kv heads")
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output, bias, quant_config, prefix)

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None
    ) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # checkpoint already fused (phi3 qkv_proj): split the full q, k, v
            full_kv = kv_size * self.tp_size // self.kv_replicas
            blocks = loaded.split([q_size * self.tp_size, full_kv, full_kv], dim=0)
            for sid, block in zip("qkv", blocks, strict=True):
                self.weight_loader(param, block, sid)
            return
        if shard_id == "q":
            offset, size, src_index = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, src_index = kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        dst = param.data.narrow(0, offset, size)
        self.quant_method.load(dst, loaded.narrow(0, src_index * size, size))


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; output all-reduced, bias added on rank 0 only."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "") -> None:
        tp = get_tp_size()
        super().__init__(divide(input_size, tp, "input size"), output_size, bias, quant_config,
                         prefix)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.data.dim() == 1:  # bias: replicated
            self.quant_method.load(param.data, loaded)
            return
        size = param.data.size(1)
        self.quant_method.load(param.data, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return tp_all_reduce(y) if self.tp_size > 1 else y
