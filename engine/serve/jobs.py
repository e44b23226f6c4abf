"""One HTTP request's engine requests: the job (its prompts, choices, parameters and identity), its outputs merged
from every choice's stream, what each output adds to its choice, the usage of the whole, and waiting on a client
that may leave."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from litestar import Request

from loraplex.engine.core.outputs import PositionLogprobs, RequestOutput
from loraplex.engine.core.request_check import CheckedPrompt
from loraplex.engine.core.sampling_params import SamplingParams
from loraplex.engine.lora.ref import AdapterRef
from loraplex.engine.serve.api_errors import ClientDisconnected
from loraplex.engine.serve.async_engine import AsyncEngine, RequestStream
from loraplex.engine.serve.protocol import Usage

T = TypeVar("T")


@dataclass(slots=True)
class JobPrompt:
    checked: CheckedPrompt  # its token ids, checked once, here
    text: str | None  # the prompt as text, for echo (decoded when it came as token ids)

    @property
    def token_ids(self) -> list[int]:
        return self.checked.token_ids


@dataclass(slots=True)
class Job:
    """One HTTP request: its engine requests share the response id, arrival time, parameters and adapter."""

    response_id: str
    created: int
    prompts: list[JobPrompt]
    params: SamplingParams
    arrived: float  # perf_counter() when the HTTP request reached its handler
    model: str  # the name the client asked for (the base model's or an adapter's), echoed in responses
    lora: AdapterRef | None  # None: the base model
    lora_param: str = "model"  # the request field that named the adapter, for errors about it
    cache_salt: str | None = None  # the request's prefix-cache salt
    n: int = 1  # choices per prompt: choice i is choice i % n of prompt i // n
    fairness_key: str = ""
    fairness_weight: float = 1.0
    priority: int = 0
    service_tier: str = "default"  # OpenAI's tier the request is served in, echoed in responses
    streams: list[RequestStream] = field(default_factory=list)  # each choice's, once submitted (`start`)

    def envelope(self) -> dict[str, Any]:
        """The fields every answer and chunk of this job carries besides its choices and usage."""
        return {"id": self.response_id, "created": self.created, "model": self.model, "service_tier": self.service_tier}

    def start(self, engine: AsyncEngine) -> None:
        """Queue every choice in the engine, now: EngineOverloaded (or any error of a submission) comes before the
        answer's first byte, and leaves none of the job's requests queued."""
        try:
            for index in range(self.num_choices):
                self.streams.append(
                    engine.submit(
                        self.checked(index),
                        request_id=self.request_id(index),
                        lora=self.lora,
                        cache_salt=self.cache_salt,
                        prefill_after=self.prefill_after(index),
                        fairness_key=self.fairness_key,
                        fairness_weight=self.fairness_weight,
                        priority=self.priority,
                    )
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Abort every submitted choice that has not finished (idempotent): the job's answer ended, or never began."""
        for stream in self.streams:
            stream.close()

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> JobPrompt:
        return self.prompts[index // self.n]

    def request_id(self, index: int) -> str:
        return self.response_id if self.num_choices == 1 else f"{self.response_id}-{index}"

    def checked(self, index: int) -> CheckedPrompt:
        """Choice `index`'s engine request: its prompt, with that choice's parameters (its own seed stream)."""
        checked = self.prompt_of(index).checked
        return dataclasses.replace(checked, params=checked.params.choice(index % self.n))

    def prefill_after(self, index: int) -> str | None:
        """The request id of the first choice of `index`'s prompt, which prefills it for the others."""
        return self.request_id(index - index % self.n) if index % self.n else None


@dataclass(slots=True)
class Delta:
    """What one engine output adds to choice `index` of a stream."""

    index: int
    text: str  # never sent before
    token_ids: list[int]  # the tokens generated since the previous delta
    logprobs: list[PositionLogprobs] | None  # theirs, when asked for
    output: RequestOutput  # the cumulative output (finish_reason, stop_reason)
    sent: Mapping[int, RequestOutput]  # each choice's output as of its latest delta, this one included (shared)


async def merge(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of every stream as they come, tagged with the stream's index; the first error ends all of them.

    Closing this generator cancels the streams' pumps, which closes (and so aborts) each stream.
    """
    done: Final = object()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
        except Exception as exc:
            queue.put_nowait((index, exc))
        else:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request[Any, Any, Any]) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request[Any, Any, Any], work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientDisconnected
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def job_usage(job: Job, outputs: Mapping[int, RequestOutput]) -> Usage:
    """Usage of the whole job as of one output per choice (the final ones, for the final usage); a choice with no
    output yet counts its prompt only."""
    # Each prompt counts once, with its first choice's cached tokens: the other choices reuse the blocks it computed.
    return Usage.of(
        num_prompt_tokens=sum(len(p.token_ids) for p in job.prompts),
        num_completion_tokens=sum(len(out.outputs[0].token_ids) for out in outputs.values()),
        num_cached_tokens=sum(out.num_cached_tokens for index, out in outputs.items() if index % job.n == 0),
        num_reasoning_tokens=sum(
            reasoning.num_tokens for out in outputs.values() if (reasoning := out.outputs[0].reasoning) is not None
        ),
    )
