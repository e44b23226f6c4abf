"""POST /v1/embeddings, OpenAI's shape: `input` a string, a list of strings, a list of token ids or a list of them;
`dimensions` (the first that many components, normalized again where the model normalizes); `encoding_format`
"float" or "base64" (little-endian float32, what the SDK decodes); `model` the base model or one of its adapters
(or, from a trusted caller, `lora_adapter`, as on completions). Each input is one engine request of the embedding
model (engine/core/pooling.py), batched with the others by the scheduler at the request's priority (`priority`,
else its `service_tier`'s); usage counts their prompt tokens (and the cached ones, which the platform bills apart)."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from loraplex.engine.core.outputs import RequestOutput
from loraplex.engine.core.pooling import EMBEDDING_PARAMS
from loraplex.engine.errors import RequestError
from loraplex.engine.serve.api_errors import ApiError
from loraplex.engine.serve.async_engine import RequestFailed, RequestStream
from loraplex.engine.serve.jobs import unless_disconnected
from loraplex.engine.serve.lora_registry import LORA_ADAPTER_PARAM
from loraplex.engine.serve.lora_spec import LoraAdapterSpec
from loraplex.engine.serve.protocol import SERVICE_TIER_PRIORITY, PromptTokensDetails

if TYPE_CHECKING:
    from litestar import Request

    from loraplex.engine.serve.serving import OpenAIServing

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    # Trusted callers (the platform), as on completions: the adapter's files, the prefix-cache salt, the fair-share
    # key and weight, and the scheduler's priority (vLLM's) or OpenAI's service tier.
    lora_adapter: LoraAdapterSpec | None = None
    cache_salt: str | None = None
    fairness_key: str | None = None
    fairness_weight: float | None = None
    priority: StrictInt = 0
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None

    @property
    def effective_priority(self) -> int:
        """`priority` when given, else the service tier's (flex below default below priority)."""
        if "priority" in self.model_fields_set:
            return self.priority
        tier = "default" if self.service_tier in (None, "auto") else str(self.service_tier)
        return SERVICE_TIER_PRIORITY[tier]

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or (
            isinstance(value, list)
            and (
                all(isinstance(v, str) for v in value)
                or all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                or all(
                    isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
                    for v in value
                )
            )
        )
        if not ok:
            raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists")
        return value

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding asked for; RequestError for an empty one or too many."""
        value = self.input
        items: list[str | list[int]]
        if isinstance(value, str):
            items = [value]
        elif value and all(isinstance(v, int) for v in value):
            items = [list(value)]  # type: ignore[arg-type]
        else:
            items = list(value)  # type: ignore[arg-type]
        if not items:
            raise RequestError("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise RequestError(f"input holds {len(items)} items; at most {MAX_INPUTS} per request", param="input")
        for item in items:
            if (isinstance(item, str) and not item) or (isinstance(item, list) and not item):
                raise RequestError("input must not contain an empty string or an empty list of tokens", param="input")
        return items


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embeddings(
    serving: OpenAIServing, body: EmbeddingRequest, request: Request[Any, Any, Any]
) -> EmbeddingResponse:
    """Every input's embedding, in order; RequestError (400) for bad input or a model that does not embed."""
    model, lora = serving._check_model(body.model, body.lora_adapter)
    core = serving.engine.core
    core.check_task(embedding=True)
    items = body.inputs()
    token_lists: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            token_lists.append(await serving._encode(item, add_special_tokens=True, param="input"))
        else:
            token_lists.append(item)
    response_id = f"embd-{uuid.uuid4().hex}"
    streams: list[RequestStream] = []
    try:
        for index, token_ids in enumerate(token_lists):
            try:  # context length and vocabulary, before anything is queued
                checked = core.check_request(token_ids, EMBEDDING_PARAMS)
            except RequestError as exc:
                exc.param = "input"
                raise
            streams.append(
                serving.engine.submit(
                    checked,
                    request_id=f"{response_id}-{index}",
                    lora=lora,
                    cache_salt=body.cache_salt,
                    fairness_key=body.fairness_key or "",
                    fairness_weight=body.fairness_weight if body.fairness_weight is not None else 1.0,
                    priority=body.effective_priority,
                    pooling=core.pooling_state(body.dimensions),
                )
            )

        async def finals() -> list[RequestOutput]:
            async def last(stream: RequestStream) -> RequestOutput:
                outputs = [output async for output in stream]  # one: an embedding request's output comes at its end
                if not outputs or outputs[-1].embedding is None:
                    raise RuntimeError("an embedding request finished without its vector")
                return outputs[-1]

            return list(await asyncio.gather(*(last(stream) for stream in streams)))

        try:
            outputs = await unless_disconnected(request, finals())
        except RequestFailed as exc:
            if exc.is_client_error:  # the adapter's fault: name the field that chose it
                param = LORA_ADAPTER_PARAM if body.lora_adapter is not None else "model"
                raise ApiError(400, str(exc), code="lora_adapter_load_failed", param=param) from exc
            raise
    finally:
        for stream in streams:
            stream.close()
    num_prompt = sum(len(tokens) for tokens in token_lists)
    return EmbeddingResponse(
        id=response_id,
        created=int(time.time()),
        model=model,
        data=[
            Embedding(index=i, embedding=_encoded(out.embedding or [], body.encoding_format))
            for i, out in enumerate(outputs)
        ],
        usage=EmbeddingUsage(
            prompt_tokens=num_prompt,
            total_tokens=num_prompt,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outputs)),
        ),
    )
