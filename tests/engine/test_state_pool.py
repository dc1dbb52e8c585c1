"""The linear-attention state pool: slot bookkeeping, admission and preemption in the scheduler,
the state tensors and their zeroing, the sizing beside the KV cache, and the step metadata."""

import pytest
import torch

from flotilla.services.engine.kv_cache_manager import KVCacheManager
from flotilla.services.engine.request import Request, RequestStatus
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import Scheduler, SchedulerConfig
from flotilla.services.engine.state_pool import StateCache, StateSlots, state_bytes_per_slot
from tests.engine.test_scheduler import add, plan, step

BS = 4


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), max_tokens=10)


def make_scheduler(slots: int, num_blocks: int = 64, budget: int = 64, chunk: int = 16
                   ) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(8, budget, chunk), kv, StateSlots(slots))


def test_slots_are_handed_out_lowest_first_and_come_back() -> None:
    pool = StateSlots(3)
    a, b, c, d = (_request(r) for r in "abcd")
    assert all(pool.allocate(r) for r in (a, b, c))
    assert (a.state_slot, b.state_slot, c.state_slot) == (0, 1, 2) and pool.num_free == 0
    assert not pool.allocate(d) and d.state_slot == -1  # exhausted
    assert pool.allocate(a) and a.state_slot == 0  # holding one already: no second slot
    pool.free(b)
    assert b.state_slot == -1 and pool.num_free == 1
    pool.free(b)  # holding none: nothing to give back
    assert pool.num_free == 1
    assert pool.allocate(d) and d.state_slot == 1
    pool.free(c)
    pool.free(a)
    assert pool.allocate(b) and b.state_slot == 0


def test_a_slot_freed_twice_is_an_error() -> None:
    pool = StateSlots(2)
    a, b = _request("a"), _request("b")
    pool.allocate(a)
    b.state_slot = a.state_slot  # a bookkeeping bug: two requests claim one slot
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(b)
    with pytest.raises(ValueError):
        StateSlots(0)


def test_no_request_is_admitted_without_a_free_slot() -> None:
    s = make_scheduler(slots=2)
    a, b, c = add(s, "a", 5), add(s, "b", 5, first=10), add(s, "c", 5, first=20)
    out = step(s)
    assert plan(out) == [("a", 5), ("b", 5)]  # c waits: KV and budget would fit it
    assert [r.state_slot for r in out.requests] == [0, 1]
    assert c.status is RequestStatus.WAITING and c.state_slot == -1
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert a.state_slot == -1
    out = step(s)
    assert plan(out) == [("b", 1), ("c", 5)]
    assert [r.state_slot for r in out.requests] == [1, 0]
    s.finish_request("c", RequestStatus.FINISHED_ABORTED)
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.state_slots is not None and s.state_slots.num_free == 2
    assert b.state_slot == c.state_slot == -1


def test_preemption_frees_the_slot_and_recompute_takes_one_again() -> None:
    s = make_scheduler(slots=2, num_blocks=4, chunk=0)
    a = add(s, "a", 8)
    b = add(s, "b", 7, first=100)
    assert plan(step(s)) == [("a", 8), ("b", 7)]
    out = step(s)  # a's ninth token needs b's blocks
    assert out.preempted_ids == ["b"]
    assert b.state_slot == -1 and a.state_slot == 0
    assert s.state_slots is not None and s.state_slots.num_free == 1
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    out = step(s)
    assert plan(out) == [("b", 8)] and out.requests[0].num_computed_tokens == 0
    assert out.requests[0].state_slot == b.state_slot == 0


def test_state_cache_binds_layer_views_and_zeroes_started_slots() -> None:
    class Layer:
        def __init__(self) -> None:
            self.bound: tuple[torch.Tensor, torch.Tensor] | None = None

        def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
            return (6, 3), (2, 4, 5)

        def bind_state(self, conv: torch.Tensor, rec: torch.Tensor) -> None:
            self.bound = (conv, rec)

    layers = [Layer(), Layer()]
    cache = StateCache(layers, 3, torch.bfloat16, torch.device("cpu"))
    assert cache.conv.shape == (2, 3, 6, 3) and cache.conv.dtype == torch.bfloat16
    assert cache.recurrent.shape == (2, 3, 2, 4, 5) and cache.recurrent.dtype == torch.float32
    bound = layers[1].bound
    assert bound is not None and bound[1].data_ptr() == cache.recurrent[1].data_ptr()
    cache.conv.fill_(1)
    cache.recurrent.fill_(1)
    cache.reset([2, 0])
    assert cache.recurrent[:, 1].eq(1).all() and cache.conv[:, 1].eq(1).all()
    assert cache.recurrent[:, [0, 2]].eq(0).all() and cache.conv[:, [0, 2]].eq(0).all()
    # per slot: 2 layers x (18 bf16 + 40 fp32)
    assert state_bytes_per_slot(layers, torch.bfloat16) == 2 * (18 * 2 + 40 * 4)


def test_state_pool_is_sized_with_the_kv_cache(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The KV budget is what the states leave, and the slots never take more than half."""
    from flotilla.services.engine.config import EngineConfig
    from flotilla.services.engine.model_runner import ModelRunner
    from tests.engine.test_hybrid_models import FAMILIES
    from tests.engine.test_recent_families import save_tiny

    save_tiny(tmp_path, FAMILIES["qwen3_5_text"])
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", block_size=4,
                          max_num_seqs=8, kvcache_mem_mib=1)
    runner = ModelRunner(config, str(tmp_path))
    per_slot = state_bytes_per_slot(runner.state_layers, torch.float32)
    assert runner.num_state_slots == 8 and runner.state_bytes == 8 * per_slot
    assert runner.num_blocks == ((1 << 20) - runner.state_bytes) // runner.kv_bytes_per_block()
    assert len(runner.kv_cache) == 2 * len(runner.attention) == 4  # full-attention layers only
    # a budget that would give the states more than half: fewer slots
    small = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", block_size=4,
                         max_num_seqs=256, kvcache_mem_mib=1)
    runner = ModelRunner(small, str(tmp_path))
    assert runner.num_state_slots == (1 << 20) // 2 // per_slot < 256


def test_step_metadata_carries_slots_and_initial_state_flags() -> None:
    from flotilla.services.engine.cache_sizing import dummy_request as _dummy_request
    from flotilla.services.engine.step_inputs import StepInputBuilder

    builder = StepInputBuilder(64, 4, 8, BS, torch.device("cpu"), states=True)
    fresh = _dummy_request("a", 5, [0, 1], state_slot=3)
    going = _dummy_request("b", 1, [2], state_slot=1)
    going.num_computed_tokens = 4
    meta = builder.build([fresh, going]).meta
    assert meta.state_indices is not None and meta.has_initial_state is not None
    assert meta.state_indices.tolist() == [3, 1] and meta.state_indices.dtype == torch.int32
    assert meta.has_initial_state.tolist() == [False, True]
    with pytest.raises(ValueError, match="state slot"):
        builder.build([_dummy_request("c", 2, [0], state_slot=-1)])
    plain = StepInputBuilder(64, 4, 8, BS, torch.device("cpu")).build([fresh]).meta
    assert plain.state_indices is None and plain.has_initial_state is None
