"""Base models' speculative config on real Postgres, Redis and S3: set at registration and by PATCH (admins only),
checked by the engine's own parser with errors naming `speculative_config` and nothing written, a draft model's
folder checked as a source is; the embedded engine speculates as its base model is registered (or as
LORAPLEX_ENGINE_SPECULATIVE_CONFIG says); the console's models page shows it and sets or clears it.

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
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine import SpeculativeConfig
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.base_models.models import BaseModel, speculative_config_json
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.domain.fleet.embedded import DEMO_MODEL_NAME, demo_model_path, embedded_speculative_config
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, module_settings

Client = AsyncTestClient[Litestar]
Sessions = async_sessionmaker[AsyncSession]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
# What the API answers for NGRAM: every field, defaults filled in.
NGRAM_OUT = {**NGRAM, "model": None}


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


# --- module fixtures ------------------------------------------------------------------------------------------


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
    """The test's own sessions on the module's database (named apart from conftest's per-test `sessions`)."""
    engine = create_engine(settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenant_key(api: Client) -> str:
    response = await api.post("/admin/tenants", json={"name": _name("acme")}, headers=ADMIN)
    assert response.status_code == 201, response.text
    key = await api.post(f"/admin/tenants/{response.json()['id']}/api-keys", json={"name": "k"}, headers=ADMIN)
    assert key.status_code == 201, key.text
    value: str = key.json()["key"]
    return value


async def stored(sessions: Sessions, name: str) -> list[dict[str, Any] | None]:
    """The speculative_config column of every row named `name` (none, or one)."""
    async with sessions() as session:
        rows = await session.scalars(select(BaseModel.speculative_config).where(BaseModel.name == name))
        return list(rows.all())


async def register(api: Client, name: str, source: Path, **fields: Any) -> Any:
    return await api.post("/admin/base-models", json={"name": name, "source": str(source), **fields}, headers=ADMIN)


def assert_names_the_field(response: Any, status: int, *fragments: str) -> None:
    """A problem-details refusal whose message names speculative_config and says what is wrong."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert "speculative_config" in body["detail"], body
    for fragment in fragments:
        assert fragment in body["detail"], (fragment, body)
    if body.get("errors"):  # a body validation error also names it as the field at fault
        assert body["errors"][0]["key"] == "speculative_config", body


# A bad value of speculative_config -> words the refusal must hold (the engine parser's own).
BAD_CONFIGS: dict[str, tuple[Any, str]] = {
    "bad-json": ('{"method": "ngram", ', "not valid JSON"),
    "unknown-field": ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}, "unknown"),
    "zero-tokens": ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be between 1"),
    "draft-without-model": ({"method": "draft_model", "num_speculative_tokens": 4}, "needs 'model'"),
    "unknown-method": ({"method": "medusa"}, "speculative method must be one of"),
    "tokens-as-text": ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
    "ngram-with-model": ({"method": "ngram", "model": "/models/draft"}, "'model' is for the draft_model method"),
    "uri-draft": ({"method": "draft_model", "model": "s3://bucket/draft"}, "local folder"),
    "not-an-object": ([1, 2], "must be a JSON object"),
    "empty-object": ({}, "speculative method must be one of"),
}


# --- registration ---------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
class TestRegistration:
    async def test_a_good_config_is_stored_and_returned(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path
    ) -> None:
        name = _name("spec")
        created = await register(api, name, tiny_base_checkpoint, speculative_config=NGRAM)
        assert created.status_code == 201, created.text
        assert created.json()["speculative_config"] == NGRAM_OUT
        assert await stored(db, name) == [NGRAM_OUT]
        listed = {m["name"]: m for m in (await api.get("/admin/base-models", headers=ADMIN)).json()["data"]}
        assert listed[name]["speculative_config"] == NGRAM_OUT
        got = await api.get(f"/admin/base-models/{name}", headers=ADMIN)
        assert got.status_code == 200 and got.json() == created.json()

    async def test_json_text_and_vllm_spellings_are_read_as_the_engine_reads_them(
        self, api: Client, tiny_base_checkpoint: Path
    ) -> None:
        created = await register(api, _name("text"), tiny_base_checkpoint, speculative_config='{"method": "ngram"}')
        assert created.status_code == 201, created.text
        defaults = speculative_config_json(SpeculativeConfig(method="ngram"))
        assert created.json()["speculative_config"] == defaults

    async def test_without_a_config_it_is_null(self, api: Client, tiny_base_checkpoint: Path) -> None:
        created = await register(api, _name("plain"), tiny_base_checkpoint)
        assert created.status_code == 201, created.text
        assert created.json()["speculative_config"] is None

    @pytest.mark.parametrize("case", list(BAD_CONFIGS))
    async def test_a_bad_config_is_refused_naming_the_field_and_nothing_is_written(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, case: str
    ) -> None:
        value, fragment = BAD_CONFIGS[case]
        name = _name("bad")
        refused = await register(api, name, tiny_base_checkpoint, speculative_config=value)
        assert_names_the_field(refused, 400, fragment)
        assert await stored(db, name) == []

    async def test_a_draft_model_is_checked_as_a_source_is(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, tmp_path: Path
    ) -> None:
        missing = {"method": "draft_model", "model": str(tmp_path / "no-such-draft")}
        name = _name("draft")
        refused = await register(api, name, tiny_base_checkpoint, speculative_config=missing)
        assert_names_the_field(refused, 400, "cannot be served", str(tmp_path / "no-such-draft"))

        not_a_model = tmp_path / "not-a-model"
        not_a_model.mkdir()
        (not_a_model / "config.json").write_text('{"model_type": "bert"}')
        refused = await register(
            api, name, tiny_base_checkpoint, speculative_config={"method": "draft_model", "model": str(not_a_model)}
        )
        assert_names_the_field(refused, 400, "cannot be served")

        other_vocab = tmp_path / "other-vocab"
        other_vocab.mkdir()
        config = json.loads((tiny_base_checkpoint / "config.json").read_text())
        (other_vocab / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
        refused = await register(
            api, name, tiny_base_checkpoint, speculative_config={"method": "draft_model", "model": str(other_vocab)}
        )
        assert_names_the_field(refused, 400, "vocabulary", "share the base model's tokenizer")
        assert await stored(db, name) == []

        draft = {"method": "draft_model", "model": str(tiny_base_checkpoint), "num_speculative_tokens": 2}
        created = await register(api, name, tiny_base_checkpoint, speculative_config=draft)
        assert created.status_code == 201, created.text
        assert created.json()["speculative_config"] == {
            **speculative_config_json(SpeculativeConfig(method="draft_model", model=tiny_base_checkpoint)),
            "num_speculative_tokens": 2,
        }


# --- PATCH ----------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
class TestPatch:
    async def test_patch_sets_changes_and_clears_it(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path
    ) -> None:
        name = _name("org/patched")  # a name with a slash, as hub names have
        assert (await register(api, name, tiny_base_checkpoint)).status_code == 201
        path = f"/admin/base-models/{name}"

        response = await api.patch(path, json={"speculative_config": NGRAM}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["speculative_config"] == NGRAM_OUT
        assert await stored(db, name) == [NGRAM_OUT]

        changed = {"method": "ngram", "num_speculative_tokens": 8}
        response = await api.patch(path, json={"speculative_config": changed}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["speculative_config"]["num_speculative_tokens"] == 8
        assert (await api.get(path, headers=ADMIN)).json()["speculative_config"]["num_speculative_tokens"] == 8

        response = await api.patch(path, json={"speculative_config": None}, headers=ADMIN)
        assert response.status_code == 200, response.text
        assert response.json()["speculative_config"] is None
        assert await stored(db, name) == [None]

    @pytest.mark.parametrize("case", ["bad-json", "unknown-field", "zero-tokens", "draft-without-model"])
    async def test_a_bad_patch_is_refused_and_changes_nothing(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, case: str
    ) -> None:
        name = _name("kept")
        assert (await register(api, name, tiny_base_checkpoint, speculative_config=NGRAM)).status_code == 201
        value, fragment = BAD_CONFIGS[case]
        refused = await api.patch(f"/admin/base-models/{name}", json={"speculative_config": value}, headers=ADMIN)
        assert_names_the_field(refused, 400, fragment)
        assert await stored(db, name) == [NGRAM_OUT]

    async def test_a_patch_with_a_missing_draft_is_refused(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, tmp_path: Path
    ) -> None:
        name = _name("nodraft")
        assert (await register(api, name, tiny_base_checkpoint)).status_code == 201
        draft = {"method": "draft_model", "model": str(tmp_path / "gone")}
        refused = await api.patch(f"/admin/base-models/{name}", json={"speculative_config": draft}, headers=ADMIN)
        assert_names_the_field(refused, 400, "cannot be served")
        assert await stored(db, name) == [None]

    async def test_an_empty_patch_and_an_unknown_model_are_refused(self, api: Client) -> None:
        name = _name("absent")
        empty = await api.patch(f"/admin/base-models/{name}", json={}, headers=ADMIN)
        assert empty.status_code == 400 and "give speculative_config" in empty.json()["detail"], empty.text
        missing = await api.patch(f"/admin/base-models/{name}", json={"speculative_config": NGRAM}, headers=ADMIN)
        assert missing.status_code == 404 and name in missing.json()["detail"], missing.text
        assert (await api.get(f"/admin/base-models/{name}", headers=ADMIN)).status_code == 404

    @pytest.mark.parametrize("credential", ["tenant-key", "none", "wrong-token"])
    async def test_only_an_admin_may_set_it(
        self, api: Client, db: Sessions, tiny_base_checkpoint: Path, tenant_key: str, credential: str
    ) -> None:
        name = _name("guarded")
        assert (await register(api, name, tiny_base_checkpoint)).status_code == 201
        headers = {"tenant-key": bearer(tenant_key), "none": {}, "wrong-token": bearer("not-the-admin-token-0123")}
        patched = await api.patch(
            f"/admin/base-models/{name}", json={"speculative_config": NGRAM}, headers=headers[credential]
        )
        assert patched.status_code == 401, patched.text
        posted = await api.post(
            "/admin/base-models",
            json={"name": _name("smuggled"), "source": str(tiny_base_checkpoint), "speculative_config": NGRAM},
            headers=headers[credential],
        )
        assert posted.status_code == 401, posted.text
        assert await stored(db, name) == [None]
        async with db() as session:
            smuggled = await session.scalar(select(func.count()).where(BaseModel.name.like("smuggled-%")))
        assert smuggled == 0


# --- the embedded engine --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_setting_overrides_the_registered_config() -> None:
    registered = speculative_config_json(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    assert embedded_speculative_config(Settings(), None) is None
    assert embedded_speculative_config(Settings(), registered) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2
    )
    assert embedded_speculative_config(Settings(engine_speculative_config="NONE"), registered) is None
    override = Settings(engine_speculative_config='{"method": "ngram", "num_speculative_tokens": 6}')
    assert embedded_speculative_config(override, registered) == SpeculativeConfig(
        method="ngram", num_speculative_tokens=6
    )
    with pytest.raises(RuntimeError, match="speculative_config is not one the engine takes"):
        embedded_speculative_config(Settings(), {"method": "ngram", "bogus": 1})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "fragment"),
    [('{"method": "ngram", "lookahead": 2}', "unknown"), ("{", "not valid JSON"), ('{"method": "x"}', "method")],
)
def test_a_bad_setting_is_refused_naming_it(value: str, fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment) as raised:
        Settings(engine_speculative_config=value)
    assert raised.value.errors()[0]["loc"] == ("engine_speculative_config",)


@pytest.mark.integration
@pytest.mark.asyncio(loop_scope="module")
async def test_the_embedded_engine_speculates_as_its_base_model_is_registered(
    api: Client, db: Sessions, settings: Settings
) -> None:
    import torch

    demo = demo_model_path()
    assert demo is not None, "the demo model ships in the source checkout (demo/model)"
    created = await register(api, DEMO_MODEL_NAME, demo, speculative_config=NGRAM)
    assert created.status_code == 201, created.text
    embedded = settings.model_copy(
        update={"engine_mode": "embedded", "engine_dtype": "float32", "engine_kv_budget": "32MiB"}
    )

    async def start(setting: str | None) -> tuple[SpeculativeConfig | None, bool, dict[str, Any] | None]:
        """(the engine's speculative config, whether its scheduler speculates, the base model's record) after a
        start with LORAPLEX_ENGINE_SPECULATIVE_CONFIG=`setting`."""
        resources = await Resources.open(embedded.model_copy(update={"engine_speculative_config": setting}))
        try:
            engine = resources.embedded_engine
            assert engine is not None
            async with db() as session:
                row = await BaseModelRepository(session).get_by_name(DEMO_MODEL_NAME)
            assert row is not None
            core = engine.core
            return core.config.speculative_config, core.scheduler.speculator is not None, row.speculative_config
        finally:
            await resources.close()

    num_threads = torch.get_num_threads()  # the engine sets it process-wide; give it back to the session after
    try:
        registered = SpeculativeConfig.parse(NGRAM)
        assert await start(None) == (registered, True, NGRAM_OUT)
        # The setting wins, and the record follows what is served (as it does for quantization).
        override = {"method": "ngram", "num_speculative_tokens": 2}
        served = SpeculativeConfig.parse(override)
        assert await start(json.dumps(override)) == (served, True, speculative_config_json(served))
        assert await start("none") == (None, False, None)
        assert await start(None) == (None, False, None)
    finally:
        torch.set_num_threads(num_threads)


# --- the console ----------------------------------------------------------------------------------------------

SPECULATIVE_CELL = re.compile(r'data-label="Speculative decoding" data-speculative="([a-z_]+)"')


@pytest.mark.integration
async def test_the_console_shows_sets_and_clears_it(
    client: Client, sessions: Sessions, tiny_base_checkpoint: Path
) -> None:
    client.follow_redirects = False
    await sign_in(client, ADMIN_TOKEN)
    models = "/console/admin/models"

    async def post(path: str, fields: dict[str, str]) -> Any:
        return await client.post(path, data={"csrf_token": await page_token(client, models), **fields})

    # Registered with one through the register form.
    response = await post(
        models, {"name": "tiny", "source": str(tiny_base_checkpoint), "speculative_config": json.dumps(NGRAM)}
    )
    assert response.status_code == 201, response.text
    assert SPECULATIVE_CELL.findall(response.text) == ["ngram"]
    assert await stored(sessions, "tiny") == [NGRAM_OUT]
    assert response.text.count('action="/console/admin/models/speculative"') == 1

    # A bad value: the page says why naming the field, keeps the input, and nothing changes.
    bad = '{"method": "ngram", "num_speculative_tokens": 0}'
    response = await post(f"{models}/speculative", {"name": "tiny", "speculative_config": bad})
    assert response.status_code == 400, response.text
    assert "Speculative config: num_speculative_tokens must be between 1" in response.text
    assert 'value="{&#34;method&#34;: &#34;ngram&#34;, &#34;num_speculative_tokens&#34;: 0}"' in response.text
    assert await stored(sessions, "tiny") == [NGRAM_OUT]
    response = await post(f"{models}/speculative", {"name": "tiny", "speculative_config": "{not json"})
    assert response.status_code == 400 and "not valid JSON" in response.text

    # Changed, then cleared with a blank field.
    response = await post(
        f"{models}/speculative",
        {"name": "tiny", "speculative_config": '{"method": "ngram", "num_speculative_tokens": 6}'},
    )
    assert response.status_code == 200, response.text
    assert "Base model tiny speculates by ngram." in response.text
    six_out = speculative_config_json(SpeculativeConfig(method="ngram", num_speculative_tokens=6))
    assert await stored(sessions, "tiny") == [six_out]
    response = await post(f"{models}/speculative", {"name": "tiny", "speculative_config": ""})
    assert response.status_code == 200, response.text
    assert "Base model tiny no longer speculates." in response.text
    assert SPECULATIVE_CELL.findall(response.text) == ["off"]
    assert await stored(sessions, "tiny") == [None]

    # Without the page's CSRF token the form is refused.
    response = await client.post(
        f"{models}/speculative", data={"name": "tiny", "speculative_config": json.dumps(NGRAM)}
    )
    assert response.status_code == 403, response.text
    assert await stored(sessions, "tiny") == [None]
