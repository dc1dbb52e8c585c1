"""Pooling requests (embeddings) in the engine, against transformers on the same tiny weights:
the final hidden states of Qwen3Model pooled (last token, mean, CLS) and L2-normalized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from flotilla.services.engine.engine import Engine, EngineConfig, RequestOutput
from flotilla.services.engine.pooling import PoolingParams
from flotilla.services.engine.sampling_params import SamplingParams
from tests.pooling.models import VOCAB, reference, save_tiny_qwen3


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
        assert out.stop_token_id is None and out.num_output_tokens == 0
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


def test_a_base_model_checkpoint_loads_as_qwen3_embedding_ships(tmp_path: Path) -> None:
    """Qwen3-Embedding's files: Qwen3Model tensors (no `model.` prefix, no lm_head) under a
    Qwen3ForCausalLM config."""
    import json

    from safetensors.torch import load_file

    causal = save_tiny_qwen3(tmp_path / "causal")
    path = tmp_path / "embedding"
    causal.model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    names = load_file(path / "model.safetensors").keys()
    assert "layers.0.self_attn.q_proj.weight" in names and not any(
        n.startswith(("model.", "lm_head")) for n in names
    )
    engine = make_engine(path)
    p = prompts(1, seed=5)[0]
    engine.add_request("e", p, PoolingParams("last"))
    torch.testing.assert_close(
        drain(engine)["e"].pooled, reference(causal, p, "last"), atol=1e-4, rtol=1e-4
    )


def test_pooling_config_reads_sentence_transformers_and_matryoshka(tmp_path: Path) -> None:
    import json

    from flotilla.services.engine.pooling_config import model_pooling

    for mode, method in (("lasttoken", "last"), ("mean_tokens", "mean"), ("cls_token", "cls")):
        d = tmp_path / mode
        d.mkdir()
        (d / "modules.json").write_text(
            json.dumps(
                [
                    {"path": "", "type": "sentence_transformers.models.Transformer"},
                    {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                ]
            )
        )
        (d / "1_Pooling").mkdir()
        (d / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
        assert model_pooling(d, {}, 64).method == method
        assert model_pooling(d, {}, 64, override="cls").method == "cls"
    assert model_pooling(tmp_path / "none", {}, 64).method == "last"  # decoder default
    plain = model_pooling(None, {}, 64)
    assert plain.check_dimensions(None) is None and plain.check_dimensions(64) is None
    assert "Matryoshka" in (plain.check_dimensions(32) or "")
    assert "1..64" in (plain.check_dimensions(65) or "")
    assert model_pooling(None, {"is_matryoshka": True}, 64).check_dimensions(7) is None
    listed = model_pooling(None, {"matryoshka_dimensions": [16, 32]}, 64)
    assert listed.check_dimensions(32) is None and "[16, 32]" in (listed.check_dimensions(8) or "")


def test_a_job_holding_blocks_is_set_back_for_an_earlier_one(plain) -> None:
    """A 200-token input part-way through (chunks of 32) holds blocks when a higher-priority
    200-token input arrives; a 60-block cache (240 tokens) cannot hold both: the first is set
    back to its start, the second finishes, then the first, both exact."""
    path, model = plain
    engine = make_engine(path, num_kv_blocks=60, max_num_batched_tokens=32)
    ps = [list(range(2, 202)), list(range(50, 250))]
    engine.add_request("e0", ps[0], PoolingParams("last"))
    for _ in range(3):
        assert not engine.step()
    held = engine.pooling.jobs["e0"].request.num_computed_tokens
    assert held == 96
    engine.add_request("e1", ps[1], PoolingParams("last"), priority=-1)
    order: list[str] = []
    done: dict[str, RequestOutput] = {}
    set_back = False
    for _ in range(100):
        for out in engine.step():
            order.append(out.request_id)
            done[out.request_id] = out
        job = engine.pooling.jobs.get("e0")
        set_back |= job is not None and job.request.num_computed_tokens < held
        if not engine.has_unfinished():
            break
    assert order == ["e1", "e0"] and set_back
    for i, p in enumerate(ps):
        torch.testing.assert_close(
            done[f"e{i}"].pooled, reference(model, p, "last"), atol=1e-4, rtol=1e-4
        )


async def test_pool_service_bounds_its_own_queue_and_cancels(plain) -> None:
    """The engine's pooling subject: a second request past the pooling bound is a 503 while
    generation's queue stays empty; a Cancel aborts the first's jobs and answers it at once (the
    loop is not started: no job of it would ever finish)."""
    import asyncio

    from flotilla.libs.common.pooling_messages import PoolRequest
    from flotilla.services.engine.admission import QueueLimits
    from flotilla.services.engine.loop import EngineLoop
    from flotilla.services.engine.pool_service import PoolService

    path, _ = plain
    engine = make_engine(path)
    loop = EngineLoop(engine, asyncio.get_running_loop(), lambda outs: None, lambda exc: None)
    service = PoolService(engine, loop, QueueLimits(1, 10_000), lambda: None)
    first = asyncio.ensure_future(
        service.handle(PoolRequest(request_id="a", model="m", prompts=[[5, 6, 7]] * 40))
    )
    await asyncio.sleep(0)
    second = await service.handle(PoolRequest(request_id="b", model="m", prompts=[[5]]))
    assert second.error is not None and second.error.status == 503
    assert loop.queue_state().waiting == 0  # generation's queue: pooling jobs not counted
    bad = await service.handle(PoolRequest(request_id="c", model="m", prompts=[[VOCAB]]))
    assert bad.error is not None and (bad.error.status, bad.error.param) == (400, "input")
    assert service.cancel("a") and not service.cancel("a")
    cancelled = await asyncio.wait_for(first, 5)
    assert cancelled.error is not None and cancelled.error.code == "cancelled"
