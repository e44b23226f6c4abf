"""Completions for tenants: resolve `model`, apply limits, route to an engine, relay its stream, record usage.

The engine speaks OpenAI's protocol too; this layer is what a hosted API adds: the tenant's names (endpoints)
resolved to a base model and an adapter reference the platform built itself (never a path a tenant chose),
rate limits, the choice of replica, its own response ids and model names, and one usage row per request, written
even when the client goes away (billing exactly what was sent).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from loraplex.platform.auth import TenantPrincipal
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.completions.lookups import Target, TenantTerms
from loraplex.platform.domain.completions.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.domain.embeddings.schemas import EmbeddingRequest
from loraplex.platform.domain.fleet.client import (
    OVERLOADED,
    EngineRequestError,
    EngineUnavailable,
    EngineUnreachable,
)
from loraplex.platform.domain.fleet.registry import Choice, Replica
from loraplex.platform.domain.usage.recorder import UsageEvent
from loraplex.platform.errors import RETRY_AFTER_S, ApiError, invalid_request
from loraplex.platform.resources import Resources
from loraplex.platform.service_tiers import ServiceTier

logger = logging.getLogger(__name__)

# Replicas a request may be offered to when they refuse it before running any of it: the connection (a crashed
# engine's registry entry lives until its TTL runs out), or with a 503 (a full waiting queue: `overloaded`); the
# request has run on none of them, so trying another is safe.
MAX_REPLICA_TRIES = 3

Request = ChatCompletionRequest | CompletionRequest


@dataclass(slots=True)
class UsageTally:
    """Token counts of what has been sent to the client so far (cumulative, from the engine's running usage)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # the completion tokens inside a think block (counted in completion_tokens)
    status: str = "cancelled"  # until a finish reason arrives

    def take(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.prompt_tokens = int(usage.get("prompt_tokens", self.prompt_tokens))
        self.completion_tokens = int(usage.get("completion_tokens", self.completion_tokens))
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens", self.cached_tokens))
        completion_details = usage.get("completion_tokens_details") or {}
        reasoning = int(completion_details.get("reasoning_tokens", self.reasoning_tokens))
        # Reasoning tokens are completion tokens; held to them so that an engine's miscount can never make a usage
        # row the recorder refuses (the request would then go unbilled).
        self.reasoning_tokens = min(reasoning, self.completion_tokens)

    def usage(self) -> dict[str, Any]:
        """The usage object a client is given, in OpenAI's shape."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        }


@dataclass(slots=True)
class Call:
    request_id: str
    principal: TenantPrincipal
    target: Target
    body: Request | EmbeddingRequest
    replica: Replica
    engine_body: dict[str, Any]
    path: str
    service_tier: ServiceTier  # resolved: what the engine is asked for, the client is told and the usage row says
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    tally: UsageTally = field(default_factory=UsageTally)
    warm_peer: Replica | None = None  # another replica that may hold the prompt's prefix (Choice.warm_peer)
    running_usage: bool = False  # chunks keep their running usage for the client's protocol (Anthropic's stream)


async def resolve(resources: Resources, principal: TenantPrincipal, model: str) -> Target:
    """An endpoint of this tenant by name, else a base model by name; anything else (another tenant's endpoint
    included) is 404 model_not_found. Cached (`CompletionLookups`)."""
    return await resources.lookups.target(principal.tenant_id, model)


async def tenant_terms(resources: Resources, principal: TenantPrincipal) -> TenantTerms:
    """The tenant's terms (a tenant deleted since its key was cached: the defaults). Cached (`CompletionLookups`)."""
    return await resources.lookups.terms(principal.tenant_id)


def resolve_service_tier(requested: str | None, allowed: Sequence[ServiceTier]) -> ServiceTier:
    """The tier a request runs on: what it named, `auto` (or nothing) being `default`; 400
    `service_tier_not_allowed` when the tenant may not use it (the schema has refused anything that is no tier)."""
    tier = ServiceTier.DEFAULT if requested is None or requested == "auto" else ServiceTier(requested)
    if tier not in allowed:
        names = ", ".join(f"'{t.value}'" for t in allowed)
        raise ApiError(
            400,
            f"This account may not use service_tier '{tier.value}'; it may use {names} (or 'auto', which is "
            "'default'). An administrator grants other tiers.",
            code="service_tier_not_allowed",
            param="service_tier",
        )
    return tier


def estimate_tokens(body: Request, max_model_len: int = 0) -> int:
    """A cheap upper-ish estimate for the tokens-per-minute limit: prompt characters / 4 plus the output limit,
    capped at the model's context (`max_model_len`, 0: unknown) since no request can use more. Without the cap an
    oversized max_tokens would be refused as too large for the rate limit instead of by the engine, with its
    clearer context_length_exceeded."""
    if isinstance(body, ChatCompletionRequest):
        prompt_chars = sum(len(m.text()) for m in body.messages)
        prompt_chars += sum(len(t.model_dump_json()) for t in body.tools or ())  # the template lists them
    else:
        prompt_chars = len(body.prompt) * 4 if isinstance(body.prompt, list) else len(body.prompt)
    estimate = prompt_chars // 4 + (body.limit or 256) * body.n  # every choice may run to the limit
    return min(estimate, max_model_len) if max_model_len > 0 else estimate


def engine_body(
    target: Target,
    body: Request,
    adapter_source: str | None,
    cache_salt: str,
    fairness_key: str = "",
    *,
    fairness_weight: float = 1.0,
    service_tier: ServiceTier = ServiceTier.DEFAULT,
) -> dict[str, Any]:
    """The engine request: the tenant's fields, the endpoint's defaults under them, always streamed with running
    usage (so billing knows what each relayed chunk cost), and the tenant's `cache_salt`, which keeps its prefix-cache
    blocks apart from every other tenant's (a shared block would tell one tenant, through `cached_tokens`, what
    another sent). Fair share: the tenant (`fairness_key`) and its weight, and the resolved `service_tier`, which
    the engine turns into the request's priority (the platform never sends `priority` itself).

    A chat request to a reasoning model (its base model has a reasoning_config) always carries a
    `thinking_token_budget`: the tenant's own, else the budget the base model's record gives its `reasoning_effort`
    (or its default tier), so the engine, embedded or remote, enforces the platform's budgets. To any other model a
    budget is refused (400, before an engine is asked); `reasoning_effort` and `chat_template_kwargs` go on as the
    template's hints."""
    defaults = dict(target.endpoint.defaults or {}) if target.endpoint is not None else {}
    # Only what the client sent: a schema default (completions' max_tokens=16) must not hide the endpoint's default.
    # The engine has OpenAI's defaults for what neither gives.
    fields = body.model_dump(
        exclude_unset=True,
        exclude_none=True,
        exclude={
            "model",
            "stream",
            "stream_options",
            "user",
            "safety_identifier",
            "prompt_cache_key",
            "metadata",
            "service_tier",
        },
    )
    merged: dict[str, Any] = {**defaults, **fields}
    merged["model"] = target.base_model.name
    merged["stream"] = True
    merged["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    merged["cache_salt"] = cache_salt
    merged["fairness_key"] = fairness_key  # the tenant: tenants share an engine fairly (its VTC scheduler)
    merged["fairness_weight"] = fairness_weight
    merged["service_tier"] = service_tier.value
    if isinstance(body, ChatCompletionRequest):
        budget = thinking_budget(target.base_model, body)
        if budget is not None:
            merged["thinking_token_budget"] = budget
    if target.adapter is not None:
        merged["lora_adapter"] = adapter_spec(target, adapter_source)
    return merged


def adapter_spec(target: Target, adapter_source: str | None) -> dict[str, str]:
    """The engine's `lora_adapter` for the target's adapter: its name and version (for logs), files and digest."""
    assert target.adapter is not None
    assert adapter_source is not None
    assert target.adapter.digest is not None
    return {
        "name": f"{target.adapter.name}@v{target.adapter.version}",
        "source": adapter_source,
        "digest": target.adapter.digest,
    }


def thinking_budget(base_model: BaseModel, body: ChatCompletionRequest) -> int | None:
    """The thinking-token budget of `body` on `base_model` (see `engine_body`); None for a model that does not reason.
    400 `unsupported_parameter` for a budget given to such a model."""
    try:
        reasoning = base_model.reasoning()
    except ValueError as exc:  # stored valid; only a stricter engine release could refuse it now
        logger.error("base model %s: its reasoning_config is no longer valid: %s", base_model.name, exc)
        raise ApiError(
            500,
            "This model's reasoning settings are not valid; contact support.",
            code="reasoning_config_invalid",
        ) from None
    if reasoning is None:
        if body.thinking_token_budget is not None:
            raise invalid_request(
                f"thinking_token_budget is not supported by '{body.model}': this model has no reasoning parser. "
                "Leave it out (reasoning_effort and chat_template_kwargs are passed to its chat template).",
                param="thinking_token_budget",
                code="unsupported_parameter",
            )
        return None
    if body.thinking_token_budget is not None:
        return body.thinking_token_budget
    return reasoning.budget(body.reasoning_effort)


def new_request_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def converted_chat(chat: dict[str, Any]) -> ChatCompletionRequest:
    """A chat request another protocol was converted into (the Messages and Responses APIs), held to the hosted
    chat schema, its bounds on every list and number included; 400 naming the first field that breaks it."""
    try:
        return ChatCompletionRequest.model_validate(chat, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise invalid_request(f"Invalid value for '{where}': {first.get('msg', 'invalid value')}") from None


def usage_event(call: Call) -> UsageEvent:
    adapter = call.target.adapter
    return UsageEvent(
        request_id=call.request_id,
        tenant_id=call.principal.tenant_id,
        api_key_id=call.principal.key_id,
        endpoint_id=call.target.endpoint.id if call.target.endpoint is not None else None,
        adapter_id=adapter.id if adapter is not None else None,
        adapter_digest=adapter.digest if adapter is not None else None,
        model=call.target.model,
        base_model=call.target.base_model.name,
        prompt_tokens=call.tally.prompt_tokens,
        cached_tokens=call.tally.cached_tokens,
        completion_tokens=call.tally.completion_tokens,
        reasoning_tokens=call.tally.reasoning_tokens,
        status=call.tally.status,
        started_at=call.started_at,
        finished_at=datetime.now(UTC),
        service_tier=call.service_tier.value,
    )


async def route(
    resources: Resources,
    principal: TenantPrincipal,
    target: Target,
    body: Request | EmbeddingRequest,
    exclude: frozenset[str] = frozenset(),
) -> Choice | None:
    """The replica the router picks for this request (decision 0012), never one in `exclude` (ids of replicas it
    has tried), with the warm peer it passed over; None when no other serves its base model."""
    digest = target.adapter.digest if target.adapter is not None else None
    cache_key = body.prompt_cache_key if not isinstance(body, EmbeddingRequest) else None
    affinity = f"{principal.tenant_id}:{cache_key or ''}"
    return await resources.router.choose(target.base_model.name, digest, affinity, exclude)


async def plan_kv_transfer(resources: Resources, call: Call) -> None:
    """KV blocks from another engine for this call (decision 0043), where engines take them (an engine API key is
    set: only the router holding it may direct their fetches):
    - disaggregated prefill and decode: when the replica chosen announced the role "decode" and a prefill replica
      serves the base model, the prompt is prefilled there first (one token, its blocks pinned) and the decode
      replica is told where to fetch them;
    - otherwise, when balance sent the prompt away from the replica its prefix last went to, the chosen replica is
      told to fetch what that warm peer has cached of it (a prefix pull, billed as the cache hit it is).
    Anything that goes wrong leaves the call as it was: the chosen replica computes the prompt itself."""
    body = call.engine_body
    if resources.settings.engine_api_key is None or body.get("n", 1) != 1 or "kv_transfer_params" in body:
        return
    if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
        return  # several prompts: one transfer carries one prompt's blocks
    digest = call.target.adapter.digest if call.target.adapter is not None else None
    prefill = None
    if call.replica.role == "decode":
        prefill = await resources.router.pick_prefill(call.target.base_model.name, digest)
    if prefill is None:
        if call.warm_peer is not None:
            body["kv_transfer_params"] = {"do_remote_prefill": True, "remote_url": call.warm_peer.url}
        return
    first = {key: value for key, value in body.items() if key not in ("max_completion_tokens", "min_tokens")}
    first |= {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params: dict[str, Any] | None = None
    events = resources.fleet.client(prefill).stream(call.path, first)
    try:
        async for event in events:
            if isinstance(event.get("kv_transfer_params"), dict):
                params = event["kv_transfer_params"]
    except (EngineUnavailable, EngineRequestError) as exc:
        logger.warning("%s: prefill on %s failed, the decode engine computes it: %s", call.request_id, prefill.id, exc)
        return
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    if params is not None:
        body["kv_transfer_params"] = {"do_remote_prefill": True, **params}


async def relay(resources: Resources, call: Call) -> AsyncGenerator[dict[str, Any], None]:
    """The engine's events for this call, rewritten for the client (our id, the client's model name); the tally
    follows exactly the chunks handed out. Usage chunks pass only when the client asked for them.

    A replica that refuses the request before running any of it (the connection: it is marked unreachable and the
    router skips it for a while; or a 503, `overloaded` when its waiting queue is full) is left for the router's
    next choice among the replicas not tried yet, up to MAX_REPLICA_TRIES. When none is left the last refusal is
    raised, except that if any replica said it was overloaded the request is refused as overloaded, with the
    shortest Retry-After of those replicas (the soonest one of them expects room). Once an engine has accepted the
    request it stays there: a failure after that ends it, since the engine may have started generating."""
    assert not isinstance(call.body, EmbeddingRequest), "embeddings are answered whole (embeddings/service.py)"
    created = int(time.time())
    await plan_kv_transfer(resources, call)
    tried: set[str] = set()
    overloaded: list[EngineRequestError] = []
    while True:
        events = resources.fleet.client(call.replica).stream(call.path, call.engine_body)
        try:
            first = await anext(events)
            break
        except StopAsyncIteration:
            await events.aclose()  # type: ignore[attr-defined]
            return
        except (EngineUnreachable, EngineRequestError) as exc:
            await events.aclose()  # type: ignore[attr-defined]
            await next_replica(resources, call, exc, tried, overloaded)
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise
    try:
        event: dict[str, Any] | None = first
        while event is not None:
            if "error" in event:
                # The engine accepted the request, then failed it (an adapter we stored did not load): our fault.
                # Its message names our storage, so it goes to the log and the client gets its code.
                call.tally.status = "error"
                error = event["error"] if isinstance(event["error"], dict) else {}
                logger.warning("%s: the engine failed the request: %s", call.request_id, error.get("message"))
                yield {"error": engine_failure(error.get("code"))}
                return
            usage = event.get("usage") if call.running_usage else event.pop("usage", None)
            choices = event.get("choices") or []
            event["id"], event["model"], event["created"] = call.request_id, call.target.model, created
            event["service_tier"] = call.service_tier.value  # the platform's resolution, whatever the engine echoes
            if not choices:  # the final usage-only chunk
                call.tally.take(usage)
                if call.body.include_usage and usage:
                    # OpenAI's shape always says how many completion tokens were reasoning (0 for most models).
                    usage.setdefault("completion_tokens_details", {"reasoning_tokens": call.tally.reasoning_tokens})
                    event["usage"] = usage
                    yield event
            else:
                finish = choices[0].get("finish_reason")
                yield event
                call.tally.take(usage)  # counted once handed out: a client gone before this chunk never got it
                if finish is not None:
                    call.tally.status = "ok" if finish == "stop" else str(finish)
            event = await anext(events, None)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def next_replica(
    resources: Resources,
    call: Call,
    exc: EngineUnreachable | EngineRequestError,
    tried: set[str],
    overloaded: list[EngineRequestError],
) -> None:
    """`call.replica` refused the call (`exc`): point the call at the router's next choice among the replicas not
    tried yet, when the refusal came before any of it ran (the connection, or a 503) and fewer than
    MAX_REPLICA_TRIES were tried; else raise `exc` (or, if any replica said it was overloaded, one overloaded
    refusal for all of them). `tried` and `overloaded` carry what the earlier refusals of this call were."""
    if isinstance(exc, EngineRequestError) and exc.status_code != 503:
        raise exc  # the engine judged the request itself: another replica would say the same
    if isinstance(exc, EngineRequestError) and exc.overloaded:
        overloaded.append(exc)
        resources.metrics.count_engine_overloaded(call.replica.id)
    tried.add(call.replica.id)
    replica = None
    if len(tried) < MAX_REPLICA_TRIES:
        choice = await route(resources, call.principal, call.target, call.body, frozenset(tried))
        replica = choice.replica if choice is not None else None
    if replica is None:
        if overloaded:
            resources.metrics.count_overloaded(str(call.principal.tenant_id))
            raise _overloaded(overloaded) from exc
        raise exc
    logger.info("%s: engine %s refused the request (%s); trying %s", call.request_id, call.replica.id, exc, replica.id)
    call.replica = replica


def _overloaded(refusals: list[EngineRequestError]) -> EngineRequestError:
    """One overloaded refusal for all of `refusals`, with the shortest Retry-After any of them gave."""
    waits = [r.retry_after_s for r in refusals if r.retry_after_s is not None]
    return EngineRequestError(503, refusals[-1].body, retry_after_s=min(waits) if waits else None)


def engine_failure(code: str | None) -> dict[str, Any]:
    """The error a client sees when the engine fails its request after accepting it."""
    reason = f" ({code})" if code else ""
    return {
        "message": f"The engine failed while running this request{reason}; retry, and contact support if it persists.",
        "type": "server_error",
        "param": None,
        "code": code,
    }


async def record_usage(resources: Resources, call: Call) -> None:
    """Written whatever happened to the client; shielded so a cancelled request still writes it. Counted in the
    process's metrics here too, once per request, so /metrics counts what is billed."""
    try:
        await asyncio.shield(resources.usage.record(_counted(resources, call)))
    except asyncio.CancelledError:
        raise
    except Exception:  # the recorder never raises by contract; belt and braces
        logger.exception("usage of %s could not be recorded", call.request_id)


def record_usage_soon(resources: Resources, call: Call) -> None:
    """`record_usage` without waiting for it: for an answer that is complete, which a slow database must not hold
    back (its client would time out and retry a request already billed)."""
    try:
        resources.usage.record_soon(_counted(resources, call))
    except Exception:  # as above
        logger.exception("usage of %s could not be recorded", call.request_id)


def _counted(resources: Resources, call: Call) -> UsageEvent:
    """The call's usage event, counted in the process's metrics (once per request: where it is recorded)."""
    event = usage_event(call)
    resources.metrics.count_usage(event)
    return event


def engine_error(exc: EngineRequestError | EngineUnavailable) -> ApiError:
    if isinstance(exc, EngineUnavailable):
        return ApiError(503, "The engine serving this model is unavailable; retry shortly.", code="engine_unavailable")
    error = exc.body.get("error") or {}
    if exc.overloaded:
        # Every replica tried was full: the documented 503 of an overloaded server, before any byte of an answer.
        wait_s = max(1, math.ceil(exc.retry_after_s if exc.retry_after_s is not None else RETRY_AFTER_S))
        return ApiError(
            503,
            f"The engines serving this model are at capacity; please retry after {wait_s} s.",
            code=OVERLOADED,
            headers={"Retry-After": str(wait_s)},
        )
    if exc.status_code == 503:
        return ApiError(503, "The engine serving this model is unavailable; retry shortly.", code="engine_unavailable")
    if exc.status_code in (401, 403):
        # The engine refused the platform itself (LORAPLEX_ENGINE_API_KEY does not match its --api-key): ours to fix,
        # and the tenant's key must not look wrong.
        logger.error("an engine refused the platform's credentials: %s", error.get("message"))
        return ApiError(502, "The engine serving this model refused the request; contact support.", code="engine_auth")
    status = exc.status_code if 400 <= exc.status_code < 500 else 502
    return ApiError(
        status,
        str(error.get("message", "The engine refused the request.")),
        code=error.get("code"),
        param=error.get("param"),
    )
