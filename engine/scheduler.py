"""Continuous batching: which requests run this step, and how many of their tokens.

Every step has a token budget. Running requests go first, in arrival order: a decode takes one token, a prompt
still being prefilled takes the next chunk. Waiting requests then start while budget, sequence slots and pages
last. When a running request cannot get the pages it needs, the most recently started running request is
preempted: its pages are freed and it waits again at the front of the queue, to be recomputed from its prompt
and the tokens it already produced (so its output does not change).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    # Pages kept free when admitting a waiting request, so running requests can keep decoding for a while
    # before anyone must be preempted.
    watermark_pages: int = 0


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token has K/V, so the step samples the request's next token."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.can_allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                self.kv.allocate(request, num_new)
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it is left to schedule

        # No new admissions in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.can_allocate(request, num_new, reserve=self.config.watermark_pages):
                break
            self.waiting.popleft()
            self.kv.allocate(request, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give back its pages (finished or aborted)."""
        request.status = status
        self.kv.free(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
