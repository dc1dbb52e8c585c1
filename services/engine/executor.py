"""Executors run the model for the Engine: in this process alone, or on every rank of a
tensor-parallel pod (docs/tensor_parallel.md).

Rules:
- The Engine talks to an Executor, never to a ModelRunner directly: `launch` / `execute` /
  `all_logits` as on a ModelRunner. `runner` is rank 0's ModelRunner (KV size, device, stats).
- `make_executor` picks by the pod layout (pod.py): one rank -> UniProcExecutor, several ->
  MultiProcExecutor (multiproc_executor.py), which fails with TensorParallelError when a rank
  fails and calls the `on_failure` callbacks at once, from any thread.
- `shutdown` releases the workers; a single process has none.
- `make_executor` refuses to start an engine that would launch Triton kernels without Triton
  (`require_kernels`: on CUDA, or with quant_kernels=triton on CPU).
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from flotilla.kernels.triton_compat import require_triton
from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.model_runner import ModelRunner
from flotilla.services.engine.pod import pod_layout
from flotilla.services.engine.scheduler import ScheduledRequest
from flotilla.services.engine.step_output import LaunchedStep, RunnerOutput


class TensorParallelError(RuntimeError):
    """A rank of the pod failed; the pod cannot go on."""


class Executor(ABC):
    runner: ModelRunner
    supports_pooling = False  # pool_hidden runs (tensor-parallel pods: not yet)

    @abstractmethod
    def launch(self, requests: list[ScheduledRequest], decode_only: bool,
               prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on every rank; its tokens come from the returned LaunchedStep."""

    def execute(self, requests: list[ScheduledRequest], decode_only: bool) -> RunnerOutput:
        """Run one step and wait for its tokens."""
        return self.launch(requests, decode_only).result()

    @abstractmethod
    def all_logits(self, request: ScheduledRequest) -> torch.Tensor:
        """Logits of every new token of one sequence, float32 [n, vocab] on the host."""

    def pool_hidden(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        """Final-normed hidden states of every new token of the requests, in order, on the
        device (pooling requests: nothing sampled)."""
        raise NotImplementedError("pooling is not supported by this executor")

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (from any thread) when a rank fails; a single process never does."""
        return None

    def shutdown(self) -> None:
        """Release the workers; the executor is unusable afterwards."""
        return None


class UniProcExecutor(Executor):
    supports_pooling = True

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.runner = ModelRunner(config, model_path)

    def launch(self, requests: list[ScheduledRequest], decode_only: bool,
               prev: LaunchedStep | None = None) -> LaunchedStep:
        return self.runner.launch(requests, decode_only, prev)

    def all_logits(self, request: ScheduledRequest) -> torch.Tensor:
        return self.runner.all_logits(request)

    def pool_hidden(self, requests: list[ScheduledRequest]) -> torch.Tensor:
        return self.runner.pool_hidden(requests)


def require_kernels(config: EngineConfig) -> None:
    """Refuse to start where the engine would run Triton kernels and Triton is not installed
    (kernels/triton_compat.py): on CUDA, or with the quantized kernels forced on CPU."""
    if config.resolved_device.startswith("cuda"):
        require_triton(f"the engine on {config.resolved_device}")
    if config.kernel_selection.quant_kernels == "triton":
        require_triton("quant_kernels=triton (FLOTILLA_QUANT_KERNELS)")


def make_executor(config: EngineConfig, model_path: str) -> Executor:
    require_kernels(config)
    layout = pod_layout(config)
    if layout.world_size == 1:
        if config.device_ids:  # one chosen GPU
            device = torch.device(layout.devices[0])
            if device.type == "cuda":
                torch.cuda.set_device(device)
            config = dataclasses.replace(config, device=str(device))
        return UniProcExecutor(config, model_path)
    if layout.torchrun and int(os.environ["RANK"]) != 0:
        raise RuntimeError("an Engine runs on rank 0 only; other ranks run the worker loop")
    from flotilla.services.engine.multiproc_executor import MultiProcExecutor  # only for a pod

    return MultiProcExecutor(config, model_path, layout)
