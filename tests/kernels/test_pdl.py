"""Programmatic dependent launch (kernels/pdl.py): when it is used, where its wait lands in the
SASS (no load of an activation can precede it), and (GPU) a decode-like chain of PDL kernels
replayed from a CUDA graph gives the results of plain launches."""

from __future__ import annotations

import pytest
import torch

from flotilla.kernels import pdl
from flotilla.kernels.selection import KernelSelection
from tests.kernels.sm90_report import needs_ptxas, sm90_report


def test_off_the_gpu_kernels_launch_without_pdl() -> None:
    assert pdl.pdl_args(torch.zeros(1), "1") == {"USE_PDL": 0}


def test_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="pdl"):
        KernelSelection(pdl="yes")  # type: ignore[arg-type]


@pytest.mark.slow
@needs_ptxas
def test_the_wait_precedes_every_activation_load() -> None:
    """The GEMVs (with and without prefetch) wait once their first step's weight words are
    in: exactly those loads (per thread, 4 rows x 2 16-byte loads; Q4_K also a 16-byte scale
    word a row) come before the waits, every other load after the last one. Elsewhere (the
    norm) ptxas puts the wait (ACQBULK) before every global load."""
    prefetched = {"w4a16": 4 * 2, "q4k": 4 * 3, "fp8": 4 * 2}
    found = sm90_report("tests.kernels.pdl_sm90", timeout=900)
    assert len(found) == 7
    for name, r in found.items():
        assert r["acqbulk"], name
        first, last = min(r["acqbulk"]), max(r["acqbulk"])
        before = [i for i in r["ldg"] if i < first]
        assert not [i for i in r["ldg"] if first < i < last], name
        want = prefetched.get(name.split()[0], 0)
        assert len(before) == want, (name, r)


@pytest.mark.gpu
def test_gpu_graph_of_pdl_kernels_matches_plain_launches() -> None:
    """norm -> GEMV -> norm -> gated GEMV -> GEMV, 8 times over, each reading the one before:
    a CUDA graph of PDL launches equals plain eager launches bit for bit."""
    from flotilla.kernels.gemv import gemv_triton
    from flotilla.kernels.rms_norm import fused_add_rms_norm_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    h, inter = 1024, 2048
    weights = [(torch.randn(h, h, device="cuda", generator=g) / 32).bfloat16(),
               (torch.randn(2 * inter, h, device="cuda", generator=g) / 32).bfloat16(),
               (torch.randn(h, inter, device="cuda", generator=g) / 64).bfloat16()]
    norm_w = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn(1, h, device="cuda", generator=g).bfloat16()

    def chain(x: torch.Tensor, mode: str) -> torch.Tensor:
        res = x
        for _ in range(8):
            y, res = fused_add_rms_norm_triton(x, res, norm_w, 1e-6, pdl=mode)
            y, res = fused_add_rms_norm_triton(gemv_triton(y, weights[0], pdl=mode), res, norm_w,
                                               1e-6, pdl=mode)
            x = gemv_triton(gemv_triton(y, weights[1], gated=True, pdl=mode), weights[2],
                            pdl=mode)
        return x + res

    for mode in ("0", "1"):
        eager = chain(x0, mode)  # also tunes before the capture
        if mode == "0":
            want = eager
            continue
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(x0, mode)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), mode
