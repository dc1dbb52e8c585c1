"""Scheduler: token budget, chunked prefill, decode-first mixing, seq cap, preemption, abort."""

from flotilla.services.engine.kv_cache_manager import KVCacheManager
from flotilla.services.engine.request import Request, RequestStatus
from flotilla.services.engine.sampling_params import SamplingParams
from flotilla.services.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

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


def add_with(s: Scheduler, rid: str, n: int, priority: int = 0, first: int = 0) -> Request:
    req = Request(rid, list(range(first, first + n)), SamplingParams(), max_tokens=100,
                  priority=priority)
    s.add_request(req)
    return req


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    s = make_scheduler(max_seqs=1, budget=64, chunk=0, caching=False)
    for rid, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0), ("f", -1)]:
        add_with(s, rid, 3, priority)
    order = []
    while s.requests:
        out = step(s)
        admitted = [r.request_id for r in out.requests if r.num_computed_tokens == 0]
        order += admitted
        for rid in admitted:
            s.finish_request(rid, RequestStatus.FINISHED_STOPPED)
    assert order == ["c", "f", "a", "e", "b", "d"]


def test_a_preempted_request_goes_back_to_its_place_by_priority() -> None:
    s = make_scheduler(num_blocks=4, budget=64, chunk=0)
    add_with(s, "a", 7, priority=1)
    b = add_with(s, "b", 8, priority=0, first=100)
    assert plan(step(s)) == [("b", 8), ("a", 7)]  # b first: the higher priority
    late_high = add_with(s, "late-high", 3, priority=-1, first=200)
    late_low = add_with(s, "late-low", 3, priority=2, first=300)
    out = step(s)  # b's 9th token needs a fifth block: a, of the lower priority, gives way
    assert out.preempted_ids == ["a"]
    assert [r.request_id for r in s.waiting] == ["late-high", "a", "late-low"]
    assert plan(out) == [("b", 1)]
    assert b.status is RequestStatus.RUNNING and late_high.status is RequestStatus.WAITING
    assert late_low.status is RequestStatus.WAITING


def test_a_long_prompt_never_stalls_running_decodes_for_more_than_the_step_budget() -> None:
    """Chunked prefill under the step budget: with a long prompt waiting, every step serves
    every running decode and at most the budget's remaining tokens of prefill."""
    budget = 16
    s = make_scheduler(num_blocks=256, max_seqs=8, budget=budget, chunk=8192)
    for i in range(3):
        add(s, f"d{i}", 2, first=10 * i)
    step(s)  # the three short prompts
    long = add(s, "long", 200, first=500)
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = step(s)
        steps += 1
        decodes = [r.request_id for r in out.requests if not r.is_prefill]
        prefill = sum(r.num_tokens for r in out.requests if r.is_prefill)
        assert decodes == ["d0", "d1", "d2"]
        assert prefill <= budget - 3 and out.num_batched_tokens <= budget
    assert steps == -(-200 // (budget - 3))


def test_cpu_engines_default_to_a_small_step_budget() -> None:
    from flotilla.services.engine.config import (
        DEFAULT_CPU_TOKEN_BUDGET,
        DEFAULT_TOKEN_BUDGET,
        EngineConfig,
    )

    assert EngineConfig(device="cpu").max_num_batched_tokens == DEFAULT_CPU_TOKEN_BUDGET
    assert EngineConfig(device="cuda").max_num_batched_tokens == DEFAULT_TOKEN_BUDGET
    assert EngineConfig(device="cpu", max_num_batched_tokens=1024).max_num_batched_tokens == 1024
    # without chunking a step must hold a whole prompt: the budget stays large
    assert EngineConfig(device="cpu", prefill_chunk_size=0).max_num_batched_tokens == 8192


def test_prompt_logprob_requests_skip_prefix_hits_and_report_their_rows() -> None:
    s = make_scheduler(budget=8, chunk=8)
    add(s, "a", 13)
    step(s), step(s)
    req = Request("b", list(range(13)), SamplingParams(prompt_logprobs=1), max_tokens=5)
    s.add_request(req)
    out = s.schedule()
    chunk = next(r for r in out.requests if r.request_id == "b")
    assert chunk.num_computed_tokens == 0  # a's cached blocks are not used
    assert chunk.prompt_logprob_rows == chunk.num_tokens and out.has_prompt_logprobs
    while req.num_computed_tokens < 13:
        out = s.schedule()
        chunk = next(r for r in out.requests if r.request_id == "b")
    # the last chunk's last row predicts the first output, not a prompt token
    assert chunk.prompt_logprob_rows == chunk.num_tokens - 1
