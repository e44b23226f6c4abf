"""Embeddings for tenants: the call's engine request (the engine's own /v1/embeddings, with the tenant's adapter,
prefix-cache salt, fair share and tier, as completions send them), asked of a replica with the same retries, and
its answer given the platform's id and the client's model name. Usage is the inputs' tokens, metered and billed
as input tokens (cache hits apart), in one usage row per request as completions write."""

from __future__ import annotations

import secrets
from typing import Any

from loraplex.platform.domain.completions.lookups import Target
from loraplex.platform.domain.completions.service import Call, adapter_spec, next_replica
from loraplex.platform.domain.embeddings.schemas import EmbeddingRequest
from loraplex.platform.domain.fleet.client import EngineRequestError, EngineUnreachable
from loraplex.platform.resources import Resources
from loraplex.platform.service_tiers import ServiceTier

PATH = "/v1/embeddings"


def new_request_id() -> str:
    return "embd-" + secrets.token_hex(12)


def estimate_tokens(body: EmbeddingRequest, max_model_len: int = 0) -> int:
    """The tokens-per-minute limit's estimate: characters / 4, or the token ids given; each input capped at the
    model's context (`max_model_len`, 0: unknown), since the engine refuses a longer one."""
    texts, token_lists = body.texts_and_token_lists()
    sizes = [len(text) // 4 + 1 for text in texts] + [len(tokens) for tokens in token_lists]
    return sum(min(size, max_model_len) if max_model_len > 0 else size for size in sizes)


def engine_body(
    target: Target,
    body: EmbeddingRequest,
    adapter_source: str | None,
    cache_salt: str,
    fairness_key: str,
    *,
    fairness_weight: float,
    service_tier: ServiceTier,
) -> dict[str, Any]:
    """The engine request: the tenant's fields with the base model's name, and what the platform adds (the same as
    `completions.service.engine_body`: salt, fair share, tier, the adapter's files)."""
    sent: dict[str, Any] = body.model_dump(exclude_none=True, exclude={"model", "user"})
    sent |= {
        "model": target.base_model.name,
        "cache_salt": cache_salt,
        "fairness_key": fairness_key,
        "fairness_weight": fairness_weight,
        "service_tier": service_tier.value,
    }
    if target.adapter is not None:
        sent["lora_adapter"] = adapter_spec(target, adapter_source)
    return sent


async def fetch(resources: Resources, call: Call) -> dict[str, Any]:
    """The engine's answer to the call, for the client: asked of the call's replica, or of the router's next one
    when a replica refuses it before running any of it (`next_replica`). The call's tally takes its usage."""
    tried: set[str] = set()
    overloaded: list[EngineRequestError] = []
    while True:
        try:
            answer = await resources.fleet.client(call.replica).post(call.path, call.engine_body)
            break
        except (EngineUnreachable, EngineRequestError) as exc:
            await next_replica(resources, call, exc, tried, overloaded)
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    call.tally.take(usage)
    call.tally.status = "ok"
    return {
        "object": "list",
        "data": answer.get("data", []),
        "model": call.target.model,
        "usage": {
            "prompt_tokens": call.tally.prompt_tokens,
            "total_tokens": call.tally.prompt_tokens,
            "prompt_tokens_details": {"cached_tokens": call.tally.cached_tokens},
        },
    }
