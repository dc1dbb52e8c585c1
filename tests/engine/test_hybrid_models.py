"""The hybrid linear-attention families (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers
on tiny random checkpoints (fp32, CPU), with the linear-attention state in the state pool.

Tiny models come from transformers' own config classes (`AutoConfig.for_model`), their 1-D
parameters (zero-centred norm scales, A_log, dt_bias) randomised so they matter (save_tiny of
test_recent_families.py). Two linear-attention layers per full-attention one, 2 key heads over
4 value heads (grouped), a conv of width 4. Checked per family:
- prompt logits, every cached decode step's logits (the in-place recurrent update) and 16 greedy
  tokens against transformers (rel. error < 1e-4);
- a prompt prefilled in three chunks (each continuing from the state the previous one left)
  gives the logits of one prefill;
- the Engine with prefill chunks of 8, blocks of 4 and a KV pool or a state pool too small for
  all requests at once (so requests are preempted and recomputed from zero state, or wait for a
  slot) gives every prompt of a mixed-length batch transformers' greedy tokens, the same tokens
  as an unpressured run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.loader import load_model
from tests.engine.conftest import SingleSequenceRunner, rel_error
from tests.engine.test_architectures import decode_logits
from tests.engine.test_gguf_architectures import llama_cpp_converter  # noqa: F401 (fixture)
from tests.engine.test_recent_families import (
    TINY,
    Family,
    _prompt,
    assert_matches_transformers,
    hf_greedy,
    save_tiny,
)

_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=16, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
               num_hidden_layers=6)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48)
FAMILIES: dict[str, Family] = {
    # MoE with a shared expert everywhere but layer 1 (mlp_only_layers: dense)
    "qwen3_next": Family("qwen3_next", {**_LINEAR, **_MOE, "mlp_only_layers": [1],
                                        "norm_topk_prob": True}),
    "qwen3_5_text": Family("qwen3_5_text", dict(_LINEAR)),
    "qwen3_5_moe_text": Family("qwen3_5_moe_text", {**_LINEAR, **_MOE}),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(tmp_path: Path, name: str) -> None:
    model = assert_matches_transformers(tmp_path, FAMILIES[name])
    assert len(model.state_layers()) == 4 and len(model.attention_layers()) == 2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_continues_from_the_state(tmp_path: Path, name: str) -> None:
    save_tiny(tmp_path, FAMILIES[name])
    model, _ = load_model(tmp_path)
    prompt = _prompt(40, seed=3)
    full = SingleSequenceRunner(model).forward(prompt)
    chunked = SingleSequenceRunner(model)
    parts = [chunked.forward(prompt[:17]), chunked.forward(prompt[17:30], start=17),
             chunked.forward(prompt[30:], start=30)]
    assert rel_error(torch.cat(parts), full) < 1e-4  # chunk splits round differently


def _engine_tokens(path: Path, prompts: list[list[int]], max_tokens: int, **config: Any
                   ) -> tuple[dict[str, list[int]], dict[str, Any]]:
    from flotilla.services.engine.engine import Engine, EngineConfig
    from flotilla.services.engine.sampling_params import SamplingParams

    config = {"device": "cpu", **config}
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                 prefill_chunk_size=8, max_num_batched_tokens=16, **config))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return got, engine.stats()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_with_chunked_prefill_and_preemption_matches_transformers(
        tmp_path: Path, name: str) -> None:
    hf = save_tiny(tmp_path, FAMILIES[name])
    prompts = [_prompt(n, seed=10 + n) for n in (21, 6, 15, 1)]
    expected = {f"r{i}": hf_greedy(hf, p, 12) for i, p in enumerate(prompts)}
    free, stats = _engine_tokens(tmp_path, prompts, 12, num_kv_blocks=64)
    assert stats["preemptions"] == 0
    assert free == expected
    # 10 blocks of 4 tokens: the sequences (up to 33 tokens each) cannot all stay resident
    pressed, stats = _engine_tokens(tmp_path, prompts, 12, num_kv_blocks=10)
    assert stats["preemptions"] > 0
    assert pressed == expected


def test_engine_with_fewer_state_slots_than_requests_waits_for_slots(tmp_path: Path) -> None:
    """Two slots for four requests: at most two run at once, the others wait (no preemption),
    and every request still gets transformers' tokens."""
    hf = save_tiny(tmp_path, FAMILIES["qwen3_5_text"])
    prompts = [_prompt(n, seed=20 + n) for n in (9, 17, 4, 12)]
    got, stats = _engine_tokens(tmp_path, prompts, 6, num_kv_blocks=64, num_state_slots=2)
    assert stats["preemptions"] == 0
    assert got == {f"r{i}": hf_greedy(hf, p, 6) for i, p in enumerate(prompts)}


def test_engine_turns_prefix_caching_off_for_hybrids(tmp_path: Path) -> None:
    """A shared prompt prefix is recomputed (the linear-attention state is not kept per block):
    no prefix-cache hit, and the second request's tokens are still right."""
    hf = save_tiny(tmp_path, FAMILIES["qwen3_5_text"])
    shared = _prompt(16, seed=5)
    prompts = [shared + [7, 8], shared + [9]]
    got, stats = _engine_tokens(tmp_path, prompts, 4, num_kv_blocks=64,
                                enable_prefix_caching=True)
    assert stats["prefix_cache_hit_tokens"] == 0
    assert got == {f"r{i}": hf_greedy(hf, p, 4) for i, p in enumerate(prompts)}


def test_qwen3_5_multimodal_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration (text_config, `model.language_model.` names, a vision
    tower under `model.visual.` to skip) against transformers' text forward of the model."""
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    text = {**TINY, **FAMILIES["qwen3_5_text"].overrides}
    config = AutoConfig.for_model("qwen3_5", text_config=text, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
        patch_size=2, temporal_patch_size=1, spatial_merge_size=1))
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for _, param in hf.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    hf.save_pretrained(tmp_path)
    model, loaded = load_model(tmp_path)
    assert loaded.architecture == "Qwen3_5ForConditionalGeneration"
    prompt = _prompt()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert rel_error(SingleSequenceRunner(model).forward(prompt), ref) < 1e-4


def test_qwen3_5_moe_loads_stacked_experts(tmp_path: Path) -> None:
    """Experts stored stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I], transformers 5's in-memory layout) load as the per-expert checkpoint does."""
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path / "per_expert", FAMILIES["qwen3_5_moe_text"])
    state = load_file(tmp_path / "per_expert" / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name in list(state):
        if ".experts.0.gate_proj." in name:
            prefix = name.split(".experts.")[0] + ".experts"
            n = sum(1 for k in state if k.startswith(prefix) and k.endswith("gate_proj.weight"))
            stacked[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(
                [state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"]])
                for e in range(n)])
            stacked[f"{prefix}.down_proj"] = torch.stack(
                [state[f"{prefix}.{e}.down_proj.weight"] for e in range(n)])
    stacked.update({k: v for k, v in state.items() if ".experts." not in k})
    (tmp_path / "stacked").mkdir()
    save_file(stacked, tmp_path / "stacked" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "stacked" / "config.json").write_text(
        (tmp_path / "per_expert" / "config.json").read_text())
    prompt = _prompt()
    ref = SingleSequenceRunner(load_model(tmp_path / "per_expert").model).forward(prompt)
    got = SingleSequenceRunner(load_model(tmp_path / "stacked").model).forward(prompt)
    assert torch.equal(got, ref)


def test_padded_decode_rows_leave_every_other_state_untouched(tmp_path: Path) -> None:
    """A decode step as a CUDA graph replays it: the real rows, then padding rows with state
    slot -1 and KV slot -1. The real row's logits equal an unpadded decode, and no other
    sequence's state (conv or recurrent) changes."""
    import dataclasses

    from flotilla.services.engine.forward_context import forward_context
    from flotilla.services.engine.state_pool import StateCache

    save_tiny(tmp_path, FAMILIES["qwen3_next"])
    model, _ = load_model(tmp_path)
    prompt = _prompt(12, seed=4)
    ref_runner = SingleSequenceRunner(model)
    ref_runner.forward(prompt)
    expected = ref_runner.forward([5], start=len(prompt))

    runner = SingleSequenceRunner(model)  # its KV cache; the pool below rebinds the states
    pool = StateCache(model.state_layers(), 4, torch.float32, torch.device("cpu"))
    pool.conv.normal_()
    pool.recurrent.normal_()
    others = [0, 1, 3]
    before = pool.conv[:, others].clone(), pool.recurrent[:, others].clone()
    pool.reset([2])
    meta = runner.metadata(0, len(prompt))
    with forward_context(dataclasses.replace(
            meta, state_indices=torch.tensor([2], dtype=torch.int32),
            has_initial_state=torch.tensor([False]))):
        model(torch.tensor(prompt), torch.arange(len(prompt)))
    step = runner.metadata(len(prompt), 1)
    pad = 3
    padded = dataclasses.replace(
        step, query_start_loc=torch.arange(pad + 2, dtype=torch.int32),
        seq_lens=torch.tensor([len(prompt) + 1] + [1] * pad, dtype=torch.int32),
        block_tables=step.block_tables.expand(pad + 1, -1).contiguous(),
        slot_mapping=torch.tensor([len(prompt)] + [-1] * pad),
        query_start_loc_cpu=list(range(pad + 2)), seq_lens_cpu=[len(prompt) + 1] + [1] * pad,
        state_indices=torch.tensor([2] + [-1] * pad, dtype=torch.int32),
        has_initial_state=None)
    with forward_context(padded):
        hidden = model(torch.tensor([5, 9, 9, 9]), torch.tensor([len(prompt), 0, 0, 0]))
    assert rel_error(model.compute_logits(hidden[:1]), expected) < 1e-5
    assert torch.equal(pool.conv[:, others], before[0])
    assert torch.equal(pool.recurrent[:, others], before[1])


def test_step_plan_carries_the_state_slots() -> None:
    """Tensor-parallel workers get each request's state slot from rank 0's plan."""
    from flotilla.services.engine.cache_sizing import dummy_request as _dummy_request
    from flotilla.services.engine.step_plan import DecodedStep, PlanDecoder, PlanEncoder

    encoder, decoder = PlanEncoder(), PlanDecoder()
    step = decoder.decode(encoder.step([_dummy_request("a", 3, [0], state_slot=2),
                                        _dummy_request("b", 1, [1], state_slot=0)],
                                       decode_only=False, share_tokens=False))
    assert isinstance(step, DecodedStep) and [r.state_slot for r in step.requests] == [2, 0]
    step = decoder.decode(encoder.step([_dummy_request("c", 2, [0], state_slot=-1)],
                                       decode_only=False, share_tokens=False))
    assert isinstance(step, DecodedStep) and step.requests[0].state_slot == -1
    logits = decoder.decode(PlanEncoder.logits(_dummy_request("d", 4, [3], state_slot=5)))
    assert not isinstance(logits, DecodedStep) and logits is not None
    assert logits.state_slot == 5


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_single_rank(tmp_path: Path) -> None:
    """Linear-attention key / value heads, conv channels, A_log / dt_bias and the gated
    attention's query + gate heads split 1 + 1 / 2 + 2, experts 2 + 2: the engine on two gloo
    ranks (state slots in the step plan, chunked prefill, preemption) gives one rank's tokens."""
    from flotilla.services.engine.engine import Engine, EngineConfig
    from flotilla.services.engine.sampling_params import SamplingParams

    save_tiny(tmp_path, FAMILIES["qwen3_5_moe_text"])
    prompts = [_prompt(n, seed=30 + n) for n in (21, 6, 15)]
    config: dict[str, Any] = dict(model=str(tmp_path), device="cpu", dtype="float32",
                                  block_size=4, prefill_chunk_size=8, max_num_batched_tokens=16,
                                  num_kv_blocks=10)
    ref_tokens, _ = _engine_tokens(tmp_path, prompts, 8, num_kv_blocks=10)
    single = Engine(EngineConfig(**config)).prompt_logits(prompts[0])
    engine = Engine(EngineConfig(**config, tp=2))
    try:
        assert rel_error(engine.prompt_logits(prompts[0]), single) < 1e-5
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        assert engine.stats()["preemptions"] > 0
        assert got == ref_tokens
    finally:
        engine.shutdown()


# llama.cpp's qwen3next has MoE on every layer (no dense MLP layers)
GGUF_FAMILIES = {**FAMILIES, "qwen3_next": Family("qwen3_next", {
    k: v for k, v in FAMILIES["qwen3_next"].overrides.items() if k != "mlp_only_layers"})}


@pytest.fixture(scope="module")
def converted_hybrids(llama_cpp_converter: Path,  # noqa: F811 (the imported fixture)
                      tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, tuple[Path, Path]]:
    """name -> (safetensors dir, GGUF file made by llama.cpp's converter, f32)."""
    import subprocess
    import sys

    from tests.engine.test_gguf_architectures import _sentencepiece_model

    root = tmp_path_factory.mktemp("gguf-hybrid")
    tokenizer = _sentencepiece_model()
    jobs, paths = [], {}
    for name, family in GGUF_FAMILIES.items():
        hf_dir, gguf = root / name, root / f"{name}.gguf"
        save_tiny(hf_dir, family)
        (hf_dir / "tokenizer.model").write_bytes(tokenizer)
        jobs.append((str(hf_dir), str(gguf)))
        paths[name] = (hf_dir, gguf)
    driver = (f"import sys; sys.path.insert(0, {str(llama_cpp_converter)!r})\n"
              "import convert_hf_to_gguf as c\n"
              "from conversion.base import TextModel\n"
              "TextModel._set_vocab_gpt2 = TextModel._set_vocab_sentencepiece\n"
              "TextModel._set_vocab_qwen = TextModel._set_vocab_sentencepiece\n"
              f"for src, out in {jobs!r}:\n"
              "    sys.argv = ['convert', src, '--outtype', 'f32', '--outfile', out,"
              " '--no-mtp']\n"
              "    c.main()\n")
    result = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return paths


@pytest.mark.parametrize("name", list(GGUF_FAMILIES))
def test_converted_gguf_matches_its_safetensors(converted_hybrids: dict[str, tuple[Path, Path]],
                                                name: str) -> None:
    """llama.cpp's conversion undone (1 + w norms, -exp(A_log), Qwen3.5's tiled value heads):
    the GGUF gives the safetensors' logits, prompt and cached decode steps."""
    hf_dir, gguf = converted_hybrids[name]
    ref_model, ref_config = load_model(hf_dir)
    model, config = load_model(gguf)
    assert config.architecture == ref_config.architecture
    assert config.layer_types == ref_config.layer_types
    assert config.rotary_dim == ref_config.rotary_dim
    prompt = _prompt()
    tokens = [5, 77, 301]
    ref = decode_logits(SingleSequenceRunner(ref_model), prompt, tokens)
    got = decode_logits(SingleSequenceRunner(model), prompt, tokens)
    assert rel_error(got, ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe_text"])
def test_cuda_graph_decode_matches_eager_and_transformers(tmp_path: Path, name: str) -> None:
    """On the GPU (Triton kernels): decode steps replaying CUDA graphs (state slots in the
    graphs' persistent tensor, padded rows at slot -1) give the eager engine's tokens exactly,
    under chunked prefill and preemption; prompt logits within the kernels' tf32 bound of
    transformers' fp32 forward."""
    from flotilla.services.engine.engine import Engine, EngineConfig

    hf = save_tiny(tmp_path, FAMILIES[name])
    prompts = [_prompt(n, seed=40 + n) for n in (21, 6, 15, 1, 9)]
    runs = {}
    for eager in (False, True):
        tokens, stats = _engine_tokens(tmp_path, prompts, 12, device="cuda", num_kv_blocks=14,
                                       enforce_eager=eager)
        assert stats["preemptions"] > 0
        runs[eager] = tokens
    assert runs[False] == runs[True]
    engine = Engine(EngineConfig(model=str(tmp_path), device="cuda", dtype="float32",
                                 num_kv_blocks=64))
    assert engine.runner.graphs is not None and engine.runner.state_cache is not None
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0]
    assert rel_error(engine.prompt_logits(prompts[0]), ref) < 1e-2


def test_layer_types_follow_full_attention_interval_without_layer_types() -> None:
    """Qwen3-Next configs written before `layer_types` give only the interval; transformers
    makes every interval-th layer full attention, and so do we."""
    from transformers import AutoConfig

    from flotilla.services.engine.model_config import ModelConfig

    hf = AutoConfig.for_model("qwen3_next", num_hidden_layers=8, full_attention_interval=4)
    # transformers 5 keeps only the derived layer_types: write the old form
    cfg = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    cfg.update(architectures=["Qwen3NextForCausalLM"], full_attention_interval=4)
    assert ModelConfig.from_hf_dict(cfg).layer_types == hf.layer_types
    assert hf.layer_types[3] == "full_attention" and hf.layer_types.count("full_attention") == 2
