"""Each engine keeps the kernel selection it was built with (kernels/selection.py): two engines
in one process, one serving its quantized layers through the Triton kernels (the interpreter on
CPU), the other through weights dequantized at load, each running its own choice however their
builds and steps interleave."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flotilla.kernels.selection import KernelSelection, Selecting
from flotilla.services.engine.config import EngineConfig
from flotilla.services.engine.engine import Engine
from flotilla.services.engine.quant import gguf as gguf_method
from tests.engine.conftest import rel_error, save_tiny_llama


def _engine(path: Path, selection: KernelSelection) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", quantization="q8_0",
                               num_kv_blocks=32, block_size=4, kernel_selection=selection))


def _parts(engine: Engine) -> list[Selecting]:
    """Every part of the engine's model that dispatches (layers and their quant methods)."""
    return [p for m in engine.runner.model.modules() for p in (m, *vars(m).values())
            if isinstance(p, Selecting)]


def test_two_engines_in_one_process_keep_their_own_selection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_tiny_llama(tmp_path)
    calls: list[int] = []
    real = gguf_method.gguf_matmul_triton

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_method, "gguf_matmul_triton", spy)
    triton = KernelSelection(quant_kernels="triton")
    dequant = KernelSelection(quant_kernels="torch")
    a = _engine(tmp_path, triton)
    b = _engine(tmp_path, dequant)  # built second: a process-wide selection would be b's
    for engine, selection in ((a, triton), (b, dequant)):
        parts = _parts(engine)
        assert len(parts) > 10 and all(p.selection is selection for p in parts)
        assert engine.runner.sampler.selection is selection
    for engine, kept in ((a, True), (b, False)):  # blocks kept for the kernels, or dequantized
        methods = [p for p in _parts(engine) if isinstance(p, gguf_method.GGUFLinearMethod)]
        assert methods and all(m.kernels is kept for m in methods)
    prompt = list(range(5, 30))
    ref = b.prompt_logits(prompt)
    assert calls == []  # dequantized weights: torch matmuls only
    ours = a.prompt_logits(prompt)
    assert len(calls) >= 2 * 4  # the q8_0 kernels of both layers' linears (interpreter)
    calls.clear()
    again = b.prompt_logits(prompt)
    assert calls == [] and torch.equal(again, ref)
    assert rel_error(ours, ref) < 1e-4  # the same q8_0 weights either way
