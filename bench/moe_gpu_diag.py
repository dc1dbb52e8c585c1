"""Which GPU path breaks tiny MoE / MLA models? Greedy tokens through `LLM` on CUDA (fp32)
against transformers, with the Triton MLA kernel and the fused-MoE kernel each switched off in
turn, with and without CUDA graphs.   python bench/moe_gpu_diag.py"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402
from services.engine.layers.mla import MLAAttention  # noqa: E402
from services.engine.llm import LLM  # noqa: E402
from services.engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_moe_models import VOCAB, hf_greedy, save_tiny  # noqa: E402


def run(arch: str, mla: bool, moe: bool, eager: bool) -> str:
    MLAAttention.use_kernel = (  # type: ignore[method-assign]
        (lambda self, t: t.is_cuda) if mla else (lambda self, t: False))
    kernels.fused_moe_triton = fused_moe_triton if moe else fused_moe_ref  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory() as d:
        hf = save_tiny(Path(d), arch)
        llm = LLM(d, device="cuda", dtype="float32", num_kv_blocks=64, block_size=16,
                  enforce_eager=eager)
        gen = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 40, 90)]
        got = [r.token_ids for r in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
        want = [hf_greedy(hf, p, 12) for p in prompts]
        one = llm.generate(prompts[1:2], SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True))[0].token_ids
    same = [sum(1 for _ in iter_equal(a, b)) for a, b in zip(got, want, strict=True)]
    alone = sum(1 for _ in iter_equal(one, want[1]))
    return f"batched equal prefix {same}/12, prompt 1 alone equal {alone}"


def iter_equal(a: list[int], b: list[int]):  # type: ignore[no-untyped-def]
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def main() -> None:
    cases = [("deepseek_v3", True, True, False), ("deepseek_v3", False, True, False),
             ("deepseek_v3", True, False, False), ("deepseek_v3", False, False, False),
             ("deepseek_v3", False, False, True), ("qwen2_moe", False, True, False),
             ("qwen2_moe", False, False, False)]
    for arch, mla, moe, eager in cases:
        try:
            res = run(arch, mla, moe, eager)
        except Exception as exc:  # noqa: BLE001
            res = f"error {exc!r}"[:200]
        print(f"{arch:12s} mla_kernel={mla!s:5s} fused_moe={moe!s:5s} eager={eager!s:5s} {res}",
              flush=True)


if __name__ == "__main__":
    main()
