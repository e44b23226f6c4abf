"""Fair share between fairness keys (weighted VTC) and priorities, on synthetic schedules: the scheduler's service
difference between two backlogged keys stays within the bound, idle keys earn no credit, priorities order
admission and preemption; first come, first served (one key) is the reference that shows the problem."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from _support.checkpoints import tiny_spec

from loraplex.engine import LLM
from loraplex.engine.core.request import Request
from loraplex.engine.core.request_memory import RequestMemory
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from loraplex.engine.errors import RequestError
from loraplex.engine.memory.kv_cache import KVCacheManager
from loraplex.engine.memory.page_pool import PagePool
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

BLOCK = 4
ids = itertools.count()


def scheduler(*, pages: int = 256, budget: int = 32, max_seqs: int = 4, policy: str = "fair") -> Scheduler:
    pool = PagePool(
        num_pages=pages, num_layers=1, page_elems=2 * BLOCK, dtype=torch.float32, device=torch.device("cpu")
    )
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy)  # type: ignore[arg-type]
    return Scheduler(config, RequestMemory(KVCacheManager(pool, BLOCK)))


def request(key: str, prompt_len: int, max_tokens: int, *, weight: float = 1.0, priority: int = 0) -> Request:
    r = Request(f"{key}{next(ids)}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens)
    r.fairness_key, r.fairness_weight, r.priority = key, weight, priority
    return r


class Run:
    """Drives a scheduler step by step as the engine does, and keeps its own books of each key's service (prompt
    tokens x 1 + generated tokens x 2, over the key's weight): the plain reference the scheduler's counters are
    checked against."""

    def __init__(self, sched: Scheduler, weights: dict[str, float] | None = None) -> None:
        self.sched = sched
        self.weights = weights or {}
        self.served: dict[str, float] = {}
        self.step_costs: list[float] = []

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        this_step: dict[str, float] = {}
        done = []
        for s in out.scheduled:
            r = s.request
            prompt = max(0, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - r.num_computed_tokens)
            cost = prompt + (2 if s.completes_prompt else 0)
            key = r.fairness_key
            this_step[key] = this_step.get(key, 0.0) + cost / self.weights.get(key, 1.0)
            if s.completes_prompt:
                done.append(r)
        self.sched.update_from_output(out)
        for r in done:
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.max_tokens:
                self.sched.finish(r, r.status.FINISHED_LENGTH)
        for key, cost in this_step.items():
            self.served[key] = self.served.get(key, 0.0) + cost
        self.step_costs.extend(this_step.values())
        return out

    def keys_waiting(self, key: str) -> int:
        return sum(1 for r in (*self.sched.waiting, *self.sched.running) if r.fairness_key == key)


def flood(run: Run, steps: int, *, a_key: str = "a", b_key: str = "b", weight_b: float = 1.0) -> list[float]:
    """Both keys backlogged (closed loops that keep 12 requests each waiting or running, more than the 4 slots):
    A's are long, B's short; A's are sent first. Returns the service difference A - B after every step."""
    diffs = []
    for _ in range(steps):
        while run.keys_waiting(a_key) < 12:
            run.sched.add(request(a_key, 24, 8))
        while run.keys_waiting(b_key) < 12:
            run.sched.add(request(b_key, 6, 4, weight=weight_b))
        run.step()
        diffs.append(run.served.get(a_key, 0.0) - run.served.get(b_key, 0.0))
    return diffs


def test_backlogged_keys_stay_within_the_vtc_bound() -> None:
    run = Run(scheduler())
    diffs = flood(run, 300)
    bound = 2 * max(run.step_costs)
    assert max(abs(d) for d in diffs[20:]) <= bound, (max(diffs), bound)
    # The scheduler's counters are the reference's books.
    assert run.sched.service["a"] == pytest.approx(run.served["a"])
    assert run.sched.service["b"] == pytest.approx(run.served["b"])


def test_first_come_first_served_lets_the_flood_take_the_engine() -> None:
    vtc = Run(scheduler())
    flood(vtc, 300)
    vtc_share_b = vtc.served["b"] / (vtc.served["a"] + vtc.served["b"])
    fcfs_share_b = _share_of_b_under_fcfs()
    assert fcfs_share_b < 0.3 and vtc_share_b > 0.45, (fcfs_share_b, vtc_share_b)


def _share_of_b_under_fcfs() -> float:
    """B's share of the service when every request has the same key (first come, first served)."""
    sched = scheduler()
    served = {"A": 0.0, "B": 0.0}
    owner: dict[int, str] = {}
    for _ in range(300):
        for tag, prompt, out_len, cap in (("A", 24, 8, 12), ("B", 6, 4, 12)):
            while sum(1 for r in (*sched.waiting, *sched.running) if owner[id(r)] == tag) < cap:
                r = request("", prompt, out_len)
                owner[id(r)] = tag
                sched.add(r)
        out = sched.schedule()
        done = []
        for s in out.scheduled:
            r = s.request
            prompt_tokens = max(
                0, min(r.num_computed_tokens + s.num_new_tokens, r.num_prompt_tokens) - r.num_computed_tokens
            )
            served[owner[id(r)]] += prompt_tokens + (2 if s.completes_prompt else 0)
            if s.completes_prompt:
                done.append(r)
        sched.update_from_output(out)
        for r in done:
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.max_tokens:
                sched.finish(r, r.status.FINISHED_LENGTH)
    return served["B"] / (served["A"] + served["B"])


def test_weights_scale_the_share() -> None:
    run = Run(scheduler(), weights={"b": 3.0})
    flood(run, 400, weight_b=3.0)
    raw_a = run.served["a"]
    raw_b = run.served["b"] * 3.0  # undo the weight: tokens actually served
    assert 2.0 < raw_b / raw_a < 4.5, raw_b / raw_a


def test_an_idle_key_earns_no_credit() -> None:
    run = Run(scheduler())
    for _ in range(200):  # a alone for a long while
        while run.keys_waiting("a") < 12:
            run.sched.add(request("a", 24, 8))
        run.step()
    assert run.served["a"] > 1000
    before_b = dict(run.served)
    diffs = flood(run, 100)  # b arrives: lifted to a's counter, not left to catch up on 200 steps of a
    gained_a = run.served["a"] - before_b["a"]
    gained_b = run.served["b"]
    assert gained_a > 0.3 * (gained_a + gained_b), (gained_a, gained_b)
    assert max(abs(d - diffs[0]) for d in diffs) <= 2 * max(run.step_costs) + abs(diffs[0])


def test_priorities_order_admission_and_preemption() -> None:
    sched = scheduler(max_seqs=1)
    late = request("a", 4, 2, priority=1)
    urgent = request("b", 4, 2, priority=0)
    sched.add(late)
    sched.add(urgent)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [urgent]
    # Under memory pressure the least urgent running request is the one preempted.
    sched = scheduler(pages=14, budget=64, max_seqs=4)  # one request's 38 tokens fit (10 pages), two do not
    low = request("a", 8, 30, priority=5)
    high = request("b", 8, 30, priority=0)
    run = Run(sched)
    sched.add(high)
    sched.add(low)
    preempted: list[Request] = []
    for _ in range(40):
        preempted += run.step().preempted
    assert preempted and all(r is low for r in preempted)


def test_an_urgent_arrival_preempts_a_less_urgent_running_request() -> None:
    # A request of 27 tokens holds 7 of the 14 pages; a more urgent one whose 30-token prompt needs 8 takes its place.
    sched = scheduler(pages=14, budget=64, max_seqs=4)
    run = Run(sched)
    low = request("a", 8, 30, priority=1)
    sched.add(low)
    for _ in range(20):
        run.step()
    assert low in sched.running and len(low.output_token_ids) > 5
    urgent = request("b", 30, 4, priority=0)
    sched.add(urgent)
    out = run.step()
    assert out.preempted == [low]
    assert urgent in sched.running and low in sched.waiting
    # An equally urgent arrival waits its turn instead: nobody is preempted for it.
    sched = scheduler(pages=14, budget=64, max_seqs=4)
    run = Run(sched)
    first = request("a", 8, 30)
    sched.add(first)
    for _ in range(20):
        run.step()
    sched.add(request("b", 30, 4))
    assert all(not run.step().preempted for _ in range(5)) and first in sched.running


def test_an_urgent_arrival_takes_a_sequence_slot_from_a_less_urgent_request() -> None:
    sched = scheduler(max_seqs=1)
    run = Run(sched)
    low = request("a", 4, 50, priority=3)
    sched.add(low)
    run.step()
    urgent = request("b", 4, 2, priority=-1)
    sched.add(urgent)
    out = run.step()
    assert out.preempted == [low] and [s.request for s in out.scheduled] == [urgent]
    while urgent.status.name == "RUNNING" or urgent in sched.waiting:
        run.step()
    run.step()
    assert low in sched.running  # back once the urgent one finished, recomputed from its tokens
    assert low.num_preemptions == 1
    assert {k.fairness_key: k.num_preemptions for k in sched.key_service()} == {"a": 1, "b": 0}


def test_the_fcfs_policy_serves_in_arrival_order_whatever_the_keys() -> None:
    sched = scheduler(max_seqs=1, policy="fcfs")
    run = Run(sched)
    a = request("a", 4, 1)
    sched.add(a)
    run.step()
    run.step()  # a is done: "a" has service, "b" none
    later = [request("a", 4, 1, priority=5), request("b", 4, 1, priority=0)]
    for r in later:
        sched.add(r)
    assert [s.request for s in sched.schedule().scheduled] == [later[0]]  # the first to come, not the urgent one


def test_a_flood_s_running_prompts_wait_for_another_key_s_arrival() -> None:
    # Key a's long prompt is mid-prefill when b's short request arrives: b's prompt takes this step's budget first,
    # and none of a's queued requests starts before a's running prompt has gone on.
    sched = scheduler(budget=16, max_seqs=4)
    run = Run(sched)
    long = request("a", 64, 2)
    sched.add(long)
    run.step()  # 16 of its 64 prompt tokens
    queued = request("a", 64, 2)
    sched.add(queued)
    short = request("b", 8, 2)
    sched.add(short)
    out = run.step()
    assert [(s.request, s.num_new_tokens) for s in out.scheduled] == [(short, 8), (long, 8)]
    assert queued in sched.waiting


def test_the_step_that_starts_a_light_key_s_prompt_stays_short() -> None:
    """Issue 37, point 4: a flood's prompts mid-prefill fill every step until a light key's short request arrives;
    the step that starts it gives the flood at most max(16, budget // 4) tokens, and the next step the whole budget
    again. Under fcfs the flood's running prompt keeps the whole step, and the newcomer waits."""
    for policy in ("fair", "fcfs"):
        sched = scheduler(pages=4096, budget=512, max_seqs=16, policy=policy)
        run = Run(sched)
        longs = [request("a", 1024, 2) for _ in range(4)]
        for r in longs:
            sched.add(r)
        assert run.step().num_batched_tokens == 512
        short = request("b", 32, 2)
        sched.add(short)
        out = run.step()
        by_request = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        if policy == "fcfs":
            assert by_request == {longs[0].request_id: 512}
            continue
        assert by_request.pop(short.request_id) == 32
        assert by_request == {longs[0].request_id: 128} and out.num_batched_tokens == 32 + 128
        out = run.step()  # b decodes its first token's successor; the flood's prompts take the rest
        assert (
            out.num_batched_tokens == 512
            and {s.request.request_id: s.num_new_tokens for s in out.scheduled}[short.request_id] == 1
        )


def test_a_pool_full_of_half_done_prompts_of_many_keys_still_makes_progress() -> None:
    """Six keys' long prompts in a pool that holds one: their chunks interleave, so several running prompts hold all
    pages halfway; each yields to another key's waiting request, which cannot start. Found livelocked (nothing
    scheduled, forever) by the embedding tests; now they run as under plain memory pressure, preempting."""
    sched = scheduler(pages=32, budget=16, max_seqs=8)  # 32 pages of 4 tokens: 128 tokens
    requests = [request(f"k{i}", 60 + 10 * i, 1) for i in range(6)]
    for r in requests:
        sched.add(r)
    run = Run(sched)
    for _ in range(400):
        if not sched.has_unfinished():
            break
        out = run.step()
        assert out.scheduled or out.preempted or not sched.has_unfinished(), "a step did nothing"
    assert not sched.has_unfinished()
    assert sum(r.num_preemptions for r in requests) > 0


def test_the_queue_counts_its_tokens_and_stats() -> None:
    sched = scheduler(max_seqs=1)
    a, b, c = request("a", 10, 2), request("b", 7, 2, priority=1), request("a", 5, 2)
    for r in (a, b, c):
        sched.add(r)
    assert sched.num_waiting_tokens == 22
    Run(sched).step()  # a starts
    assert sched.num_waiting_tokens == 12
    assert [(q.fairness_key, q.priority, q.num_waiting, q.num_running) for q in sched.queue_stats()] == [
        ("a", 0, 1, 1),
        ("b", 1, 1, 0),
    ]
    sched.finish(b, b.status.FINISHED_ABORTED)
    assert sched.num_waiting_tokens == 5
    served = {k.fairness_key: k.num_served_tokens for k in sched.key_service()}
    assert served == {"a": 10, "b": 0}


def test_idle_keys_books_are_forgotten_past_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import loraplex.engine.core.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "_PRUNE_KEYS_ABOVE", 8)
    sched = scheduler(max_seqs=4)
    run = Run(sched)
    busy = request("busy", 40, 200)
    sched.add(busy)
    for i in range(20):  # one-off keys, each served once and gone
        one_off = request(f"user{i}", 4, 1)
        sched.add(one_off)
        while one_off.status.name in ("WAITING", "RUNNING"):
            run.step()
    assert len(sched.service) <= 9 + 1  # the limit, the busy key and the newest
    assert "busy" in sched.service


def test_the_offline_api_takes_keys_and_priorities(tmp_path: Path) -> None:
    llm = LLM(write_random_model(tmp_path / "m", tiny_spec()), device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = llm.generate(["a", "b", "c"], params, fairness_key=["x", "y", "x"], priority=[0, 1, 0])
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert set(llm.engine.scheduler.service) == {"x", "y"}
    with pytest.raises(ValueError, match="2 fairness keys"):
        llm.generate(["a", "b", "c"], params, fairness_key=["x", "y"])
    with pytest.raises(RequestError):
        llm.engine.add_request("w", [1, 2], params, fairness_weight=0)


def test_a_step_inside_a_flood_s_step_starts_only_more_urgent_newcomers_of_other_keys() -> None:
    """Issue 37, point 4 (interleaved steps, docs/decisions/0053): between two layers of a step that prefills key
    a's prompt, b's newcomer starts in a short step of its own; a's queued request, and b's next one once b has
    been served more than a, wait; the outer step's requests are neither scheduled again nor preempted."""
    sched = scheduler(pages=4096, budget=512, max_seqs=16)
    longs = [request("a", 1024, 2) for _ in range(4)]
    for r in longs:
        sched.add(r)
    outer = sched.schedule()
    assert sched.may_interleave(outer) and outer.num_batched_tokens == 512
    in_flight = [(s.request, s.num_new_tokens, s.request.num_computed_tokens) for s in outer.scheduled]
    queued_a = request("a", 64, 2)
    short, long_b = request("b", 32, 2), request("b", 64, 2)
    for r in (queued_a, short, long_b):
        sched.add(r)
    inner = sched.schedule_within(outer)
    assert [(s.request, s.num_new_tokens) for s in inner.scheduled] == [(short, 32)]
    assert inner.num_batched_tokens == 32 and not inner.preempted
    assert [(s.request, s.num_new_tokens, s.request.num_computed_tokens) for s in outer.scheduled] == in_flight
    assert queued_a in sched.waiting and long_b in sched.waiting
    assert sched.schedule_within(outer).is_empty  # b has had its turn: its counter passed a's
    sched.update_from_output(inner)
    sched.update_from_output(outer)
    assert short.num_computed_tokens == 32 and longs[0].num_computed_tokens == 512


def test_no_step_runs_inside_a_short_step_under_fcfs_or_without_room() -> None:
    fcfs = scheduler(pages=4096, budget=512, max_seqs=16, policy="fcfs")
    fcfs.add(request("a", 1024, 2))
    outer = fcfs.schedule()
    fcfs.add(request("b", 32, 2))
    assert not fcfs.may_interleave(outer) and fcfs.schedule_within(outer).is_empty
    # A decode-sized step is not worth pausing.
    small = scheduler(pages=4096, budget=512, max_seqs=16)
    small.add(request("a", 100, 2))
    assert not small.may_interleave(small.schedule())
    # No room for the newcomer: it waits for the step's end, and nobody in the step is preempted for it.
    full = scheduler(pages=130, budget=512, max_seqs=16)  # 520 tokens of pages
    long = request("a", 1024, 2)
    full.add(long)
    outer = full.schedule()
    newcomer = request("b", 32, 2)
    full.add(newcomer)
    inner = full.schedule_within(outer)
    assert inner.is_empty and not inner.preempted and long in full.running and newcomer in full.waiting
