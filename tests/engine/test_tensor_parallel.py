"""Tensor parallelism through the Engine on CPU (gloo): TP=2/4/8 pods against a TP=1 engine
(which test_model_parity / test_moe_models hold to transformers), a killed rank failing the pod
within seconds, and the step plan's block deltas."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from flotilla.services.engine.engine import Engine, EngineConfig
from flotilla.services.engine.executor import TensorParallelError
from flotilla.services.engine.multiproc_executor import MultiProcExecutor
from flotilla.services.engine.pod import pod_layout
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import ScheduledRequest
from flotilla.services.engine.step_plan import DecodedStep, PlanDecoder, PlanEncoder
from tests.endpoints import NATS_URL
from tests.engine.conftest import rel_error, save_tiny_llama
from tests.engine.test_moe_models import save_tiny

# 8 query heads over 2 kv heads: split at TP=2, replicated (one kv head per rank) at TP=4 and 8.
LLAMA: dict[str, Any] = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                             intermediate_size=128)
# Small blocks and chunks: prefill chunks, several blocks per request, and preemption.
ENGINE: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=16,
                              max_num_batched_tokens=32, prefill_chunk_size=16, max_num_seqs=4)
PROMPT = list(range(3, 41))
# room for 200 tokens: still generating when a rank is killed
LONG_RUN: dict[str, Any] = dict(ENGINE, num_kv_blocks=64)
PROMPT_LENS = (5, 19, 33)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-llama")
    save_tiny_llama(path, **LLAMA)
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tp-moe")
    save_tiny(path, "qwen2_moe")  # 4 experts (2 per rank), a shared expert, a dense layer
    return path


def run_greedy(engine: Engine, prompt_logprobs: list[Any] | None = None
               ) -> dict[str, list[int]]:
    """Greedy tokens per request; r2 (33 prompt tokens: three chunks) also asks for prompt
    logprobs, its (logprob, top-2) per prompt token go to `prompt_logprobs`."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_prompt = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                 prompt_logprobs=2)
    for i, n in enumerate(PROMPT_LENS):
        engine.add_request(f"r{i}", list(range(7 + i, 7 + i + n)),
                           with_prompt if i == 2 else params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.prompt_logprobs is not None and prompt_logprobs is not None:
                prompt_logprobs.extend(None if e is None else (e.logprob, *e.top)
                                       for e in o.prompt_logprobs)
    return out


def reference(path: Path, prompt_logprobs: list[Any]
              ) -> tuple[torch.Tensor, dict[str, list[int]]]:
    engine = Engine(EngineConfig(model=str(path), **ENGINE))
    result = engine.prompt_logits(PROMPT), run_greedy(engine, prompt_logprobs)
    assert engine.stats()["preemptions"] > 0  # the pool is small enough to preempt
    return result


def check_tp(path: Path, tp: int, **overrides: Any) -> None:
    ref_prompt: list[Any] = []
    ref_logits, ref_tokens = reference(path, ref_prompt)
    assert len(ref_prompt) == PROMPT_LENS[2] and ref_prompt[0] is None
    engine = Engine(EngineConfig(model=str(path), tp=tp, **{**ENGINE, **overrides}))
    try:
        assert isinstance(engine.executor, MultiProcExecutor)
        assert engine.runner.inputs.pad == overrides.get("pad_eager_steps", False)
        assert engine.runner.model.model.embed_tokens.weight.shape[0] == 256 // tp  # a shard
        err = rel_error(engine.prompt_logits(PROMPT), ref_logits)
        assert err < 1e-5, f"TP={tp}: prompt logits rel. error {err:.2e}"
        prompt: list[Any] = []
        assert run_greedy(engine, prompt) == ref_tokens
        assert engine.stats()["preemptions"] > 0
        for ours, ref in zip(prompt[1:], ref_prompt[1:], strict=True):
            assert ours[0] == pytest.approx(ref[0], abs=1e-4)
            assert [t for t, _ in ours[1:]] == [t for t, _ in ref[1:]]
    finally:
        engine.shutdown()


def test_llama_tp2_matches_tp1(llama: Path) -> None:
    # Async scheduling: the workers feed rank 0's broadcast tokens to the next step.
    check_tp(llama, 2, async_scheduling=True)


def test_moe_tp2_matches_tp1(moe: Path) -> None:
    # Bucketed eager steps (on by default on CUDA): padding rows through the experts and the
    # row-parallel all-reduces of every rank must leave the real rows as TP=1 unpadded.
    check_tp(moe, 2, pad_eager_steps=True)


def test_llama_tp4_with_replicated_kv_heads_matches_tp1(llama: Path) -> None:
    check_tp(llama, 4)


@pytest.mark.slow
def test_llama_tp8_matches_tp1(llama: Path) -> None:
    check_tp(llama, 8)


def test_killed_worker_fails_the_engine_within_seconds(llama: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama), tp=2, **LONG_RUN))
    failures: list[BaseException] = []
    engine.executor.on_failure(failures.append)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        engine.add_request("victim", PROMPT, params)
        for _ in range(3):
            engine.step()
        assert isinstance(engine.executor, MultiProcExecutor)
        os.kill(engine.executor._procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 was killed by SIGKILL"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 5
        assert failures and "rank 1" in str(failures[0])
        engine.add_request("next", PROMPT, params)
        with pytest.raises(TensorParallelError):  # the pod stays failed
            engine.step()
    finally:
        engine.shutdown()


async def test_service_errors_requests_and_gives_up_when_a_rank_dies(llama: Path) -> None:
    from flotilla.libs.common import subjects
    from flotilla.libs.common.bus import Bus
    from flotilla.libs.common.errors import FlotillaError
    from flotilla.libs.common.messages import Admission, SamplingOptions, TokenFrame, TokenRequest
    from flotilla.libs.common.settings import EngineSettings
    from flotilla.services.engine.service import EngineService

    engine = await asyncio.to_thread(Engine, EngineConfig(model=str(llama), tp=2, **LONG_RUN))
    model = f"tp-{uuid.uuid4().hex[:8]}"
    bus = await Bus.connect(NATS_URL, "tp-test")
    fatal = asyncio.Event()
    service = EngineService(EngineSettings(served_model_name=model), bus, engine,
                            on_fatal=fatal.set)
    await service.start()
    try:
        rid = uuid.uuid4().hex
        reader = await bus.open_reader(subjects.token_stream(rid), TokenFrame, timeout=10)
        request = TokenRequest(request_id=rid, model=model, prompt_token_ids=PROMPT,
                               sampling=SamplingOptions(max_tokens=200, ignore_eos=True,
                                                        temperature=0.0),
                               stream_subject=subjects.token_stream(rid))
        admission = await bus.request(subjects.engine_generate(model), request, Admission, 10)
        assert admission.accepted
        await reader.next()  # the first token: generation is under way
        assert isinstance(engine.executor, MultiProcExecutor)
        os.kill(engine.executor._procs[1].pid, signal.SIGKILL)  # type: ignore[arg-type]
        start = time.monotonic()
        with pytest.raises(FlotillaError) as err:
            while True:
                await reader.next()
        assert time.monotonic() - start < 5
        assert err.value.status == 500 and "rank 1" in err.value.info.message
        await asyncio.wait_for(fatal.wait(), 5)
        again = await bus.request(subjects.engine_generate(model), request.model_copy(
            update={"request_id": uuid.uuid4().hex}), Admission, 10)
        assert not again.accepted and again.error is not None and again.error.status == 503
        await reader.close()
    finally:
        await service.stop()
        await asyncio.to_thread(engine.shutdown)
        await bus.close()


# ---------------------------------------------------------------------- pieces


def _sr(rid: str, tokens: list[int], computed: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(request_id=rid, token_ids=tokens, num_computed_tokens=computed,
                            block_ids=blocks, is_prefill=computed == 0, samples=True,
                            sampling_params=SamplingParams(), generator=None, prompt_len=3,
                            all_token_ids=tokens)


def test_step_plan_sends_block_deltas_and_mirrors_the_block_lists() -> None:
    encoder, decoder = PlanEncoder(), PlanDecoder()

    def roundtrip(requests: list[ScheduledRequest]) -> tuple[list[list[int]], int]:
        payload = encoder.step(requests, decode_only=False, share_tokens=True)
        step = decoder.decode(payload)
        assert isinstance(step, DecodedStep) and step.share_tokens
        assert [r.token_ids for r in step.requests] == [r.token_ids for r in requests]
        assert [r.num_computed_tokens for r in step.requests] == [
            r.num_computed_tokens for r in requests]
        return [r.block_ids for r in step.requests], len(payload)

    a, b = [1, 2], [7]
    assert roundtrip([_sr("a", [5, 6, 7], 0, a), _sr("b", [9], 0, b)])[0] == [[1, 2], [7]]
    a.extend(range(3, 200))  # grows in place: only the tail travels
    blocks, size = roundtrip([_sr("a", [8], 3, a), _sr("b", [1], 1, b)])
    assert blocks == [a, b] and size < 600
    assert roundtrip([_sr("a", [8], 4, a)])[0] == [a]  # "b" paused: dropped on both sides
    a[-1] = 999  # rewritten in place (not something KVCacheManager does): sent whole
    assert roundtrip([_sr("a", [8], 5, a)])[0] == [a]
    preempted = [40, 41]  # freed and re-allocated: a new list, sent whole
    assert roundtrip([_sr("a", [1, 2, 3], 0, preempted), _sr("b", [1], 0, b)])[0] == [
        [40, 41], [7]]


def test_pod_layout_from_tp_device_ids_and_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    cpu = pod_layout(EngineConfig(device="cpu", tp=4))
    assert (cpu.world_size, cpu.devices, cpu.torchrun) == (4, ["cpu"] * 4, False)
    gpus = pod_layout(EngineConfig(device="cuda", device_ids=(2, 3)))
    assert (gpus.world_size, gpus.devices) == (2, ["cuda:2", "cuda:3"])
    assert pod_layout(EngineConfig(device="cuda", tp=2)).devices == ["cuda:0", "cuda:1"]
    assert pod_layout(EngineConfig(device="cuda", device_ids=(5,))).devices == ["cuda:5"]
    with pytest.raises(ValueError, match="one device id per rank"):
        pod_layout(EngineConfig(device="cuda", tp=2, device_ids=(0, 1, 2)))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    multi = pod_layout(EngineConfig(device="cuda"))
    assert (multi.world_size, multi.devices, multi.torchrun) == (4, ["cuda:0", "cuda:1"], True)
    with pytest.raises(ValueError, match="torchrun started 4"):
        pod_layout(EngineConfig(device="cuda", tp=2))


def test_launcher_passes_tp_and_device_ids_to_the_engine() -> None:
    from flotilla.libs.common.settings import EngineSettings, LauncherSettings
    from flotilla.services.engine.factory import engine_config
    from flotilla.services.launcher.cli import build_parser
    from flotilla.services.launcher.suite import Suite, SuiteOptions

    args = build_parser(LauncherSettings()).parse_args(["up", "--tp", "2", "--d", "0, 1"])
    assert (args.tp, args.device_ids) == (2, "0,1")
    suite = Suite(SuiteOptions(tp=args.tp, device_ids=args.device_ids))
    env = next(s.env for s in suite._specs("nats://x", 1, Path("/m"), "m") if s.name == "engine")
    assert (env["FLOTILLA_TP"], env["FLOTILLA_DEVICE_IDS"]) == ("2", "0,1")
    settings = EngineSettings(tp=env["FLOTILLA_TP"], device_ids=env["FLOTILLA_DEVICE_IDS"])
    config = engine_config(settings, Path("/m"))
    assert (config.tp, config.device_ids) == (2, (0, 1))
