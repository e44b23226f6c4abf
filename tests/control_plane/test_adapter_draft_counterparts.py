"""Draft counterparts in adapter uploads, on real Postgres, Redis and S3: the draft/ files of an archive or of loose
parts are validated against the base model's draft model, stored beside the adapter's files under draft/ (where the
engine looks for them), reported as `draft_digest`, and deleted with the adapter; a counterpart that cannot run
(one file alone, no draft model, shapes not the draft's) is refused and leaves no row and no object.
"""

from __future__ import annotations

import json
import secrets
import tarfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from _support.adapters import make_peft_adapter
from _support.console import other_browser, sign_in
from _support.services import PostgresServer, RedisServer, S3Server
from litestar import Litestar
from litestar.testing import AsyncTestClient
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine.core.draft_model import DraftModelProposer
from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE, adapter_digest
from loraplex.engine.lora.manager import AdapterState
from loraplex.engine.tools.draft import make_truncated_draft, make_truncated_draft_adapter
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.fleet.embedded import DEMO_MODEL_NAME
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, module_settings
from .test_adapters import Part, make_tar_gz, make_zip, multipart, tar_file, tar_special

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

Client = AsyncTestClient[Litestar]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_UPLOAD = 256 * 1024  # bytes: small, so the total-size case costs nothing
WITH_DRAFT = "tiny-with-draft"  # speculates with a 1-layer truncated draft of itself
WITHOUT_DRAFT = "tiny-plain"  # does not speculate
NGRAM = "tiny-ngram"  # speculates, but with no draft model
DRAFT_CONFIG = f"draft/{CONFIG_FILE}"
DRAFT_WEIGHTS = f"draft/{WEIGHTS_FILE}"


@dataclass(frozen=True)
class Files:
    config: bytes
    weights: bytes

    @property
    def digest(self) -> str:
        return adapter_digest(self.config, self.weights)


def _read(folder: Path) -> Files:
    return Files((folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes())


@pytest.fixture(scope="module")
def draft_model(tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_truncated_draft(tiny_base_checkpoint, tmp_path_factory.mktemp("draft-model"), 1)


@pytest.fixture(scope="module")
def files(tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Files]:
    """ "adapter" (of the 2-layer base), "draft" (its counterpart for the 1-layer draft), "narrow" (the counterpart
    with one A matrix cut to half the hidden size)."""
    root = tmp_path_factory.mktemp("counterparts")
    adapter = make_peft_adapter(
        tiny_base_checkpoint, root / "adapter", seed=5, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    draft = _read(make_truncated_draft_adapter(adapter, root / "draft", 1))
    tensors = load_safetensors(draft.weights)
    key = sorted(k for k in tensors if k.endswith("q_proj.lora_A.weight"))[0]
    tensors[key] = tensors[key][:, : tensors[key].shape[1] // 2].contiguous()
    return {"adapter": _read(adapter), "draft": draft, "narrow": Files(draft.config, save_safetensors(tensors))}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> AsyncIterator[Settings]:
    async with module_settings(
        tmp_path_factory.mktemp("data"),
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        max_adapter_upload_bytes=MAX_UPLOAD,
    ) as value:
        yield value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(settings: Settings, tiny_base_checkpoint: Path, draft_model: Path) -> AsyncIterator[Client]:
    """One app for the module, with the tiny checkpoint registered three times: with a draft model, without
    speculation, and with n-gram speculation."""
    speculative = {
        WITH_DRAFT: {"method": "draft_model", "model": str(draft_model), "num_speculative_tokens": 2},
        WITHOUT_DRAFT: None,
        NGRAM: {"method": "ngram"},
    }
    async with AsyncTestClient(app=create_app(settings)) as client:
        for name, config in speculative.items():
            body: dict[str, Any] = {"name": name, "source": str(tiny_base_checkpoint)}
            if config is not None:
                body["speculative_config"] = config
            response = await client.post("/admin/base-models", json=body, headers=ADMIN)
            assert response.status_code == 201, response.text
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sessions(settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(settings.effective_database_url)
    try:
        yield create_session_factory(engine)
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def resources(api: Client) -> Resources:
    value: Resources = api.app.state.resources
    return value


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.key)


async def make_tenant(api: Client) -> Tenant:
    response = await api.post("/admin/tenants", json={"name": f"tenant-{secrets.token_hex(4)}"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    tenant_id = response.json()["id"]
    response = await api.post(f"/admin/tenants/{tenant_id}/api-keys", json={"name": "k"}, headers=ADMIN)
    assert response.status_code == 201, response.text
    return Tenant(tenant_id, response.json()["key"])


@pytest_asyncio.fixture(loop_scope="module")
async def tenant(api: Client) -> Tenant:
    return await make_tenant(api)


async def upload(
    api: Client, tenant: Tenant, parts: list[Part], *, base_model: str = WITH_DRAFT, name: str = "support-bot"
) -> Any:
    body, headers = multipart({"name": name, "base_model": base_model}, parts)
    return await api.post("/v1/adapters", content=body, headers={**tenant.headers, **headers})


def loose(adapter: Files, draft: Files | None, *, by_filename: bool = False) -> list[Part]:
    named = [(CONFIG_FILE, adapter.config), (WEIGHTS_FILE, adapter.weights)]
    if draft is not None:
        named += [(DRAFT_CONFIG, draft.config), (DRAFT_WEIGHTS, draft.weights)]
    if by_filename:
        return [("file", name, data) for name, data in named]
    return [(name, name, data) for name, data in named]


def zipped(adapter: Files, draft: Files) -> list[Part]:
    # As `zip -r` writes a folder: an entry for draft/ itself before its files.
    members: list[tuple[Any, bytes]] = [
        (CONFIG_FILE, adapter.config),
        (WEIGHTS_FILE, adapter.weights),
        ("draft/", b""),
        (DRAFT_CONFIG, draft.config),
        (DRAFT_WEIGHTS, draft.weights),
    ]
    return [("file", "adapter.zip", make_zip(members))]


def tarred(adapter: Files, draft: Files) -> list[Part]:
    # As `tar czf adapter.tar.gz -C DIR adapter_config.json adapter_model.safetensors draft` writes it.
    members = [
        tar_file(CONFIG_FILE, adapter.config),
        tar_file(WEIGHTS_FILE, adapter.weights),
        tar_special("draft", tarfile.DIRTYPE),
        tar_file(DRAFT_CONFIG, draft.config),
        tar_file(DRAFT_WEIGHTS, draft.weights),
    ]
    return [("file", "adapter.tar.gz", make_tar_gz(members))]


async def assert_nothing_stored(
    api: Client, resources: Resources, sessions: async_sessionmaker[AsyncSession], tenant: Tenant
) -> None:
    async with sessions() as session:
        query = select(func.count()).select_from(Adapter).where(Adapter.tenant_id == uuid.UUID(tenant.id))
        assert await session.scalar(query) == 0
    assert (await api.get("/v1/adapters", headers=tenant.headers)).json()["data"] == []
    assert await resources.objects.list(f"tenants/{tenant.id}/") == []


# --- uploads with a counterpart ---------------------------------------------------------------------------------

PACKAGINGS: dict[str, Callable[[Files, Files], list[Part]]] = {
    "loose-parts": lambda adapter, draft: loose(adapter, draft),
    "loose-by-filename": lambda adapter, draft: loose(adapter, draft, by_filename=True),
    "zip": zipped,
    "tar.gz": tarred,
}


@pytest.mark.parametrize("packaging", list(PACKAGINGS))
async def test_a_counterpart_is_stored_under_draft_and_reported(
    api: Client, resources: Resources, tenant: Tenant, files: dict[str, Files], packaging: str
) -> None:
    adapter, draft = files["adapter"], files["draft"]
    response = await upload(api, tenant, PACKAGINGS[packaging](adapter, draft))
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["status"], body["digest"], body["draft_digest"]) == ("ready", adapter.digest, draft.digest)
    assert body["draft_digest"] != body["digest"]
    assert body["size_bytes"] == len(adapter.weights)  # the adapter's weights, as without a counterpart

    prefix = f"tenants/{tenant.id}/adapters/{body['id']}/"
    stored = {
        key.removeprefix(prefix): await resources.objects.get(key) for key in await resources.objects.list(prefix)
    }
    assert stored == {
        CONFIG_FILE: adapter.config,
        WEIGHTS_FILE: adapter.weights,
        DRAFT_CONFIG: draft.config,
        DRAFT_WEIGHTS: draft.weights,
    }
    assert (await api.get(f"/v1/adapters/{body['id']}", headers=tenant.headers)).json() == body


async def test_without_a_counterpart_draft_digest_is_null_on_a_base_model_with_a_draft(
    api: Client, resources: Resources, tenant: Tenant, files: dict[str, Files]
) -> None:
    response = await upload(api, tenant, loose(files["adapter"], None))
    assert response.status_code == 201, response.text
    assert response.json()["draft_digest"] is None
    prefix = f"tenants/{tenant.id}/adapters/{response.json()['id']}/"
    assert await resources.objects.list(prefix) == [prefix + CONFIG_FILE, prefix + WEIGHTS_FILE]


async def test_deleting_the_adapter_deletes_its_counterpart(
    api: Client,
    resources: Resources,
    sessions: async_sessionmaker[AsyncSession],
    tenant: Tenant,
    files: dict[str, Files],
) -> None:
    created = await upload(api, tenant, zipped(files["adapter"], files["draft"]))
    assert created.status_code == 201, created.text
    adapter_id = created.json()["id"]
    assert len(await resources.objects.list(f"tenants/{tenant.id}/")) == 4
    response = await api.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
    assert response.status_code == 200, response.text
    await assert_nothing_stored(api, resources, sessions, tenant)


async def test_the_console_lists_which_adapters_have_a_counterpart(
    api: Client, tenant: Tenant, files: dict[str, Files]
) -> None:
    with_draft = (await upload(api, tenant, loose(files["adapter"], files["draft"]))).json()
    without = (await upload(api, tenant, loose(files["adapter"], None))).json()
    with other_browser(api):
        await sign_in(api, tenant.key)  # this client follows the redirect to the console's first page
        page = (await api.get("/console/adapters", follow_redirects=False)).text

    def cell(adapter_id: str) -> str:
        row = page.split(f'data-adapter-id="{adapter_id}"', 1)[1].split("</tr>", 1)[0]
        return row.split('data-label="Draft counterpart">', 1)[1].split("</td>", 1)[0]

    assert "yes" in cell(with_draft["id"]) and with_draft["draft_digest"] in cell(with_draft["id"])
    assert "none" in cell(without["id"])


# --- counterparts that cannot run ---------------------------------------------------------------------------------


def _bad_config(files: dict[str, Files]) -> list[Part]:
    values = json.loads(files["draft"].config)
    values["auto_map"] = {"AutoModel": "modeling.Evil"}
    return loose(files["adapter"], Files(json.dumps(values).encode(), files["draft"].weights))


@dataclass(frozen=True)
class Bad:
    parts: Callable[[dict[str, Files]], list[Part]]
    status: int
    message: str
    param: str | None
    base_model: str = WITH_DRAFT


BAD: dict[str, Bad] = {
    "draft-config-alone": Bad(
        lambda f: [*loose(f["adapter"], None), (DRAFT_CONFIG, DRAFT_CONFIG, f["draft"].config)],
        400,
        f"holds {DRAFT_CONFIG} but no {DRAFT_WEIGHTS}: a draft counterpart needs both files",
        DRAFT_WEIGHTS,
    ),
    "draft-weights-alone-in-zip": Bad(
        lambda f: [
            (
                "file",
                "adapter.zip",
                make_zip(
                    [
                        (CONFIG_FILE, f["adapter"].config),
                        (WEIGHTS_FILE, f["adapter"].weights),
                        (DRAFT_WEIGHTS, f["draft"].weights),
                    ]
                ),
            )
        ],
        400,
        f"holds {DRAFT_WEIGHTS} but no {DRAFT_CONFIG}",
        DRAFT_CONFIG,
    ),
    "no-draft-model": Bad(
        lambda f: loose(f["adapter"], f["draft"]),
        400,
        f"Base model '{WITHOUT_DRAFT}' has no draft model to run a draft counterpart on",
        DRAFT_CONFIG,
        WITHOUT_DRAFT,
    ),
    "ngram-has-no-draft-model": Bad(
        lambda f: loose(f["adapter"], f["draft"]),
        400,
        f"Base model '{NGRAM}' has no draft model to run a draft counterpart on",
        DRAFT_CONFIG,
        NGRAM,
    ),
    # The base model's adapter as its own counterpart: its second layer is not in the 1-layer draft.
    "more-layers-than-the-draft": Bad(
        lambda f: loose(f["adapter"], f["adapter"]),
        400,
        "does not fit the base model's draft model: ",
        None,
    ),
    "wrong-shape": Bad(
        lambda f: loose(f["adapter"], f["narrow"]),
        400,
        "does not fit the base model's draft model: ",
        None,
    ),
    "custom-code-in-the-draft-config": Bad(_bad_config, 400, f"{DRAFT_CONFIG} field 'auto_map'", "auto_map"),
    "pickle-by-magic": Bad(
        lambda f: loose(f["adapter"], Files(f["draft"].config, b"\x80\x04\x95" + bytes(64))),
        400,
        "pickle data",
        DRAFT_WEIGHTS,
    ),
    "pickle-by-name-in-draft": Bad(
        lambda f: [
            (
                "file",
                "adapter.tar.gz",
                make_tar_gz(
                    [
                        tar_file(CONFIG_FILE, f["adapter"].config),
                        tar_file(WEIGHTS_FILE, f["adapter"].weights),
                        tar_file("draft/adapter_model.bin", b"x"),
                    ]
                ),
            )
        ],
        400,
        "a pickle file by its name",
        "draft/adapter_model.bin",
    ),
    "other-folder-in-archive": Bad(
        lambda f: [
            (
                "file",
                "adapter.zip",
                make_zip(
                    [
                        (CONFIG_FILE, f["adapter"].config),
                        (WEIGHTS_FILE, f["adapter"].weights),
                        (f"drafts/{CONFIG_FILE}", f["draft"].config),
                    ]
                ),
            )
        ],
        400,
        "a path with folder components",
        f"drafts/{CONFIG_FILE}",
    ),
    "draft-in-archive-and-loose": Bad(
        lambda f: [*zipped(f["adapter"], f["draft"]), (DRAFT_CONFIG, DRAFT_CONFIG, f["draft"].config)],
        400,
        "an archive ('adapter.zip') and loose files",
        DRAFT_CONFIG,
    ),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_counterpart_that_cannot_run_is_refused_and_leaves_nothing(
    api: Client,
    resources: Resources,
    sessions: async_sessionmaker[AsyncSession],
    tenant: Tenant,
    files: dict[str, Files],
    case: str,
) -> None:
    bad = BAD[case]
    bucket_before = await resources.objects.list()
    response = await upload(api, tenant, bad.parts(files), base_model=bad.base_model)
    assert response.status_code == bad.status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert bad.message in error["message"], error["message"]
    if bad.param is not None:
        assert error["param"] == bad.param
    await assert_nothing_stored(api, resources, sessions, tenant)
    assert await resources.objects.list() == bucket_before


async def test_shape_errors_name_the_draft_file(api: Client, tenant: Tenant, files: dict[str, Files]) -> None:
    # parse_adapter names adapter_model.safetensors or a tensor; the message and param must point into draft/.
    response = await upload(api, tenant, loose(files["adapter"], files["adapter"]))
    error = response.json()["error"]
    assert error["message"].startswith(f"The draft counterpart ({DRAFT_CONFIG}, {DRAFT_WEIGHTS})"), error
    assert "1 layers" in error["message"], error
    assert error["param"] not in (CONFIG_FILE, WEIGHTS_FILE), error


async def test_the_archive_total_limit_covers_the_draft_files(
    api: Client,
    resources: Resources,
    sessions: async_sessionmaker[AsyncSession],
    tenant: Tenant,
    files: dict[str, Files],
) -> None:
    # Each file under the per-file limit, all four together over the total: refused by what the members declare.
    filler = torch.zeros(MAX_UPLOAD // 8, dtype=torch.float32)  # half the limit
    heavy = save_safetensors({"x": filler})
    members = [
        (CONFIG_FILE, files["adapter"].config),
        (WEIGHTS_FILE, heavy),
        (DRAFT_CONFIG, files["draft"].config),
        (DRAFT_WEIGHTS, heavy),
    ]
    response = await upload(api, tenant, [("file", "adapter.zip", make_zip(members))])
    assert response.status_code == 413, response.text
    assert "bytes of content, the most an upload may unpack to" in response.json()["error"]["message"]
    await assert_nothing_stored(api, resources, sessions, tenant)


# --- end to end ---------------------------------------------------------------------------------------------------


async def test_the_embedded_engine_answers_the_same_with_the_counterpart(
    demo_settings: Settings, tmp_path: Path
) -> None:
    """Uploaded counterparts reach the engine where it looks for them (draft/ beside the adapter's files), and
    speculating under one changes no token: greedy answers equal the adapter's without a counterpart."""
    from _support.speculation import DEMO, PROMPTS, UPPER

    speculative = {"method": "draft_model", "model": str(make_truncated_draft(DEMO, tmp_path / "draft", 2))}
    settings = demo_settings.model_copy(update={"engine_speculative_config": json.dumps(speculative)})
    upper, counterpart = _read(UPPER), _read(make_truncated_draft_adapter(UPPER, tmp_path / "upper-draft", 2))
    num_threads = torch.get_num_threads()  # the engine sets it process-wide; give it back to the session after
    try:
        async with AsyncTestClient(app=create_app(settings)) as client:
            tenant = await make_tenant(client)
            answers: dict[str, list[str]] = {}
            for name, draft in (("with-draft", counterpart), ("without-draft", None)):
                created = await upload(client, tenant, loose(upper, draft), base_model=DEMO_MODEL_NAME, name=name)
                assert created.status_code == 201, created.text
                assert created.json()["draft_digest"] == (draft.digest if draft else None)
                endpoint = {"name": name, "base_model": DEMO_MODEL_NAME, "adapter_id": created.json()["id"]}
                assert (await client.post("/v1/endpoints", json=endpoint, headers=tenant.headers)).status_code == 201
                answers[name] = []
                for prompt in PROMPTS[:3]:
                    request = {"model": name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
                    response = await client.post("/v1/completions", json=request, headers=tenant.headers)
                    assert response.status_code == 200, response.text
                    answers[name].append(response.json()["choices"][0]["text"])
            # The engine found the uploaded counterpart where it looks (draft/ of the adapter's folder) and took it.
            engine = client.app.state.resources.embedded_engine
            proposer = engine.core.scheduler.speculator.proposer
            assert isinstance(proposer, DraftModelProposer) and proposer.adapters is not None
            entry = proposer.adapters.manager.entries.get(counterpart.digest)
            assert entry is not None and entry.state is not AdapterState.FAILED, entry
    finally:
        torch.set_num_threads(num_threads)
    assert answers["with-draft"] == answers["without-draft"]
