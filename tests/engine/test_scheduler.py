"""Scheduler: token budget, chunked prefill, decode-first mixing, seq cap, preemption, abort."""

from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request, RequestStatus
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

BS = 4


def make_scheduler(
    num_blocks: int = 64, max_seqs: int = 8, budget: int = 32, chunk: int = 16, caching: bool = True
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, chunk), kv)


def add(s: Scheduler, rid: str, n: int, first: int = 0) -> Request:
    req = Request(rid, list(range(first, first + n)), SamplingParams(), max_tokens=100)
    s.add_request(req)
    return req


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule and feed back a fake sampled token, as the Engine would."""
    out = s.schedule()
    for r in out.requests:
        if r.samples:
            s.requests[r.request_id].token_ids.append(token)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, r.num_tokens) for r in out.requests]


def test_prompt_is_chunked_and_then_decodes() -> None:
    s = make_scheduler(chunk=8)
    a = add(s, "a", 20)
    out = step(s)
    assert plan(out) == [("a", 8)] and out.requests[0].is_prefill and not out.requests[0].samples
    assert out.requests[0].token_ids == list(range(8))
    assert plan(step(s)) == [("a", 8)]
    out = step(s)
    assert plan(out) == [("a", 4)] and out.requests[0].samples
    assert out.requests[0].num_computed_tokens == 16
    out = step(s)
    assert plan(out) == [("a", 1)] and not out.requests[0].is_prefill
    assert out.requests[0].token_ids == [7] and out.requests[0].num_computed_tokens == 20
    assert a.block_ids == [0, 1, 2, 3, 4, 5]


def test_no_chunking_schedules_whole_prompt_or_waits() -> None:
    s = make_scheduler(budget=16, chunk=0)
    add(s, "a", 10)
    add(s, "b", 10, first=50)
    assert plan(step(s)) == [("a", 10)]  # b does not fit in the 6 tokens left
    assert plan(step(s)) == [("a", 1), ("b", 10)]


def test_decodes_go_first_then_prefill_chunks_share_the_budget() -> None:
    s = make_scheduler(budget=10, chunk=16)
    add(s, "a", 3)
    add(s, "b", 3, first=10)
    assert plan(step(s)) == [("a", 3), ("b", 3)]
    add(s, "c", 30, first=20)
    assert plan(step(s)) == [("a", 1), ("b", 1), ("c", 8)]
    add(s, "d", 5, first=60)
    # c's running prefill continues before d is admitted; d takes what is left.
    assert plan(step(s)) == [("a", 1), ("b", 1), ("c", 8)]
    s.config.max_num_batched_tokens = 20
    assert plan(step(s)) == [("a", 1), ("b", 1), ("c", 14), ("d", 4)]


def test_max_num_seqs_caps_running_requests() -> None:
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(s, rid, 2)
    assert plan(step(s)) == [("a", 2), ("b", 2)]
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert plan(step(s)) == [("b", 1), ("c", 2)]


def test_preemption_recomputes_newest_request_and_frees_its_blocks() -> None:
    s = make_scheduler(num_blocks=4, budget=64, chunk=0)
    a = add(s, "a", 8)  # blocks 0, 1
    b = add(s, "b", 7, first=100)  # blocks 2, 3
    assert plan(step(s)) == [("a", 8), ("b", 7)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    # a's 9th token needs a fifth block: b (newest) is preempted, its blocks go to a.
    out = step(s)
    assert out.preempted_ids == ["b"]
    assert plan(out) == [("a", 1)]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert a.block_ids == [0, 1, 3]  # block 3 (b's uncached tail) was freed before block 2
    assert list(s.waiting) == [b]
    s.finish_request("a", RequestStatus.FINISHED_STOPPED)
    # b is recomputed: prompt plus the token it had generated; its first block (cached, and
    # kept because a took the never-cached block 3) is a prefix hit.
    out = step(s)
    assert plan(out) == [("b", 4)] and out.requests[0].is_prefill and out.requests[0].samples
    assert out.requests[0].num_computed_tokens == 4
    assert out.requests[0].token_ids == [104, 105, 106, 7]
    assert b.block_ids == [2, 3]


def test_running_prefill_chunk_can_preempt_itself() -> None:
    s = make_scheduler(num_blocks=3, budget=5, chunk=4)
    a = add(s, "a", 2)
    b = add(s, "b", 12, first=50)
    assert plan(step(s)) == [("a", 2), ("b", 3)]  # a: block 0, b: block 1
    assert plan(step(s)) == [("a", 1), ("b", 4)]  # b: block 2
    out = step(s)  # b's next chunk needs a fourth block: b, the newest, preempts itself
    assert out.preempted_ids == ["b"] and plan(out) == [("a", 1)]
    assert s.waiting[0] is b and b.block_ids == [] and a.block_ids == [0]
    assert s.kv.num_free_blocks == 2


def test_abort_frees_blocks_at_once_wherever_the_request_is() -> None:
    s = make_scheduler(num_blocks=8, max_seqs=1)
    a = add(s, "a", 9)
    add(s, "b", 3)
    step(s)
    assert s.kv.num_free_blocks == 5
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED) is a
    assert a.status is RequestStatus.FINISHED_ABORTED and s.kv.num_free_blocks == 8
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished() and s.schedule().is_empty


def test_admission_uses_prefix_cache_hit() -> None:
    s = make_scheduler(chunk=0)
    a = add(s, "a", 10)
    step(s)
    b = add(s, "b", 9)  # same first 8 tokens
    out = step(s)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.requests[1].num_computed_tokens == 8 and out.requests[1].is_prefill
    assert b.block_ids[:2] == a.block_ids[:2] and b.num_cached_tokens == 8
    assert s.prefix_hit_tokens == 8


def test_random_workload_keeps_block_accounting_consistent() -> None:
    """Arrivals, shared prefixes, aborts and preemptions under a tight pool: no block leaks."""
    import random

    rng = random.Random(0)
    s = make_scheduler(num_blocks=10, max_seqs=4, budget=10, chunk=6)
    done: set[str] = set()
    for step_no in range(300):
        if rng.random() < 0.3:
            prefix = [1, 2, 3, 4] if rng.random() < 0.5 else []
            rid = f"r{step_no}"
            s.add_request(Request(rid, prefix + [rng.randrange(5, 50) for _ in range(
                rng.randrange(1, 14))], SamplingParams(), max_tokens=rng.randrange(1, 20)))
        if s.requests and rng.random() < 0.05:
            s.finish_request(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
        out = s.schedule()
        for r in out.requests:
            assert len(r.block_ids) * BS >= r.num_computed_tokens + r.num_tokens
        for r in out.requests:
            if r.samples:
                req = s.requests[r.request_id]
                if req.append_token(rng.randrange(5, 50)) is not None:
                    s.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
                    done.add(r.request_id)
        refs = sum(len(r.block_ids) for r in s.running)
        assert sum(s.kv.pool.ref_cnt) == refs
        assert all(not r.block_ids for r in s.waiting)
        assert s.kv.pool.num_used_blocks == sum(1 for c in s.kv.pool.ref_cnt if c > 0)
    for rid in list(s.requests):
        s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 10 and sum(s.kv.pool.ref_cnt) == 0
    assert s.num_preemptions > 0 and done
