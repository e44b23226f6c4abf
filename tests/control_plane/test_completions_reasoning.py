"""Reasoning effort tiers end to end: the `openai` package against the platform on a real uvicorn socket, its engine
in process (embedded mode) on a tiny random model with a thinking chat template (Qwen3's manner: the template opens
the think block) and `<think>`/`</think>` tokens, registered with a reasoning config before the platform starts; real
Postgres, Redis and S3 behind it.

A random model never closes its think block by itself, so a request with a budget thinks exactly its budget, then the
engine forces the closing text and `</think>`: its reasoning tokens are the budget plus those. The budgets are the
base model's record's, sent by the platform as each request's thinking_token_budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.checkpoints import tiny_spec, write_thinking_tokenizer
from _support.console import BrowserProblems, chromium
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import wait_for
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engine import ReasoningConfig
from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.engine.tools.demo import write_random_model
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import module_settings_sync
from .test_completions import ADMIN, OTHER_BASE, Platform, Tenant, _serving, envelope

pytestmark = pytest.mark.integration

BUDGETS = {"none": 0, "minimal": 2, "low": 5, "medium": 9, "high": 14}
CLOSING = " Enough."
REASONING = ReasoningConfig(parser="qwen3", budgets=BUDGETS, default_effort="low", closing_text=CLOSING)
MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "How many legs has a spider?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_completion_tokens": 48}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_random_model(
        tmp_path_factory.mktemp("thinker") / "tiny-thinker", tiny_spec(max_position_embeddings=512)
    )
    return write_thinking_tokenizer(path)


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
    thinker: Path,
) -> Iterator[Settings]:
    """The embedded engine on the thinking model, whose base model is registered (before the platform first starts,
    as an admin would have) with REASONING."""
    with module_settings_sync(
        tmp_path_factory.mktemp("data"),
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        engine_mode="embedded",
        engine_model=str(thinker),
        engine_dtype="float32",
        engine_max_model_len=512,
        engine_kv_budget="8MiB",
    ) as value:

        async def register() -> None:
            engine = create_engine(value.effective_database_url)
            try:
                async with create_session_factory(engine)() as session:
                    row = BaseModel(name=thinker.name, source=str(thinker))
                    row.set_reasoning(REASONING)
                    session.add(row)
                    await session.commit()
            finally:
                await engine.dispose()

        asyncio.run(register())
        yield value


@pytest.fixture(scope="module")
def platform(settings: Settings, thinker: Path) -> Iterator[Platform]:
    app = create_app(settings)
    with _serving(app) as url:
        resources: Resources = app.state.resources
        assert resources.embedded_engine is not None
        assert resources.embedded_engine.core.config.reasoning == REASONING, "the engine reasons as registered"
        value = Platform(url, app, thinker.name, Tokenizer.from_dir(thinker))
        # A second base model, without reasoning, registered but served by no engine.
        response = value.admin("POST", "/admin/base-models", json={"name": OTHER_BASE, "source": str(thinker)})
        assert response.status_code == 201, response.text
        yield value


@pytest.fixture(scope="module")
def tenant(platform: Platform) -> Tenant:
    return platform.make_tenant()


@pytest.fixture(scope="module")
def forced(platform: Platform) -> int:
    """The tokens the engine forces at the end of a budget: the closing text and `</think>`."""
    return len(platform.tokenizer.encode(CLOSING, add_special_tokens=False)) + 1


def ask(platform: Platform, tenant: Tenant, **fields: Any) -> Any:
    request: dict[str, Any] = {"model": platform.base_model, "messages": MESSAGES, **GREEDY}
    return platform.client(tenant.key).chat.completions.create(**(request | fields))


def reasoning_of(message: Any) -> str | None:
    value: str | None = message.to_dict().get("reasoning_content")
    return value


def reasoning_tokens(usage: Any) -> int:
    value: int = usage.completion_tokens_details.reasoning_tokens
    return value


# --- tiers and budgets ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("effort", ["minimal", "low", "medium", "high", None])
def test_each_tier_thinks_its_records_budget_then_answers(
    platform: Platform, tenant: Tenant, forced: int, effort: str | None
) -> None:
    fields = {} if effort is None else {"reasoning_effort": effort}
    chat = ask(platform, tenant, **fields)
    message, usage = chat.choices[0].message, chat.usage
    budget = BUDGETS[effort or REASONING.default_effort]
    assert reasoning_tokens(usage) == budget + forced
    assert usage.completion_tokens > reasoning_tokens(usage), "an answer follows the think block"
    thought = reasoning_of(message)
    assert thought and CLOSING.strip() in thought, message
    assert "</think>" not in thought  # the block's text, without its end marker


def test_none_thinks_not_at_all(platform: Platform, tenant: Tenant) -> None:
    chat = ask(platform, tenant, reasoning_effort="none")
    assert reasoning_tokens(chat.usage) == 0
    assert reasoning_of(chat.choices[0].message) is None
    assert chat.choices[0].message.content


@pytest.mark.parametrize("budget", [0, 3, 20])
def test_the_tenants_own_budget_wins_over_the_tier(
    platform: Platform, tenant: Tenant, forced: int, budget: int
) -> None:
    chat = ask(platform, tenant, reasoning_effort="high", extra_body={"thinking_token_budget": budget})
    # The template opened the block, so even a zero budget spends its end marker in it.
    assert reasoning_tokens(chat.usage) == (budget + forced if budget else 1)


def test_enable_thinking_false_reaches_the_template(platform: Platform, tenant: Tenant) -> None:
    chat = ask(platform, tenant, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_tokens(chat.usage) == 0  # the template closed the block in the prompt
    assert reasoning_of(chat.choices[0].message) is None


def test_a_stream_carries_the_same_reasoning_and_usage(platform: Platform, tenant: Tenant) -> None:
    whole = ask(platform, tenant, reasoning_effort="medium")
    stream = ask(platform, tenant, reasoning_effort="medium", stream=True, stream_options={"include_usage": True})
    thought, answer, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.to_dict()
            thought.append(delta.get("reasoning_content") or "")
            answer.append(delta.get("content") or "")
    assert "".join(thought) == reasoning_of(whole.choices[0].message)
    assert "".join(answer) == whole.choices[0].message.content
    assert usage is not None
    assert reasoning_tokens(usage) == reasoning_tokens(whole.usage)
    assert usage.completion_tokens == whole.usage.completion_tokens


# --- usage, billing and metrics -------------------------------------------------------------------------------


def test_usage_rows_the_bill_and_metrics_keep_the_reasoning_tokens(platform: Platform) -> None:
    payer = platform.make_tenant()
    told = [reasoning_tokens(ask(platform, payer, reasoning_effort=effort).usage) for effort in ("low", "high", "none")]
    assert told[0] < told[1] and told[2] == 0
    # Answers go out before their usage rows are written.
    rows = wait_for(lambda: (found := platform.usage_rows(payer)) and len(found) == 3 and found, what="3 usage rows")
    assert sorted(row["reasoning_tokens"] for row in rows) == sorted(told)
    usage = platform.get(payer, "/v1/usage").json()
    assert usage["totals"]["reasoning_tokens"] == usage["billing"]["reasoning_tokens"] == sum(told)
    scraped = httpx.get(f"{platform.url}/metrics", headers=ADMIN, timeout=30).text
    counted = sum(
        sample.value
        for family in text_string_to_metric_families(scraped)
        for sample in family.samples
        if sample.name == "loraplex_platform_reasoning_tokens_total" and sample.labels.get("tenant") == payer.id
    )
    assert counted == sum(told)


# --- refusals, before any engine is asked ---------------------------------------------------------------------


def test_a_budget_for_a_model_without_a_reasoning_parser_is_refused(platform: Platform, tenant: Tenant) -> None:
    client = platform.client(tenant.key)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=OTHER_BASE, messages=MESSAGES, extra_body={"thinking_token_budget": 5}, **GREEDY
        )
    error = envelope(raised.value)
    assert (error["param"], error["code"]) == ("thinking_token_budget", "unsupported_parameter")
    assert "this model has no reasoning parser" in error["message"]
    # The tier alone is a hint for its template: passed on (no engine serves this model, hence the 503).
    with pytest.raises(openai.APIStatusError) as unserved:
        client.chat.completions.create(model=OTHER_BASE, messages=MESSAGES, reasoning_effort="high", **GREEDY)
    assert unserved.value.status_code == 503, unserved.value.response.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"bos_token": "<s>"}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {f"k{i}": i for i in range(17)}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"deep": {"er": 1}}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"thinking_token_budget": 1_000_001}, "thinking_token_budget"),
        ({"thinking_token_budget": "16"}, "thinking_token_budget"),
    ],
)
def test_bad_reasoning_fields_are_400s_naming_them(
    platform: Platform, tenant: Tenant, fields: dict[str, Any], param: str
) -> None:
    body = {"model": platform.base_model, "messages": MESSAGES, **fields}
    response = platform.post(tenant, "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_a_patched_reasoning_config_reaches_the_embedded_engine_at_once(
    platform: Platform, tenant: Tenant, forced: int
) -> None:
    path = f"/admin/base-models/{platform.base_model}"
    try:
        response = platform.admin("PATCH", path, json={"reasoning_config": None})
        assert response.status_code == 200, response.text
        chat = ask(platform, tenant, reasoning_effort="high")  # a tier is then only a hint for the template
        assert reasoning_tokens(chat.usage) == 0 and reasoning_of(chat.choices[0].message) is None
        tighter = REASONING.to_dict() | {"budgets": BUDGETS | {"high": 1}}
        response = platform.admin("PATCH", path, json={"reasoning_config": tighter})
        assert response.status_code == 200, response.text
        chat = ask(platform, tenant, reasoning_effort="high")
        assert reasoning_tokens(chat.usage) == 1 + forced
    finally:
        response = platform.admin("PATCH", path, json={"reasoning_config": REASONING.to_dict()})
        assert response.status_code == 200, response.text


# --- the console's playground ---------------------------------------------------------------------------------


async def test_chromium_shows_the_think_block_apart_from_the_answer(platform: Platform, forced: int) -> None:
    tenant = platform.make_tenant()
    async with chromium() as browser:
        page = await browser.new_page(viewport={"width": 1280, "height": 900})
        problems = BrowserProblems(page, platform.url)
        await page.goto(f"{platform.url}/console")
        await page.fill("#key", tenant.key)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{platform.url}/console/playground")
        await page.select_option("#model", platform.base_model)
        await page.fill("#message", "How many legs has a spider?")
        await page.click("#send")
        reply = page.locator(".turn.assistant").first
        usage = reply.locator(".usage")
        await usage.wait_for(timeout=60_000)
        thinking = reply.locator(".thinking")
        assert await thinking.count() == 1
        assert CLOSING.strip() in await thinking.inner_text()
        spent = BUDGETS[REASONING.default_effort] + forced
        assert await usage.get_attribute("data-reasoning-tokens") == str(spent)
        assert f"{spent} reasoning tokens of them" in await usage.inner_text()
        problems.check()
