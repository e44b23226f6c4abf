"""Disaggregated prefill and decode through the platform: with a prefill engine and a decode engine registered for a
base model, the platform has the prompt prefilled on the first and decoded on the second, which fetches the prefill's
KV blocks; the client gets what one engine answers (base model and an endpoint's adapter, streamed and not), billed
as one engine would bill it. A prefill engine that is gone costs the decode engine a recompute, never the request.
Real Postgres, Redis and SeaweedFS; two `loraplex engine serve` processes; the `openai` package is the client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import poll

from loraplex.platform.settings import Settings

from .fleet_setup import (
    ENGINE_AUTH,
    Platform,
    ServerProcess,
    Tenant,
    engine_process,
    fleet_settings,
    make_tenant,
    platform_app,
)

pytestmark = pytest.mark.integration

BASE = "tiny-disagg-base"
ENDPOINT = "disagg-bot"
PROMPT = "Write a long story about a lighthouse keeper and the ships that pass by at night, one by one."
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> Iterator[Settings]:
    with fleet_settings(
        tmp_path_factory.mktemp("data"), postgres_server, redis_server, s3_server, session_tag
    ) as value:
        yield value


@pytest.fixture(scope="module")
def engines(
    settings: Settings, tiny_base_checkpoint: Path, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    logs = tmp_path_factory.mktemp("engines")
    with (
        engine_process(
            settings, tiny_base_checkpoint, s3_server, logs, engine_id="prefill-1", base_model=BASE,
            extra=["--role", "prefill"],
        ) as prefill,
        engine_process(
            settings, tiny_base_checkpoint, s3_server, logs, engine_id="decode-1", base_model=BASE,
            extra=["--role", "decode"],
        ) as decode,
    ):  # fmt: skip
        yield prefill, decode


@pytest.fixture(scope="module")
def platform(settings: Settings, tiny_base_checkpoint: Path) -> Iterator[Platform]:
    with platform_app(settings, tiny_base_checkpoint, BASE) as value:
        yield value


@pytest.fixture(scope="module")
def tenant(platform: Platform, tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Tenant:
    return make_tenant(
        platform, tiny_base_checkpoint, tmp_path_factory.mktemp("adapter"), base_model=BASE, endpoint=ENDPOINT
    )


def _kv(engine: ServerProcess) -> dict[str, int]:
    stats: dict[str, int] = httpx.get(f"{engine.url}/v1/state", headers=ENGINE_AUTH, timeout=10).json()["kv_transfer"]
    return stats


def _alone(engine: ServerProcess, tenant: Tenant, settings: Settings, prompt: str, *, adapter: bool) -> str:
    """What one engine answers to the request the platform makes of it (greedy; another salt: no cache shared)."""
    body: dict[str, Any] = {
        "model": BASE,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "cache_salt": "reference",
    }
    if adapter:
        body["lora_adapter"] = {
            "name": "reference",
            "source": tenant.source(settings.s3_bucket),
            "digest": tenant.digest,
        }
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, headers=ENGINE_AUTH, timeout=60)
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


def _registered(platform: Platform) -> bool:
    engines = platform.engines()
    return {"prefill-1", "decode-1"} <= set(engines)


@pytest.mark.parametrize(("model", "stream"), [(BASE, False), (ENDPOINT, True), (ENDPOINT, False)])
def test_the_platform_prefills_on_one_engine_and_decodes_on_the_other(
    model: str,
    stream: bool,
    engines: tuple[ServerProcess, ServerProcess],
    platform: Platform,
    tenant: Tenant,
    settings: Settings,
) -> None:
    prefill, decode = engines
    assert poll(lambda: _registered(platform), 10.0), platform.engines()
    roles = {replica_id: replica.get("role") for replica_id, replica in platform.engines().items()}
    assert roles == {"prefill-1": "prefill", "decode-1": "decode"}
    client = tenant.openai(platform)
    # Told apart at their start: a prompt that shares no block with the earlier ones is no cache hit anywhere.
    prompt = f"{model} {'streamed' if stream else 'whole'}: {PROMPT}"
    messages: Any = [{"role": "user", "content": prompt}]
    expected = _alone(decode, tenant, settings, prompt, adapter=model == ENDPOINT)
    for attempt in ("first", "again"):
        before = _kv(decode)
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            answer = client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            text, usage = answer.choices[0].message.content or "", answer.usage
        assert text == expected
        after = _kv(decode)
        assert after["imported_tokens"] > before["imported_tokens"], "the decode engine computed the prompt itself"
        assert after["fetch_failures"] == before["fetch_failures"]
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens
        if attempt == "first":  # computed on the prefill engine: no hit, whatever the decode engine fetched
            assert cached == 0
        else:  # the prefill engine's own cache hit, billed as one engine would bill it
            assert cached is not None and cached > 0
        assert _kv(prefill)["pinned_transfers"] == 0, "the decode engine's fetch releases the prefill's pin"


def test_a_tenant_cannot_direct_kv_transfers(platform: Platform, tenant: Tenant) -> None:
    """Only the platform directs fetches between engines: a tenant's kv_transfer_params is refused, not relayed."""
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params"):
        tenant.openai(platform).chat.completions.create(
            model=ENDPOINT,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body={"kv_transfer_params": {"do_remote_prefill": True, "remote_url": "http://169.254.169.254"}},
        )


def test_a_prefill_engine_that_is_gone_costs_a_recompute_not_the_request(
    engines: tuple[ServerProcess, ServerProcess], platform: Platform, tenant: Tenant, settings: Settings
) -> None:
    prefill, _ = engines
    prefill.kill()  # its registry entry lives on until its TTL: the platform still picks it, and finds it gone
    answer = tenant.openai(platform).chat.completions.create(
        model=ENDPOINT, messages=[{"role": "user", "content": PROMPT + " Again."}], max_tokens=MAX_TOKENS, temperature=0
    )
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == MAX_TOKENS
