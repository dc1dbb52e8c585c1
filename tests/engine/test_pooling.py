"""Pooling requests (embeddings) in the engine, against transformers on the same tiny weights:
the final hidden states of Qwen3Model pooled (last token, mean, CLS) and L2-normalized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from services.engine.engine import Engine, EngineConfig, RequestOutput
from services.engine.pooling import PoolingParams
from services.engine.sampling_params import SamplingParams

VOCAB = 256


def save_tiny_qwen3(
    path: Path, pooling: str | None = None, **overrides: object
) -> Qwen3ForCausalLM:
    """A tiny random Qwen3, with a sentence-transformers Pooling module when `pooling` is given
    (lasttoken / mean_tokens / cls_token), as Qwen3-Embedding ships it."""
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        **overrides,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    if pooling is not None:
        (path / "modules.json").write_text(
            json.dumps(
                [
                    {
                        "idx": 0,
                        "name": "0",
                        "path": "",
                        "type": "sentence_transformers.models.Transformer",
                    },
                    {
                        "idx": 1,
                        "name": "1",
                        "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling",
                    },
                    {
                        "idx": 2,
                        "name": "2",
                        "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize",
                    },
                ]
            )
        )
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(
            json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{pooling}": True})
        )
    return model


def reference(
    model: Qwen3ForCausalLM,
    prompt: list[int],
    method: str,
    normalize: bool = True,
    dimensions: int | None = None,
) -> torch.Tensor:
    """transformers' last hidden state, pooled as sentence-transformers does."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[
            0
        ]
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    if dimensions is not None:
        vec = vec[:dimensions]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def prompts(n: int, seed: int = 1, longest: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, VOCAB, (int(n_),), generator=g).tolist()
        for n_ in torch.randint(1, longest, (n,), generator=g)
    ]


def make_engine(path: Path, **kw: object) -> Engine:
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=str(path), device="cpu", **kw))  # type: ignore[arg-type]


def drain(engine: Engine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen3ForCausalLM]:
    path = tmp_path_factory.mktemp("qwen3-plain")
    return path, save_tiny_qwen3(path)


def test_last_token_pooling_matches_transformers_batched_beside_generation(plain) -> None:
    path, model = plain
    engine = make_engine(path, max_num_batched_tokens=48)
    assert engine.model_pooling.method == "last"  # no sentence-transformers config: decoder
    ps = prompts(6)
    engine.add_request(
        "gen", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    for i, p in enumerate(ps):
        engine.add_request(f"e{i}", p, PoolingParams("last"))
    done = drain(engine)
    assert len(done["gen"].new_token_ids) == 1 and done["gen"].num_output_tokens == 8
    for i, p in enumerate(ps):
        out = done[f"e{i}"]
        assert out.finish_reason == "stop" and out.num_prompt_tokens == len(p)
        assert out.pooled is not None
        torch.testing.assert_close(out.pooled, reference(model, p, "last"), atol=1e-4, rtol=1e-4)
    assert engine.stats()["pooling"] == 0 and engine.kv.pool.num_used_blocks == 0


def test_mean_pooling_from_sentence_transformers_config_in_chunks(tmp_path: Path) -> None:
    model = save_tiny_qwen3(tmp_path, "mean_tokens")
    engine = make_engine(tmp_path, max_num_batched_tokens=16)  # a 50-token input: 4 chunks
    assert engine.model_pooling.method == "mean"
    ps = [list(range(2, 52)), [9], list(range(100, 117))]
    for i, p in enumerate(ps):
        engine.add_request(f"e{i}", p, PoolingParams(engine.model_pooling.method))
    done = drain(engine)
    for i, p in enumerate(ps):
        torch.testing.assert_close(
            done[f"e{i}"].pooled, reference(model, p, "mean"), atol=1e-4, rtol=1e-4
        )


def test_cls_pooling_dimensions_and_unnormalized(plain) -> None:
    path, model = plain
    engine = make_engine(path, pooling="cls")
    assert engine.model_pooling.method == "cls"
    p = prompts(1, seed=3)[0]
    engine.add_request("a", p, PoolingParams("cls", normalize=True, dimensions=16))
    engine.add_request("b", p, PoolingParams("last", normalize=False))
    done = drain(engine)
    assert done["a"].pooled.shape == (16,)
    torch.testing.assert_close(
        done["a"].pooled, reference(model, p, "cls", dimensions=16), atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        done["b"].pooled, reference(model, p, "last", normalize=False), atol=1e-4, rtol=1e-4
    )


def test_pooling_abort_frees_its_blocks_and_bad_inputs_are_refused(plain) -> None:
    path, _ = plain
    engine = make_engine(path, max_num_batched_tokens=16)
    engine.add_request("long", list(range(2, 200)), PoolingParams())
    engine.step()  # one chunk computed, its blocks held
    assert engine.kv.pool.num_used_blocks > 0
    assert engine.abort("long")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("long", "abort")]
    assert engine.kv.pool.num_used_blocks == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("x", [VOCAB], PoolingParams())
    with pytest.raises(ValueError, match="context"):
        engine.add_request("y", [3] * 1000, PoolingParams())
