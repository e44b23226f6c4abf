"""Base models' reasoning config on real Postgres, Redis and S3: set at registration and by PATCH (null clears it),
checked by the engine's own ReasoningConfig with errors naming `reasoning_config` and nothing written; the embedded
engine reasons as its base model is registered, and the demo model is registered as a reasoning model on the first
start; the console's models page shows it and sets or clears it.

One app and database serve the module's API tests (each test registers base models of its own names).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from _support.console import page_token, sign_in
from _support.services import PostgresServer, RedisServer, S3Server
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine import ReasoningConfig
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.fleet.embedded import (
    DEMO_MODEL_NAME,
    DEMO_REASONING_CONFIG,
    demo_model_path,
    embedded_reasoning_config,
)
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, module_settings

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
QWEN = {"parser": "qwen3", "budgets": {"low": 32, "high": 512}, "default_effort": "low"}
# What the API answers (and stores) for QWEN: every field, the other tiers' budgets and the closing text filled in.
QWEN_OUT = ReasoningConfig.from_dict(QWEN).to_dict()
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
NGRAM_OUT = {**NGRAM, "model": None}

# A bad value of reasoning_config -> words the refusal must hold (the engine's own).
BAD_CONFIGS: dict[str, tuple[Any, str]] = {
    "bad-json": ('{"parser": ', "not valid JSON"),
    "not-an-object": ([1, 2], "must be a JSON object"),
    "a-number": (7, "must be a JSON object"),
    "no-parser": ({"budgets": {"low": 8}}, "parser is required"),
    "unknown-parser": ({"parser": "llama"}, "reasoning parser must be one of"),
    "unknown-field": ({"parser": "qwen3", "effort": "low"}, "unknown field 'effort'"),
    "unknown-tier": ({"parser": "qwen3", "budgets": {"extreme": 5}}, "'extreme' is not a reasoning effort"),
    "negative-budget": ({"parser": "qwen3", "budgets": {"low": -1}}, "low's budget must be a whole number"),
    "budget-as-bool": ({"parser": "qwen3", "budgets": {"low": True}}, "low's budget must be a whole number"),
    "budget-too-big": ({"parser": "qwen3", "budgets": {"high": 10**7}}, "from 0 to 1000000"),
    "thinking-at-none": ({"parser": "qwen3", "budgets": {"none": 3}}, "none tier's budget is 0"),
    "budgets-a-list": ({"parser": "qwen3", "budgets": [1]}, "budgets must map"),
    "budgets-text": ({"parser": "qwen3", "budgets": "low=lots"}, "whole number of tokens"),
    "unknown-default": ({"parser": "qwen3", "default_effort": "max"}, "default reasoning effort must be one of"),
    "marker-in-closing": ({"parser": "qwen3", "closing_text": "</think>"}, "must not hold the think markers"),
    "too-long": ('{"parser": "qwen3", "closing_text": "' + "x" * 5000 + '"}', "at most 4096 characters"),
}


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> AsyncIterator[Settings]:
    async with module_settings(
        tmp_path_factory.mktemp("data"), postgres_server, redis_server, s3_server, session_tag
    ) as value:
        yield value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(settings: Settings) -> AsyncIterator[Client]:
    async with AsyncTestClient(app=create_app(settings)) as client:
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def db(settings: Settings) -> AsyncIterator[Sessions]:
    engine = create_engine(settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


async def stored(sessions: Sessions, name: str) -> list[tuple[Any, Any]]:
    """(reasoning_config, speculative_config) of every row named `name` (none, or one)."""
    async with sessions() as session:
        rows = await session.execute(
            select(BaseModel.reasoning_config, BaseModel.speculative_config).where(BaseModel.name == name)
        )
        return [tuple(row) for row in rows.all()]


async def register(api: Client, name: str, source: Path, **fields: Any) -> Any:
    return await api.post("/admin/base-models", json={"name": name, "source": str(source), **fields}, headers=ADMIN)


def assert_names_the_field(response: Any, fragment: str) -> None:
    """A 400 problem-details refusal whose message names reasoning_config and says what is wrong."""
    assert response.status_code == 400, response.text
    body = response.json()
    assert "reasoning_config" in body["detail"], body
    assert fragment in body["detail"], (fragment, body)
    assert body["errors"][0]["key"] == "reasoning_config", body


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
class TestRegistration:
    async def test_a_good_config_is_stored_whole_and_shown(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path
    ) -> None:
        name = _name("thinker")
        created = await register(api, name, tiny_base_checkpoint, reasoning_config=QWEN)
        assert created.status_code == 201, created.text
        assert created.json()["reasoning_config"] == QWEN_OUT
        assert QWEN_OUT["budgets"] == {"none": 0, "minimal": 16, "low": 32, "medium": 256, "high": 512}
        assert await stored(db, name) == [(QWEN_OUT, None)]
        listed = {m["name"]: m for m in (await api.get("/admin/base-models", headers=ADMIN)).json()["data"]}
        assert listed[name]["reasoning_config"] == QWEN_OUT
        got = await api.get(f"/admin/base-models/{name}", headers=ADMIN)
        assert got.status_code == 200 and got.json() == created.json()

    async def test_json_text_and_budget_text_are_read_as_the_engine_reads_them(
        self, api: Client, tiny_base_checkpoint: Path
    ) -> None:
        text = '{"parser": "deepseek_r1", "budgets": "none=0,low=10,high=99"}'
        created = await register(api, _name("r1"), tiny_base_checkpoint, reasoning_config=text)
        assert created.status_code == 201, created.text
        shown = created.json()["reasoning_config"]
        assert shown["parser"] == "deepseek_r1"
        assert shown["budgets"] == {"none": 0, "minimal": 16, "low": 10, "medium": 256, "high": 99}
        assert shown["default_effort"] == "medium"

    async def test_without_a_config_it_is_null(self, api: Client, tiny_base_checkpoint: Path) -> None:
        created = await register(api, _name("plain"), tiny_base_checkpoint)
        assert created.status_code == 201, created.text
        assert created.json()["reasoning_config"] is None

    @pytest.mark.parametrize("case", list(BAD_CONFIGS))
    async def test_a_bad_config_is_refused_naming_the_field_and_nothing_is_written(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, case: str
    ) -> None:
        value, fragment = BAD_CONFIGS[case]
        name = _name("bad")
        refused = await register(api, name, tiny_base_checkpoint, reasoning_config=value)
        assert_names_the_field(refused, fragment)
        assert await stored(db, name) == []


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
class TestPatch:
    async def test_patch_sets_changes_and_clears_it_leaving_speculation_alone(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path
    ) -> None:
        name = _name("org/patched")
        assert (await register(api, name, tiny_base_checkpoint, speculative_config=NGRAM)).status_code == 201
        path = f"/admin/base-models/{name}"

        response = await api.patch(path, json={"reasoning_config": QWEN}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["reasoning_config"] == QWEN_OUT
        assert response.json()["speculative_config"] == NGRAM_OUT
        assert await stored(db, name) == [(QWEN_OUT, NGRAM_OUT)]

        response = await api.patch(path, json={"reasoning_config": {"parser": "deepseek_r1"}}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert (await api.get(path, headers=ADMIN)).json()["reasoning_config"]["parser"] == "deepseek_r1"

        # speculative_config alone leaves reasoning_config as it is, and the reverse.
        response = await api.patch(path, json={"speculative_config": None}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["reasoning_config"]["parser"] == "deepseek_r1"

        response = await api.patch(path, json={"reasoning_config": None}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["reasoning_config"] is None
        assert await stored(db, name) == [(None, None)]

    @pytest.mark.parametrize("case", ["bad-json", "unknown-parser", "thinking-at-none", "marker-in-closing"])
    async def test_a_bad_patch_is_refused_and_changes_nothing(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, case: str
    ) -> None:
        name = _name("kept")
        assert (await register(api, name, tiny_base_checkpoint, reasoning_config=QWEN)).status_code == 201
        value, fragment = BAD_CONFIGS[case]
        refused = await api.patch(f"/admin/base-models/{name}", json={"reasoning_config": value}, headers=ADMIN)
        assert_names_the_field(refused, fragment)
        assert await stored(db, name) == [(QWEN_OUT, None)]

    async def test_a_patch_of_both_is_all_or_nothing(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path
    ) -> None:
        name = _name("both")
        assert (await register(api, name, tiny_base_checkpoint)).status_code == 201
        path = f"/admin/base-models/{name}"
        bad_speculation = {"method": "ngram", "num_speculative_tokens": 0}
        refused = await api.patch(
            path, json={"reasoning_config": QWEN, "speculative_config": bad_speculation}, headers=ADMIN
        )
        assert refused.status_code == 400, refused.text
        assert await stored(db, name) == [(None, None)]
        both = await api.patch(path, json={"reasoning_config": QWEN, "speculative_config": NGRAM}, headers=ADMIN)
        assert both.status_code == 200, both.text
        assert await stored(db, name) == [(QWEN_OUT, NGRAM_OUT)]

    async def test_an_empty_patch_says_what_it_takes(self, api: Client) -> None:
        empty = await api.patch(f"/admin/base-models/{_name('absent')}", json={}, headers=ADMIN)
        assert empty.status_code == 400, empty.text
        assert "give speculative_config or reasoning_config" in empty.json()["detail"]


# --- the embedded engine --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_embedded_engine_reasons_as_registered_and_the_demo_model_from_the_first_start() -> None:
    assert embedded_reasoning_config(DEMO_MODEL_NAME, None, first_start=True) == DEMO_REASONING_CONFIG
    assert embedded_reasoning_config("my-model", None, first_start=True) is None
    # Once registered, the record decides, the demo model's too (an admin may have cleared it).
    assert embedded_reasoning_config(DEMO_MODEL_NAME, None, first_start=False) is None
    assert embedded_reasoning_config("my-model", QWEN_OUT, first_start=False) == ReasoningConfig.from_dict(QWEN)
    with pytest.raises(RuntimeError, match="reasoning_config is not one the engine takes"):
        embedded_reasoning_config("my-model", {"parser": "llama"}, first_start=False)


@pytest.mark.unit
def test_the_demo_models_reasoning_config_is_the_one_asked_for() -> None:
    assert DEMO_REASONING_CONFIG.to_dict() == {
        "parser": "qwen3",
        "budgets": {"none": 0, "minimal": 8, "low": 16, "medium": 48, "high": 128},
        "default_effort": "medium",
        "closing_text": ReasoningConfig(parser="qwen3").closing_text,
    }


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_the_demo_model_is_registered_reasoning_and_the_engine_follows_its_record(
    api: Client, db: Sessions, settings: Settings
) -> None:
    """Runs after the module's other tests registered their models; the demo model is not registered before it."""
    import torch

    assert demo_model_path() is not None, "the demo model ships in the source checkout (demo/model)"
    embedded = settings.model_copy(
        update={"engine_mode": "embedded", "engine_dtype": "float32", "engine_kv_budget": "32MiB"}
    )

    async def start() -> tuple[ReasoningConfig | None, dict[str, Any] | None]:
        """(the engine's reasoning config, the demo base model's recorded one) after a start."""
        resources = await Resources.open(embedded)
        try:
            engine = resources.embedded_engine
            assert engine is not None
            async with db() as session:
                row = await BaseModelRepository(session).get_by_name(DEMO_MODEL_NAME)
            assert row is not None
            return engine.core.config.reasoning, row.reasoning_config
        finally:
            await resources.close()

    num_threads = torch.get_num_threads()  # the engine sets it process-wide; give it back to the session after
    try:
        assert await start() == (DEMO_REASONING_CONFIG, DEMO_REASONING_CONFIG.to_dict())
        changed = await api.patch(
            f"/admin/base-models/{DEMO_MODEL_NAME}", json={"reasoning_config": QWEN}, headers=ADMIN
        )
        assert changed.status_code == 200, changed.text
        assert await start() == (ReasoningConfig.from_dict(QWEN), QWEN_OUT)
        cleared = await api.patch(
            f"/admin/base-models/{DEMO_MODEL_NAME}", json={"reasoning_config": None}, headers=ADMIN
        )
        assert cleared.status_code == 200, cleared.text
        assert await start() == (None, None)  # cleared stays cleared: the demo default is for the first start only
    finally:
        torch.set_num_threads(num_threads)


# --- the console ----------------------------------------------------------------------------------------------

REASONING_CELL = re.compile(r'data-label="Reasoning" data-reasoning="([a-z0-9_]+)"')


@pytest.mark.integration
async def test_the_console_shows_sets_and_clears_it(
    client: Client, sessions: Sessions, tiny_base_checkpoint: Path
) -> None:
    client.follow_redirects = False
    await sign_in(client, ADMIN_TOKEN)
    models = "/console/admin/models"

    async def post(path: str, fields: dict[str, str]) -> Any:
        return await client.post(path, data={"csrf_token": await page_token(client, models), **fields})

    response = await post(
        models, {"name": "tiny", "source": str(tiny_base_checkpoint), "reasoning_config": json.dumps(QWEN)}
    )
    assert response.status_code == 201, response.text
    assert REASONING_CELL.findall(response.text) == ["qwen3"]
    assert "&#34;high&#34;: 512" in response.text  # the whole config is shown
    assert await stored(sessions, "tiny") == [(QWEN_OUT, None)]
    assert response.text.count('action="/console/admin/models/reasoning"') == 1

    # A bad value: the page says why naming the field, keeps the input, and nothing changes.
    bad = '{"parser": "qwen3", "budgets": {"none": 5}}'
    response = await post(f"{models}/reasoning", {"name": "tiny", "reasoning_config": bad})
    assert response.status_code == 400, response.text
    assert "Reasoning config: the none tier&#39;s budget is 0" in response.text
    assert 'value="{&#34;parser&#34;: &#34;qwen3&#34;, &#34;budgets&#34;: {&#34;none&#34;: 5}}"' in response.text
    assert await stored(sessions, "tiny") == [(QWEN_OUT, None)]

    response = await post(f"{models}/reasoning", {"name": "tiny", "reasoning_config": '{"parser": "deepseek_r1"}'})
    assert response.status_code == 200, response.text
    assert "Base model tiny reasons by the deepseek_r1 parser." in response.text
    assert REASONING_CELL.findall(response.text) == ["deepseek_r1"]

    response = await post(f"{models}/reasoning", {"name": "tiny", "reasoning_config": ""})
    assert response.status_code == 200, response.text
    assert "Base model tiny is no reasoning model." in response.text
    assert REASONING_CELL.findall(response.text) == ["off"]
    assert await stored(sessions, "tiny") == [(None, None)]

    # Without the page's CSRF token the form is refused.
    response = await client.post(f"{models}/reasoning", data={"name": "tiny", "reasoning_config": json.dumps(QWEN)})
    assert response.status_code == 403, response.text
    assert await stored(sessions, "tiny") == [(None, None)]

    # The price form takes a reasoning price, and shows it in the price book; left blank it is the output price.
    price = {"base_model": "tiny", "service_tier": "default", "input_per_mtok": "3", "output_per_mtok": "15"}
    response = await post("/console/admin/prices", {**price, "reasoning_per_mtok": "-2"})
    assert response.status_code == 400, response.text
    assert "Reasoning price (USD per 1M tokens): Input should be greater than or equal to 0." in response.text
    response = await post("/console/admin/prices", {**price, "reasoning_per_mtok": "20"})
    assert response.status_code == 201, response.text
    assert "tiny (default tier): 3 / 0.3 / 15 USD per 1M tokens (reasoning 20)" in response.text
    assert '<td data-label="Reasoning" class="num">20</td>' in response.text
    response = await post(
        "/console/admin/prices", {**price, "reasoning_per_mtok": "", "effective_at": "2099-01-01T00:00"}
    )
    assert response.status_code == 201, response.text
    assert "(reasoning 15)" in response.text
