"""Our torch GGUF quantizers (in-situ quantization) against gguf.quants.

Legacy types: byte-identical to gguf.quants.quantize. K-quants (which gguf.quants cannot
quantize): gguf.quants.dequantize must read our blocks back to the original weights within the
error a round-to-nearest quantizer of that width makes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from flotilla.kernels.gguf_dequant import GGUF_TYPES, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from flotilla.services.engine.quant.gguf_quantize import LEGACY_TYPES, quantize_gguf
from tests.quant.conftest import rel_err

LEGACY = list(LEGACY_TYPES)
# relative RMS error bound of each k-quant on Gaussian weights (observed ~0.33, 0.15, 0.078,
# 0.038, 0.019: about half per extra bit)
K_QUANT_BOUNDS = {Q2_K: 0.40, Q3_K: 0.19, Q4_K: 0.10, Q5_K: 0.05, Q6_K: 0.025}


def weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[1, :32] = 0.0  # an all-zero block
    w[2, 64:96] = 0.3  # a constant block
    return w


@pytest.mark.parametrize("qtype", LEGACY, ids=[GGUF_TYPES[q].name for q in LEGACY])
def test_legacy_types_are_byte_identical_to_gguf_quants(qtype: int) -> None:
    w = weights(16, 256)
    ours = quantize_gguf(w, qtype).numpy()
    ref = quantize(w.numpy(), GGMLQuantizationType(qtype))
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", sorted(K_QUANT_BOUNDS),
                         ids=[GGUF_TYPES[q].name for q in sorted(K_QUANT_BOUNDS)])
def test_k_quants_decode_with_gguf_quants(qtype: int) -> None:
    w = weights(16, 512)
    blocks = quantize_gguf(w, qtype)
    assert blocks.shape == (16, 2 * GGUF_TYPES[qtype].type_size)
    back = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType(qtype)))
    assert rel_err(back, w) < K_QUANT_BOUNDS[qtype]
    assert back[1, :32].abs().max() == 0  # zero blocks stay exactly zero


def test_quantizer_rejects_partial_blocks() -> None:
    with pytest.raises(ValueError, match="divisible by 256"):
        quantize_gguf(torch.randn(4, 320), Q4_K)
