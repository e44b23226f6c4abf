"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget. Running requests go first, in arrival order: a decode takes one token, a prompt
still being prefilled takes the next chunk (after the admissions, when another key's waiting request is at least
as urgent; and in a step where such a request started, a short chunk, so that the step which computes the
newcomer's prompt, and so its first token, is not held up by a full step of the others' prefill). Waiting requests
then start while budget, sequence slots and pages
last, in this order: priority (lower first, vLLM's convention), then the fairness key with the least service so
far, then arrival. When a running request cannot get the pages it needs, one not yet scheduled this step is
preempted, the least urgent, then of the most-served key, then the most recently started: its pages are freed and
it waits again at the front of the queue, to be recomputed from its prompt and the tokens it already produced (so
its output does not change). A waiting request more urgent than a running one does not wait for room either: when
the pool or the sequence slots have none for it, running requests less urgent than it are preempted (least urgent
first) until it fits.

Service is S-LoRA's Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024),
weighted: each key's counter grows by `input_token_weight` per prompt token computed and `output_token_weight` per
token generated, divided by the key's weight, charged when the step is scheduled. A key that has no request waiting
or running earns nothing while idle: when it comes back its counter is lifted to the lowest counter among the keys
with requests. With one key (every request's is "" unless a caller sets one) the order is first come, first served.
A key idle long enough that the lowest active counter has passed its own is forgotten (it would be lifted anyway),
so a stream of one-off keys (the engine server's `user` fallback) does not grow the books without bound.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from loraplex.engine.core.request import Request, RequestStatus
from loraplex.engine.core.request_memory import Refusal, RequestMemory
from loraplex.engine.core.speculator import Speculator


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Pages kept free when admitting a waiting request, so running requests can keep decoding for a while
    # before anyone must be preempted.
    watermark_pages: int = 0
    # Distinct adapters among running requests (so in any step); base-model requests do not count.
    max_adapters_per_batch: int = 32
    # VTC's cost of a prompt token and of a generated token (the paper's 1 and 2).
    input_token_weight: float = 1.0
    output_token_weight: float = 2.0
    # "fair": priority, then weighted VTC, then arrival. "fcfs" (vLLM's default): arrival alone, keys and priorities
    # ignored (the counters are still kept, for the metrics).
    policy: Literal["fair", "fcfs"] = "fair"
    # In a step where a flood's running prompts yielded to another key's admission, the most tokens those prompts
    # then get together (None: max(16, max_num_batched_tokens // 4)): the step that computes the newcomer's prompt
    # stays short, so its first token is not held behind a full step of the flood's prefill.
    yielded_prefill_tokens: int | None = None

    @property
    def yielded_prefill_limit(self) -> int:
        if self.yielded_prefill_tokens is not None:
            return self.yielded_prefill_tokens
        return max(16, self.max_num_batched_tokens // 4)


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Requests of one (fairness key, priority) waiting and running, as of a snapshot."""

    fairness_key: str
    priority: int
    num_waiting: int
    num_running: int


@dataclass(frozen=True, slots=True)
class KeyService:
    """One fairness key's books: its VTC counter, the tokens computed for it (prompt and generated) and how many of
    its requests were preempted, since the key was first seen (or last forgotten)."""

    fairness_key: str
    service: float
    num_served_tokens: int
    num_preemptions: int


# Idle keys' books are pruned once this many keys are known (see the module's docstring).
_PRUNE_KEYS_ABOVE = 4096


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens the step computes for it, speculative ones included
    # Proposed tokens the step verifies after the request's last token (the last num_spec of num_new_tokens).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token has K/V, so the step samples the request's next token."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.num_computed_tokens + known == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # The speculator asked its proposer this step: the step paid for speculation (a draft's forwards), whether or not
    # any proposal was verified, and the gate books it so.
    speculation_asked: bool = False

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step and keeps the books after it. Writes the requests' scheduling fields (status, computed
    tokens, preemptions, cached tokens); meets device memory only through `RequestMemory`."""

    def __init__(self, config: SchedulerConfig, memory: RequestMemory, speculator: Speculator | None = None) -> None:
        self.config = config
        self.memory = memory
        self.speculator = speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._running_adapters: dict[str, int] = {}  # digest -> running requests with it
        self.num_waiting_tokens = 0  # tokens the waiting requests have to compute (prompts, and outputs to redo)
        self.service: dict[str, float] = {}  # the VTC counter of each fairness key seen
        self._num_active: dict[str, int] = {}  # fairness key -> its requests waiting or running
        self._served_tokens: dict[str, int] = {}  # fairness key -> tokens computed for it
        self._preemptions: dict[str, int] = {}  # fairness key -> its requests preempted
        self._fcfs = config.policy == "fcfs"

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.memory.queued(request)
        self._enqueue(request)
        key = request.fairness_key
        if not self._num_active.get(key):  # back from idle (or new): no credit for the time away
            active = [self.service[k] for k, n in self._num_active.items() if n and k != key]
            self.service[key] = max(self.service.get(key, 0.0), min(active, default=0.0))
            if len(self.service) > _PRUNE_KEYS_ABOVE:
                self._forget_idle_keys(min(active, default=0.0))
        self._num_active[key] = self._num_active.get(key, 0) + 1

    def _forget_idle_keys(self, floor: float) -> None:
        """Drop the books of idle keys whose counter is at or below `floor`, the lowest active one: a key that comes
        back is lifted to the lowest active counter, so forgetting it changes no decision."""
        for key in [k for k, v in self.service.items() if not self._num_active.get(k) and v <= floor]:
            del self.service[key]
            self._served_tokens.pop(key, None)
            self._preemptions.pop(key, None)

    def _enqueue(self, request: Request, *, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)
        self.num_waiting_tokens += request.num_tokens

    def _dequeue(self, request: Request) -> None:
        self.waiting.remove(request)
        self.num_waiting_tokens -= request.num_tokens

    def _charge(self, scheduled: ScheduledRequest) -> None:
        """Add a scheduled chunk's cost to its key's counter: its prompt tokens, and the token it will sample."""
        request = scheduled.request
        start = request.num_computed_tokens
        prompt_tokens = max(0, min(start + scheduled.num_new_tokens, request.num_prompt_tokens) - start)
        cost = prompt_tokens * self.config.input_token_weight
        if scheduled.completes_prompt:
            cost += self.config.output_token_weight
        key = request.fairness_key
        self.service[key] = self.service.get(key, 0.0) + cost / request.fairness_weight
        self._served_tokens[key] = self._served_tokens.get(key, 0) + scheduled.num_new_tokens

    def _urgency(self, request: Request) -> tuple[int, float]:
        """Lower goes first: priority, then the key's service so far (all equal under "fcfs")."""
        if self._fcfs:
            return 0, 0.0
        return request.priority, self.service.get(request.fairness_key, 0.0)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._make_room_for_urgent(out, budget)
        num_urgent_preemptions = len(out.preempted)

        # A running prompt's next chunk waits until after admissions when another key's waiting request is at least
        # as urgent (a flood's long prefills must not hold a light key's short request back for steps).
        can_admit = not self._fcfs and bool(self.waiting) and len(self.running) < self.config.max_num_seqs
        contenders: dict[str, tuple[int, float]] | None = None  # read once, at the first running prompt
        deferred: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1 and can_admit and contenders is None:
                contenders = self._contenders()
            if remaining > 1 and contenders and self._outranked(request, contenders):
                deferred.append(request)
                i += 1
                continue
            num_new = min(remaining, budget)
            while not self.memory.can_grow(request, num_new):
                victim = self._victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.memory.grow(request, num_new)
                scheduled = ScheduledRequest(request, num_new)
                self._charge(scheduled)
                out.scheduled.append(scheduled)
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it is left to schedule

        # No new admissions in a step whose running prompts had to preempt: the pool is full.
        num_scheduled = len(out.scheduled)
        if len(out.preempted) == num_urgent_preemptions:
            budget = self._admit(out, budget, held_keys={r.fairness_key for r in deferred})
        # The deferred prompts get what the admissions left; when one of another key started, at most
        # `yielded_prefill_limit` of it, so that the step computing the newcomer's prompt ends soon.
        yielded = bool(deferred) and len(out.scheduled) > num_scheduled
        spare = min(budget, self.config.yielded_prefill_limit) if yielded else budget
        for request in deferred:  # never preempting: they had their turn
            num_new = min(request.num_tokens - request.num_computed_tokens, spare)
            if spare <= 0 or request not in self.running or not self.memory.can_grow(request, num_new):
                continue
            self.memory.grow(request, num_new)
            scheduled = ScheduledRequest(request, num_new)
            self._charge(scheduled)
            out.scheduled.append(scheduled)
            budget -= num_new
            spare -= num_new
        if deferred and not yielded and budget > 0 and len(out.preempted) == num_urgent_preemptions:
            budget = self._admit(out, budget)  # the held keys' turn, with what is left: the step stays full
        if deferred and not out.scheduled and not out.preempted:
            # Every running prompt yielded, yet nothing could start or grow: the pool is full of prompts halfway
            # through. Yielding again would repeat this step forever; they run as under plain memory pressure.
            budget = self._grow_running(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        if self.speculator is not None:
            self._speculate(out, self.speculator)
        return out

    def may_interleave(self, out: SchedulerOutput) -> bool:
        """Whether a step is long enough to pause between its layers for a newcomer (EngineCore's interleaved
        steps): under the fair policy, one with more tokens than a yielded step's prefill gets."""
        return not self._fcfs and out.num_batched_tokens > self.config.yielded_prefill_limit

    def schedule_within(self, outer: SchedulerOutput) -> SchedulerOutput:
        """A short step to run inside `outer`, between two of its layers: waiting requests start, most urgent
        first, with at most `yielded_prefill_limit` tokens, while they are at least as urgent as every key with a
        prompt chunk in `outer` and of none of those keys. Nothing of `outer` is touched: its requests are neither
        scheduled again nor preempted, and a newcomer that does not fit in the free pages and sequence slots
        waits for the next step."""
        out = SchedulerOutput()
        ranks = {
            s.request.fairness_key: self._urgency(s.request)
            for s in outer.scheduled
            if s.num_new_tokens > 1 + len(s.spec_token_ids)
        }
        if self._fcfs or not ranks or not self.waiting:
            return out
        limit = self.config.yielded_prefill_limit
        budget = self._admit(out, limit, held_keys=set(ranks), most=min(ranks.values()))
        out.num_batched_tokens = limit - budget
        return out

    def _grow_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running requests in order, preempting the least urgent when one cannot grow; the budget
        left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.memory.can_grow(request, num_new):
                victim = self._victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            self.memory.grow(request, num_new)
            scheduled = ScheduledRequest(request, num_new)
            self._charge(scheduled)
            out.scheduled.append(scheduled)
            budget -= num_new
            i += 1
        return budget

    def _speculate(self, out: SchedulerOutput, speculator: Speculator) -> None:
        """Give decoding rows the proposals the speculator picks for the step's free room, where their KV can grow
        by that much without preempting anyone (speculation never costs another request its place)."""
        rows = [
            s for s in out.scheduled if s.num_new_tokens == 1 and s.completes_prompt and speculator.eligible(s.request)
        ]
        if not rows:
            return
        plans = speculator.plan(
            [s.request for s in rows],
            scheduled_tokens=out.num_batched_tokens,
            token_budget=self.config.max_num_batched_tokens,
            num_sampling_rows=sum(1 for s in out.scheduled if s.completes_prompt),
        )
        out.speculation_asked = speculator.asked
        for scheduled, proposal in zip(rows, plans, strict=True):
            if proposal and self.memory.can_grow(scheduled.request, 1 + len(proposal)):
                self.memory.grow(scheduled.request, 1 + len(proposal))
                scheduled.spec_token_ids = proposal
                scheduled.num_new_tokens += len(proposal)
                out.num_batched_tokens += len(proposal)

    def _contenders(self) -> dict[str, tuple[int, float]]:
        """The two most urgent keys among the waiting requests that could start, with their urgency."""
        best: dict[str, tuple[int, float]] = {}
        for request in self.waiting:
            if request.prefill_after is not None and not request.prefill_after.is_prefilled:
                continue
            rank = self._urgency(request)
            key = request.fairness_key
            if key not in best or rank < best[key]:
                best[key] = rank
        return dict(sorted(best.items(), key=lambda item: item[1])[:2])

    def _outranked(self, request: Request, contenders: dict[str, tuple[int, float]]) -> bool:
        """Another key's waiting request is at least as urgent as `request`."""
        rank = self._urgency(request)
        return any(key != request.fairness_key and other <= rank for key, other in contenders.items())

    def _make_room_for_urgent(self, out: SchedulerOutput, budget: int) -> None:
        """Preempt running requests less urgent than the most urgent waiting one while it cannot start for lack of
        pages or sequence slots (least urgent first, as under memory pressure). A request that could not start
        anyway (its adapter still loading, or another choice of its prompt not prefilled yet) preempts nobody."""
        if self._fcfs or not self.waiting or not self.running:
            return
        urgent = min(self.waiting, key=lambda r: r.priority)  # the first of the most urgent: min keeps the first
        if urgent.priority >= max(r.priority for r in self.running):
            return
        if urgent.prefill_after is not None and not urgent.prefill_after.is_prefilled:
            return
        while True:
            less_urgent = [j for j, r in enumerate(self.running) if r.priority > urgent.priority]
            if not less_urgent:
                return
            if len(self.running) < self.config.max_num_seqs:
                fit = self.memory.fits(urgent, budget, reserve=self.config.watermark_pages)
                if fit is not Refusal.NO_ROOM:
                    return  # it fits, or it waits for its adapter: nobody need make room
            index = max(less_urgent, key=lambda j: (*self._urgency(self.running[j]), j))
            victim = self.running.pop(index)
            self._preempt(victim)
            out.preempted.append(victim)

    def _victim(self, first: int) -> Request:
        """The request to preempt among running[first:] (those not scheduled yet this step): the least urgent, of
        the most-served key, the most recently started."""
        candidates = range(first, len(self.running))
        index = max(candidates, key=lambda j: (*self._urgency(self.running[j]), j))
        return self.running[index]

    def _admit(
        self,
        out: SchedulerOutput,
        budget: int,
        held_keys: set[str] | frozenset[str] = frozenset(),
        most: tuple[int, float] | None = None,
    ) -> int:
        """Start waiting requests in arrival order while budget, sequence slots and pages last. Requests of
        `held_keys` (keys whose running prompts were deferred to these admissions) wait: their running prompts go on
        before anything new of theirs starts. With `most`, admission stops at the first request less urgent than it.

        A request whose adapter is still loading is passed over (so resident adapters' requests go first and the load
        never stalls the queue), and so is one waiting for another choice of its prompt to be prefilled
        (`Request.prefill_after`). A request held back by the adapter cap, or by the pool's room (for its blocks
        or its loaded adapter), stops admission instead: nothing that arrived later overtakes it, so it starts as
        soon as the requests already running drain (a bounded wait), never starved by newcomers of popular adapters.
        """
        passed_over: set[int] = set()  # ids of requests that cannot start this step but do not block the others
        # One key and one priority among the waiting (the common case): the order is the queue's, and no pick needs
        # a scan of the whole queue.
        first = self.waiting[0] if self.waiting else None
        in_order = (
            self._fcfs
            or first is None
            or all(r.fairness_key == first.fairness_key and r.priority == first.priority for r in self.waiting)
        )
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting(passed_over, in_order=in_order)
            if request is None:
                break
            if request.prefill_after is not None and not request.prefill_after.is_prefilled:
                passed_over.add(id(request))  # another choice of its prompt prefills it now: start after it
                continue
            if request.fairness_key in held_keys:
                passed_over.add(id(request))
                continue
            if most is not None and self._urgency(request) > most:
                break  # the most urgent left (or, in queue order, all of one rank): none after it qualifies
            digest = request.adapter_digest
            new_adapter = digest is not None and digest not in self._running_adapters
            if new_adapter and len(self._running_adapters) >= self.config.max_adapters_per_batch:
                break
            admission = self.memory.admit(request, budget, reserve=self.config.watermark_pages)
            if admission is Refusal.ADAPTER_NOT_READY:
                passed_over.add(id(request))  # still loading (or failed: the engine finishes it): look further
                continue
            if admission is Refusal.NO_ROOM:
                break
            self._dequeue(request)
            request.num_computed_tokens = admission.num_cached_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(admission.num_cached_tokens, request.num_prompt_tokens)
                self.memory.record_first_start(request)
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if digest is not None:
                self._running_adapters[digest] = self._running_adapters.get(digest, 0) + 1
            scheduled = ScheduledRequest(request, admission.num_new_tokens)
            out.scheduled.append(scheduled)
            budget -= admission.num_new_tokens
            # Charged now, before the counter is next read: the next pick this step already sees it. (The chunk's
            # computed count is still the admitted one, cached tokens included, so only new tokens cost.)
            self._charge(scheduled)
        return budget

    def _next_waiting(self, passed_over: set[int], *, in_order: bool) -> Request | None:
        """The waiting request to try next: lowest (priority, key's service), then the one nearest the front."""
        if in_order:
            return next((r for r in self.waiting if id(r) not in passed_over), None)
        best: Request | None = None
        best_rank: tuple[int, float] | None = None
        for request in self.waiting:
            if id(request) in passed_over:
                continue
            rank = self._urgency(request)
            if best_rank is None or rank < best_rank:
                best, best_rank = request, rank
        return best

    def update_from_output(self, out: SchedulerOutput) -> None:
        """After the step ran: each scheduled request's new tokens have K/V, and its newly full blocks go to the
        prefix cache."""
        for scheduled in out.scheduled:
            # Speculative tokens are booked once verified (book_verified): a refused one's K/V is garbage.
            scheduled.request.num_computed_tokens += scheduled.num_new_tokens - len(scheduled.spec_token_ids)
            self.memory.computed(scheduled.request)

    def book_verified(self, request: Request, num_accepted: int) -> None:
        """After verification: the kept proposals' K/V are the request's (its output now holds those tokens); the
        blocks past them go back to the pool."""
        request.num_computed_tokens += num_accepted
        self.memory.computed(request)
        self.memory.rollback(request)

    def _stop_running(self, request: Request) -> None:
        """A request leaves the running list (preempted or finished): its blocks go back, its adapter is unpinned."""
        self.memory.release(request, running=True)
        digest = request.adapter_digest
        if digest is None:
            return
        left = self._running_adapters[digest] - 1
        if left:
            self._running_adapters[digest] = left
        else:
            del self._running_adapters[digest]

    def _preempt(self, request: Request) -> None:
        self._stop_running(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=True)
        key = request.fairness_key
        self._preemptions[key] = self._preemptions.get(key, 0) + 1

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give back its memory (finished, aborted or failed)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._stop_running(request)
        else:
            self.memory.release(request, running=False)
            if request in self.waiting:
                self._dequeue(request)
        self.memory.finished(request)
        if self.speculator is not None:
            self.speculator.proposer.release(request)
        request.status = status
        key = request.fairness_key
        self._num_active[key] -= 1
        if not self._num_active[key]:
            del self._num_active[key]

    def queue_stats(self) -> list[QueueStats]:
        """Waiting and running requests per (fairness key, priority), sorted."""
        counts: dict[tuple[str, int], list[int]] = {}
        for request in self.waiting:
            counts.setdefault((request.fairness_key, request.priority), [0, 0])[0] += 1
        for request in self.running:
            counts.setdefault((request.fairness_key, request.priority), [0, 0])[1] += 1
        return [QueueStats(key, priority, w, r) for (key, priority), (w, r) in sorted(counts.items())]

    def key_service(self) -> list[KeyService]:
        """Every known key's books, sorted by key."""
        return [
            KeyService(key, service, self._served_tokens.get(key, 0), self._preemptions.get(key, 0))
            for key, service in sorted(self.service.items())
        ]
