"""What the completion routes do for KV transfer between engines (engine/serve/kv_transfer.py): check a request's
`kv_transfer_params`, fetch a remote prefill's blocks before it is queued, pin a prefill's blocks after it, report
the usage a single engine would have, and free expired pins in the background."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel

from loraplex.engine.errors import EngineError
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.jobs import Job
from loraplex.engine.serve.kv_transfer import KVTransfers
from loraplex.engine.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)


async def before_kv(kv: KVTransfers, job: Job, data: CompletionRequest | ChatCompletionRequest) -> None:
    """Check a request's kv_transfer_params and, for a remote prefill, fetch its prompt's blocks (failures cost only
    the recompute)."""
    params = data.kv_transfer_params
    if params is None:
        return
    if not kv.enabled:
        raise ApiError(
            400,
            "kv_transfer_params needs an engine started with --api-key: only the router holding it may direct KV "
            "transfers",
            param="kv_transfer_params",
        )
    if params.do_remote_decode and params.do_remote_prefill:
        raise ApiError(
            400,
            "a request is either a remote decode's prefill or a remote prefill's decode",
            param="kv_transfer_params",
        )
    if (params.do_remote_decode or params.do_remote_prefill) and (len(job.prompts) != 1 or job.n != 1):
        raise ApiError(400, "kv_transfer_params takes one prompt and one choice", param="kv_transfer_params")
    if params.do_remote_prefill:
        if params.remote_url is None:
            raise ApiError(400, "do_remote_prefill needs remote_url", param="kv_transfer_params.remote_url")
        await kv.fetch(job, params)


def billed_usage(data: CompletionRequest | ChatCompletionRequest, answer: BaseModel) -> BaseModel:
    """A remote prefill's decode reports the prefill engine's cache hits as its own: the prompt was computed there,
    so the blocks it fetched are no hit of this engine's (a prefix pull's are, and stay counted)."""
    params = data.kv_transfer_params
    usage = getattr(answer, "usage", None)
    if params is None or params.transfer_id is None or params.num_cached_tokens is None or usage is None:
        return answer
    usage.prompt_tokens_details.cached_tokens = min(params.num_cached_tokens, usage.prompt_tokens)
    return answer


async def _billed_chunks(
    data: CompletionRequest | ChatCompletionRequest, chunks: AsyncGenerator[BaseModel, None]
) -> AsyncGenerator[BaseModel, None]:
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield billed_usage(data, chunk)


class _KVTransferChunk(BaseModel):
    """A streamed prefill's last event before [DONE]: where its pinned blocks are (no choices, no usage)."""

    id: str
    object: str = "kv_transfer"
    kv_transfer_params: dict[str, Any]


async def _pinned_after(
    kv: KVTransfers, job: Job, data: CompletionRequest | ChatCompletionRequest, chunks: AsyncGenerator[BaseModel, None]
) -> AsyncGenerator[BaseModel, None]:
    """A streamed prefill for a remote decode: its chunks, then its pinned blocks' transfer (an event of its own)."""
    cached = 0
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                cached = usage.prompt_tokens_details.cached_tokens
            yield chunk
    yield _KVTransferChunk(id=job.response_id, kv_transfer_params={**await kv.pin(job), "num_cached_tokens": cached})


def transfer_stream(
    kv: KVTransfers, job: Job, data: CompletionRequest | ChatCompletionRequest, chunks: AsyncGenerator[BaseModel, None]
) -> AsyncGenerator[BaseModel, None]:
    """The chunks a streamed request sends: billed as `billed_usage` says, and a prefill's pin after them."""
    params = data.kv_transfer_params
    if params is not None and params.do_remote_decode:
        return _pinned_after(kv, job, data, chunks)
    return _billed_chunks(data, chunks)


async def after_kv(
    kv: KVTransfers,
    job: Job,
    data: CompletionRequest | ChatCompletionRequest,
    answer: CompletionResponse | ChatCompletionResponse,
) -> None:
    """A prefill for a remote decode: pin its blocks and say where they are."""
    params = data.kv_transfer_params
    if params is not None and params.do_remote_decode:
        pinned = await kv.pin(job)
        cached = answer.usage.prompt_tokens_details.cached_tokens if answer.usage is not None else 0
        answer.kv_transfer_params = {**pinned, "num_cached_tokens": cached}


async def sweep_forever(transfers: KVTransfers) -> None:
    """Free the pins whose time to live has run out, a few times per time to live."""
    interval = max(0.05, transfers.config.ttl_s / 4)
    while True:
        await asyncio.sleep(interval)
        try:
            await transfers.sweep()
        except EngineError:  # the engine has failed: nothing to free any more
            return
