"""MoE expert offload (services/engine/layers/moe_offload.py): where each flag puts which
experts on every tensor-parallel rank, the split forward against the unsplit layer (float and
int4 experts, both modes), and a tiny Qwen3-MoE through the engine with --n-cpu-moe 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flotilla.services.engine.layers import moe as moe_layer
from flotilla.services.engine.layers.moe import MoEExperts
from flotilla.services.engine.layers.moe_offload import (
    ExpertOffload,
    building,
    layer_index,
    summary,
)
from flotilla.services.engine.llm import LLM
from flotilla.services.engine.quant.base import ExpertQuantMethod
from flotilla.services.engine.quant.int4_experts import Int4ExpertMethod
from flotilla.services.engine.sampling_params import SamplingParams
from tests.engine.conftest import SingleSequenceRunner
from tests.engine.test_moe_models import VOCAB, save_tiny

E, H, INTER, TOP_K = 8, 64, 32, 3


def _set_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    monkeypatch.setattr(moe_layer, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(moe_layer, "get_tp_size", lambda: size)


def _expert_weights(seed: int = 0) -> dict[tuple[int, str, int], torch.Tensor]:
    """(expert, stack, part) -> a checkpoint tensor, as the loader hands them over."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for part in (0, 1):
            out[e, "w13", part] = torch.randn(INTER, H, generator=gen) * 0.2
        out[e, "w2", 0] = torch.randn(H, INTER, generator=gen) * 0.2
    return out


def _build(
    offload: ExpertOffload,
    prefix: str = "model.layers.0.mlp",
    method: Callable[[], ExpertQuantMethod | None] = lambda: None,
    dtype: torch.dtype = torch.float32,
) -> MoEExperts:
    """A layer's experts built as the loader builds them, loaded and post-processed."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with building(offload):
            experts = MoEExperts(
                E, H, INTER, quant_method=method(), prefix=prefix, host_method=method()
            )
        for (e, stack, part), t in _expert_weights().items():
            param = getattr(experts, stack).weight
            param.weight_loader(param, t.to(dtype), f"{e}:{part}")
        for module in experts.modules():
            post = getattr(module, "quant_method", None)
            if post is not None:
                post.process_after_loading(module)
    finally:
        torch.set_default_dtype(previous)
    return experts


@pytest.mark.parametrize(
    ("offload", "layer", "host"),
    [
        (ExpertOffload(), 0, 0),
        (ExpertOffload(all_layers=True), 5, 4),  # --cpu-moe: every layer, all of a rank's
        (ExpertOffload(first_layers=2), 1, 4),  # --n-cpu-moe 2: decoder layers 0 and 1 ...
        (ExpertOffload(first_layers=2), 2, 0),  # ... not 2
        (ExpertOffload(experts_per_rank=3), 7, 3),  # the seeds' flag: last 3 of each rank
        (ExpertOffload(experts_per_rank=1, first_layers=1), 0, 4),
        (ExpertOffload(experts_per_rank=1, first_layers=1), 1, 1),
    ],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_placement_per_flag_and_rank(
    monkeypatch: pytest.MonkeyPatch, offload: ExpertOffload, layer: int, host: int, rank: int
) -> None:
    """tp=2: rank r owns experts [4r, 4r + 4); its last `host` experts are built on the host
    and the checkpoint's tensors of exactly those experts land there."""
    _set_rank(monkeypatch, rank, 2)
    experts = _build(offload, prefix=f"model.layers.{layer}.mlp")
    own = range(4 * rank, 4 * rank + 4)
    on_device = list(own)[: 4 - host]
    weights = _expert_weights()
    assert experts.w13.weight.shape[0] == len(on_device)
    for i, e in enumerate(on_device):
        assert torch.equal(experts.w2.weight[i], weights[e, "w2", 0])
    if not host:
        assert experts.host is None
        return
    assert experts.host is not None
    host_w13 = experts.host.w13.weight
    assert host_w13.device.type == "cpu" and host_w13.shape[0] == host
    for i, e in enumerate(list(own)[4 - host :]):
        assert torch.equal(host_w13[i, :INTER], weights[e, "w13", 0])
        assert torch.equal(host_w13[i, INTER:], weights[e, "w13", 1])


def test_too_many_experts_per_rank_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _set_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="owns 4 experts"):
        _build(ExpertOffload(experts_per_rank=5))


def test_layer_index_from_prefix() -> None:
    assert layer_index("model.layers.12.mlp") == 12
    assert layer_index("mlp") is None


def _routing(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    return x, weights, ids


METHODS: dict[str, Callable[[], ExpertQuantMethod | None]] = {
    "float": lambda: None,
    "int4": Int4ExpertMethod,
}


@pytest.mark.parametrize("mode", ["cpu", "stream"])
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 2)])
@pytest.mark.parametrize("per_rank", [1, 2, 4])
def test_split_forward_equals_unsplit_fp32(
    monkeypatch: pytest.MonkeyPatch, mode: str, method: str, rank: int, size: int, per_rank: int
) -> None:
    """fp32 activations, tokens routed to both sides included: "cpu" is bit for bit the
    unsplit layer (float experts, or int4 experts run by torch's int4 CPU matmul); "stream"
    adds its staged experts' sum at once, equal up to fp32 rounding."""
    _set_rank(monkeypatch, rank, size)
    per_rank = min(per_rank, E // size)
    unsplit = _build(ExpertOffload(), method=METHODS[method])
    split = _build(
        ExpertOffload(experts_per_rank=per_rank, mode=mode),  # type: ignore[arg-type]
        method=METHODS[method],
    )
    assert split.host is not None and split.host.count == per_rank
    x, weights, ids = _routing(12)
    ref = unsplit(x, weights, ids)
    assert ref.abs().sum() > 0
    got = split(x, weights, ids)
    if mode == "cpu":
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_split_forward_bf16_within_one_rounding() -> None:
    """bf16: the device side's sum and each host expert's rows are rounded to bf16 before they
    are added (the unsplit layer rounds its fp32 sum once), so tokens routed to both sides may
    differ by a few bf16 roundings of the row's scale; the others are equal."""
    unsplit = _build(ExpertOffload(), dtype=torch.bfloat16)
    split = _build(ExpertOffload(experts_per_rank=3), dtype=torch.bfloat16)
    x, weights, ids = _routing(32)
    x = x.bfloat16()
    ref, got = unsplit(x, weights, ids), split(x, weights, ids)
    host = ids >= E - 3
    one_side = host.all(1) | ~host.any(1)
    assert one_side.any() and (~one_side).any()
    assert torch.equal(got[one_side], ref[one_side])
    diff = (got.float() - ref.float()).abs().amax(1)
    assert (diff <= TOP_K * 2**-7 * ref.float().abs().amax(1)).all()


def test_int4_experts_match_their_dequantized_floats() -> None:
    """The int4 expert set against kernels' float reference over its own dequantized groups
    (quant/int4.py's grid), so the split test's reference is itself checked."""
    from flotilla.kernels import fused_moe_ref
    from flotilla.services.engine.quant.int4 import quantize_groups

    experts = _build(ExpertOffload(), method=Int4ExpertMethod)
    weights = _expert_weights()

    def dequant(t: torch.Tensor) -> torch.Tensor:
        q, scale, offset = quantize_groups(t)
        w = q.float().unflatten(-1, (-1, 32)) * scale[..., None] + offset[..., None]
        return w.flatten(-2).bfloat16().float()  # the matmul's bf16 scale/zero are close

    w13 = torch.stack(
        [dequant(torch.cat([weights[e, "w13", 0], weights[e, "w13", 1]])) for e in range(E)]
    )
    w2 = torch.stack([dequant(weights[e, "w2", 0]) for e in range(E)])
    x, topk_w, ids = _routing(6)
    ref = fused_moe_ref(x.bfloat16().float(), w13, w2, topk_w, ids)
    torch.testing.assert_close(experts(x, topk_w, ids), ref, rtol=3e-2, atol=3e-2)


def test_engine_greedy_tokens_with_n_cpu_moe(tmp_path: Path) -> None:
    """A tiny random Qwen3-MoE through the engine: --n-cpu-moe 1 gives the greedy tokens of the
    all-on-device engine (fp32, so the split layer is exact)."""
    save_tiny(tmp_path, "qwen3_moe")
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (7, 19)
    ]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    results = []
    for extra in ({}, {"n_cpu_moe": 1}, {"num_experts_offload_per_rank": 3}):
        llm = LLM(
            str(tmp_path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=32,
            block_size=4,
            quantization=None,
            **extra,
        )
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEExperts)]
        assert [m.host is not None for m in layers] == (
            [False, False] if not extra else [True, "n_cpu_moe" not in extra]
        )
        results.append([c.token_ids for c in llm.generate(prompts, params)])
    assert results[1] == results[0] and results[2] == results[0]
    # the last (llm) engine: 3 of 8 experts in both layers
    assert summary(llm.engine.runner.model).startswith(
        "expert offload: 6 experts of 2 MoE layers in host memory"
    )


def _tp_offload_worker(
    rank: int, world: int, path: str, port: int, prompt: list[int], out: str
) -> None:
    import torch.distributed as dist

    from flotilla.services.engine.distributed import init_tensor_parallel
    from flotilla.services.engine.loader import load_model

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        init_tensor_parallel(rank, world)
        model, _ = load_model(path, expert_offload=ExpertOffload(experts_per_rank=2))
        layers = [m for m in model.modules() if isinstance(m, MoEExperts)]
        # rank r owns experts [4r, 4r + 4): its last two are on the host
        assert all(m.host is not None and m.w13.weight.shape[0] == 2 for m in layers)
        assert all(m.host is not None and m.host.w13.first_expert == 4 * rank + 2 for m in layers)
        logits = SingleSequenceRunner(model).forward(prompt)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_offload_their_own_experts(tmp_path: Path) -> None:
    """tp=2 gloo ranks, each with the last 2 of its 4 experts on the host: the prompt logits
    of one unsplit process (expert parallel sums in another order: fp32 rounding)."""
    import socket

    import torch.multiprocessing as mp

    from flotilla.services.engine.loader import load_model

    save_tiny(tmp_path / "ckpt", "qwen3_moe")
    prompt = list(range(5, 29))
    single = SingleSequenceRunner(load_model(tmp_path / "ckpt").model).forward(prompt)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "tp_logits.pt"
    mp.spawn(_tp_offload_worker, args=(2, str(tmp_path / "ckpt"), port, prompt, str(out)), nprocs=2)
    torch.testing.assert_close(torch.load(out), single, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["cpu", "stream"])
def test_gpu_offload_greedy_tokens(tmp_path: Path, mode: str) -> None:
    """On a GPU (Triton fused MoE on the device side, pinned host experts): half of every
    layer's experts on the host, computed on the CPU or streamed, gives the greedy tokens of the
    all-on-GPU engine (fp32: the sides differ only in fp32 summation order)."""
    save_tiny(tmp_path, "qwen3_moe")
    prompts = [
        torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (7, 19, 33)
    ]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = []
    for extra in ({}, {"num_experts_offload_per_rank": 4, "moe_offload_mode": mode}):
        llm = LLM(
            str(tmp_path),
            device="cuda",
            dtype="float32",
            num_kv_blocks=64,
            block_size=16,
            quantization=None,
            **extra,
        )
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEExperts)]
        if extra:
            host = layers[0].host
            assert host is not None and host.w13.weight.is_pinned()
            assert layers[0].w13.weight.is_cuda and layers[0].w13.weight.shape[0] == 4
        results.append([c.token_ids for c in llm.generate(prompts, params)])
        del llm
    assert results[1] == results[0]
