"""Continuous batching: token budget, chunked prefill beside decodes, admission, preemption, finishing."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.core.request import Request, RequestStatus
from loraplex.engine.core.request_memory import RequestMemory
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.page_pool import PagePool

pytestmark = pytest.mark.unit

BLOCK = 4


def _scheduler(*, pages: int = 64, budget: int = 16, max_seqs: int = 8) -> Scheduler:
    pool = PagePool(
        num_pages=pages, num_layers=1, page_elems=2 * BLOCK, dtype=torch.float32, device=torch.device("cpu")
    )
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, RequestMemory(KVCacheManager(pool, BLOCK)))


def _request(name: str, prompt_len: int) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=50), max_tokens=50)


def _advance(sched: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after a step: the scheduler books the computed tokens, completed prompts get a token."""
    done = [s.request for s in out.scheduled if s.completes_prompt]
    sched.update_from_output(out)
    for request in done:
        request.output_token_ids.append(7)


def _plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_within_the_token_budget() -> None:
    sched = _scheduler(budget=16)
    sched.add(_request("long", 40))
    out = sched.schedule()
    assert _plan(out) == [("long", 16)]
    assert not out.scheduled[0].completes_prompt
    _advance(sched, out)
    _advance(sched, sched.schedule())
    out = sched.schedule()
    assert _plan(out) == [("long", 8)]
    assert out.scheduled[0].completes_prompt


def test_decodes_first_then_new_prompts_fill_the_budget() -> None:
    sched = _scheduler(budget=16)
    sched.add(_request("a", 6))
    _advance(sched, sched.schedule())  # a prefilled, has one output token
    sched.add(_request("b", 30))
    sched.add(_request("c", 3))
    out = sched.schedule()
    # a decodes (1 token), b takes the rest of the budget as a chunk, c waits.
    assert _plan(out) == [("a", 1), ("b", 15)]
    assert out.num_batched_tokens == 16
    _advance(sched, out)
    out = sched.schedule()
    assert _plan(out) == [("a", 1), ("b", 15)]
    assert out.scheduled[1].completes_prompt
    _advance(sched, out)
    # b's prompt is done: it decodes now, and c starts.
    assert _plan(sched.schedule()) == [("a", 1), ("b", 1), ("c", 3)]


def test_max_num_seqs() -> None:
    sched = _scheduler(budget=100, max_seqs=2)
    for name in "abc":
        sched.add(_request(name, 2))
    out = sched.schedule()
    assert [r for r, _ in _plan(out)] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    sched = _scheduler(pages=4, budget=64)  # 16 tokens of KV in all
    first, second = _request("first", 8), _request("second", 8)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    _advance(sched, out)  # both hold 2 full pages and have one output token
    assert sched.memory.kv.pool.num_free == 0
    out = sched.schedule()  # first needs a third page for token 9: second is preempted
    assert out.preempted == [second]
    assert _plan(out) == [("first", 1)]
    assert second.status is RequestStatus.WAITING
    assert second.num_computed_tokens == 0 and second.blocks.block_ids == []
    assert second.num_preemptions == 1
    assert sched.waiting[0] is second
    # Its prompt and its output token are recomputed together when it returns.
    sched.finish(first, RequestStatus.FINISHED_LENGTH)
    out = sched.schedule()
    assert _plan(out) == [("second", 9)]


def test_finish_returns_pages_and_leaves_the_queues() -> None:
    sched = _scheduler()
    request = _request("a", 10)
    sched.add(request)
    _advance(sched, sched.schedule())
    assert sched.memory.kv.pool.usage().by_kind["kv"] == 3
    sched.finish(request, RequestStatus.FINISHED_ABORTED)
    assert sched.memory.kv.pool.usage().by_kind["kv"] == 0
    assert not sched.has_unfinished()
    waiting = _request("b", 3)
    sched.add(waiting)
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting
