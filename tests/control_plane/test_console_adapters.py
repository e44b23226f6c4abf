"""The console's Adapters and Endpoints pages over HTTP on real Postgres, Redis and S3 (engine off, the tiny
checkpoint registered as a base model), and in Chromium on the demo platform: upload through the form (two files or
an archive, with and without the page's script), refusals that name the file and leave nothing behind, delete, and
endpoints on an adapter or on the base model."""

from __future__ import annotations

import io
import re
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from _support.adapters import make_peft_adapter
from _support.console import csrf_token, page_token, sign_in
from litestar import Litestar
from litestar.testing import AsyncTestClient

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from loraplex.platform.app import create_app
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, migrate

pytestmark = pytest.mark.integration

Client = AsyncTestClient[Litestar]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BASE = "tiny-llama"
DEMO_BASE = "loraplex-demo"
DEMO_ADAPTER = Path(__file__).resolve().parents[2] / "demo" / "adapters" / "upper"
NOTHING = ("", b"", "application/octet-stream")  # what a browser sends for a file input left empty


@pytest.fixture(scope="module")
def adapter_dir(tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real PEFT adapter (rank 4) for the tiny base."""
    out = tmp_path_factory.mktemp("adapter") / "support-bot"
    return make_peft_adapter(tiny_base_checkpoint, out, seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture
def files(adapter_dir: Path) -> dict[str, bytes]:
    return {name: (adapter_dir / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


@pytest.fixture
async def tenant(
    client: Client, make_tenant: Callable[[str], Any], tiny_base_checkpoint: Path
) -> tuple[dict[str, Any], str]:
    """A tenant signed in to the console (the client keeps its cookie), with BASE registered."""
    client.follow_redirects = False
    response = await client.post(
        "/admin/base-models", json={"name": BASE, "source": str(tiny_base_checkpoint)}, headers=ADMIN
    )
    assert response.status_code == 201, response.text
    made: tuple[dict[str, Any], str] = await make_tenant("acme")
    assert (await sign_in(client, made[1])).status_code == 303
    return made


def two_files(files: dict[str, bytes]) -> dict[str, Any]:
    """The form's file inputs with the two files chosen (under other filenames, as a user's may be) and no archive."""
    return {
        CONFIG_FILE: ("config.json", files[CONFIG_FILE], "application/json"),
        WEIGHTS_FILE: ("weights.safetensors", files[WEIGHTS_FILE], "application/octet-stream"),
        "archive": NOTHING,
    }


def archive_only(filename: str, data: bytes) -> dict[str, Any]:
    return {CONFIG_FILE: NOTHING, WEIGHTS_FILE: NOTHING, "archive": (filename, data, "application/octet-stream")}


def zipped(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def tarred(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


async def upload_form(client: Client, parts: dict[str, Any], *, name: str = "support-bot", **headers: str) -> Any:
    """Post the upload form as a browser does (multipart, the page's CSRF token in the form)."""
    token = await page_token(client, "/console/adapters")
    fields = {"csrf_token": token, "name": name, "base_model": BASE}
    return await client.post("/console/adapters", data=fields, files=parts, headers=headers)


async def listed(client: Client, key: str, what: str = "adapters") -> list[dict[str, Any]]:
    response = await client.get(f"/v1/{what}", headers=bearer(key))
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def stored(client: Client, tenant_id: str) -> list[str]:
    resources: Resources = client.app.state.resources
    return await resources.objects.list(f"tenants/{tenant_id}/")


async def test_two_files_through_the_form_give_a_ready_adapter_on_the_page(
    client: Client, tenant: tuple[dict[str, Any], str], files: dict[str, bytes]
) -> None:
    _, key = tenant
    page = await client.get("/console/adapters")
    assert page.status_code == 200
    assert "0 adapters" in page.text and f'<option value="{BASE}">' in page.text
    assert '<script src="/console/static/upload.js" defer></script>' in page.text

    response = await upload_form(client, two_files(files))
    assert response.status_code == 201, response.text
    assert response.headers["content-type"].startswith("text/html")
    (adapter,) = await listed(client, key)
    assert adapter["status"] == "ready" and adapter["rank"] == 4 and adapter["version"] == 1
    size = f"{adapter['size_bytes'] / 1024:.1f} KiB"
    assert f"Uploaded support-bot v1: ready, rank 4, {size}." in response.text
    assert "1 adapter<" in response.text
    row = re.search(rf'<tr data-adapter-id="{adapter["id"]}">(.*?)</tr>', response.text, re.S)
    assert row is not None
    assert 'class="badge ready">ready<' in row.group(1) and BASE in row.group(1) and size in row.group(1)
    assert f'title="{adapter["digest"]}">{adapter["digest"][:15]}…<' in row.group(1)


async def test_a_bad_file_is_refused_by_name_and_leaves_nothing_behind(
    client: Client, tenant: tuple[dict[str, Any], str], files: dict[str, bytes]
) -> None:
    made, key = tenant
    bad = {**files, WEIGHTS_FILE: b"this is not safetensors at all"}
    response = await upload_form(client, two_files(bad))
    assert response.status_code == 400
    assert 'role="alert"' in response.text and WEIGHTS_FILE in response.text
    assert "0 adapters" in response.text  # the page again, with the form, not an error page
    pickled = archive_only("adapter.zip", zipped({CONFIG_FILE: files[CONFIG_FILE], "adapter_model.bin": b"\x80\x04"}))
    response = await upload_form(client, pickled)
    assert response.status_code == 400 and "adapter_model.bin" in response.text
    nothing = {CONFIG_FILE: NOTHING, WEIGHTS_FILE: NOTHING, "archive": NOTHING}
    response = await upload_form(client, nothing)
    assert response.status_code == 400 and f"the upload has no {CONFIG_FILE}" in response.text
    assert await listed(client, key) == []
    assert await stored(client, made["id"]) == []


async def test_an_archive_uploads_and_a_second_upload_of_the_name_is_the_next_version(
    client: Client, tenant: tuple[dict[str, Any], str], files: dict[str, bytes]
) -> None:
    _, key = tenant
    response = await upload_form(client, archive_only("adapter.zip", zipped(files)))
    assert response.status_code == 201, response.text
    assert "Uploaded support-bot v1: ready, rank 4" in response.text
    response = await upload_form(client, archive_only("adapter.tar.gz", tarred(files)))
    assert response.status_code == 201, response.text
    assert "Uploaded support-bot v2: ready, rank 4" in response.text and "2 adapters<" in response.text
    assert sorted(a["version"] for a in await listed(client, key)) == [1, 2]


async def test_the_page_script_gets_json_and_problem_json(
    client: Client, tenant: tuple[dict[str, Any], str], files: dict[str, bytes]
) -> None:
    _, key = tenant
    token = await page_token(client, "/console/adapters")
    script = {"X-CSRF-Token": token, "Accept": "application/json"}
    fields = {"name": "support-bot", "base_model": BASE}
    response = await client.post("/console/adapters", data=fields, files=two_files(files), headers=script)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["object"] == "adapter" and body["status"] == "ready" and body["rank"] == 4
    assert [a["id"] for a in await listed(client, key)] == [body["id"]]

    bad = two_files({**files, CONFIG_FILE: b"{not json"})
    response = await client.post("/console/adapters", data=fields, files=bad, headers=script)
    assert response.status_code == 400
    assert CONFIG_FILE in response.json()["detail"]
    response = await client.post(
        "/console/adapters", data={**fields, "base_model": "nope"}, files=two_files(files), headers=script
    )
    assert response.status_code == 400 and response.json()["detail"] == "No base model named 'nope'."
    assert len(await listed(client, key)) == 1


async def test_delete_an_adapter_but_not_one_in_use_nor_another_tenants(
    client: Client, tenant: tuple[dict[str, Any], str], make_tenant: Callable[[str], Any], files: dict[str, bytes]
) -> None:
    made, key = tenant
    assert (await upload_form(client, two_files(files), name="kept")).status_code == 201
    assert (await upload_form(client, two_files(files), name="dropped")).status_code == 201
    adapters = {a["name"]: a for a in await listed(client, key)}
    token = await page_token(client, "/console/adapters")
    response = await client.post(
        "/console/endpoints",
        data={"csrf_token": token, "name": "bot", "base_model": BASE, "adapter_id": adapters["kept"]["id"]},
    )
    assert response.status_code == 201, response.text

    response = await client.post(f"/console/adapters/{adapters['dropped']['id']}/delete", data={"csrf_token": token})
    assert response.status_code == 303 and response.headers["location"] == "/console/adapters"
    assert [a["name"] for a in await listed(client, key)] == ["kept"]
    assert all(adapters["kept"]["id"] in name for name in await stored(client, made["id"]))

    response = await client.post(f"/console/adapters/{adapters['kept']['id']}/delete", data={"csrf_token": token})
    assert response.status_code == 409
    assert "Adapter &#39;kept&#39; v1 is used by an endpoint; delete the endpoint first." in response.text
    assert "1 adapter<" in response.text  # the page, with the list, not an error page

    _, other_key = await make_tenant("globex")
    client.cookies = httpx.Cookies()
    assert (await sign_in(client, other_key)).status_code == 303
    other_token = await page_token(client, "/console/adapters")
    response = await client.post(f"/console/adapters/{adapters['kept']['id']}/delete", data={"csrf_token": other_token})
    assert response.status_code == 404
    assert [a["name"] for a in await listed(client, key)] == ["kept"]


async def test_endpoints_on_an_adapter_and_on_the_base_model(
    client: Client,
    tenant: tuple[dict[str, Any], str],
    make_tenant: Callable[[str], Any],
    files: dict[str, bytes],
    tiny_base_checkpoint: Path,
) -> None:
    _, key = tenant
    response = await client.post(
        "/admin/base-models", json={"name": "tiny-two", "source": str(tiny_base_checkpoint)}, headers=ADMIN
    )
    assert response.status_code == 201
    assert (await upload_form(client, two_files(files))).status_code == 201
    (adapter,) = await listed(client, key)
    page = await client.get("/console/endpoints")
    assert page.status_code == 200 and "0 endpoints" in page.text
    assert f'<option value="{adapter["id"]}">support-bot v1</option>' in page.text
    assert '<option value="">none (the base model)</option>' in page.text
    token = csrf_token(page.text)

    async def create(name: str, adapter_id: str = "", base_model: str = BASE) -> Any:
        data = {"csrf_token": token, "name": name, "base_model": base_model, "adapter_id": adapter_id}
        return await client.post("/console/endpoints", data=data)

    response = await create("bot", adapter["id"])
    assert response.status_code == 201, response.text
    assert 'model="bot"' in response.text and 'href="/console/playground?model=bot"' in response.text
    response = await create("plain")
    assert response.status_code == 201
    endpoints = {e["name"]: e for e in await listed(client, key, "endpoints")}
    assert endpoints["bot"]["adapter_id"] == adapter["id"] and endpoints["plain"]["adapter_id"] is None
    rows = dict(
        re.findall(r'<tr data-endpoint-id="[^"]+">\s*<td data-label="Name">([^<]+)</td>(.*?)</tr>', response.text, re.S)
    )
    assert "support-bot v1" in rows["bot"] and "base model" in rows["plain"]
    assert "Try it in the playground" in rows["plain"] and "2 endpoints" in response.text

    response = await create("bot")
    assert response.status_code == 409
    assert "You already have an endpoint named &#39;bot&#39;." in response.text and "2 endpoints" in response.text
    response = await create("elsewhere", adapter["id"], base_model="tiny-two")
    assert response.status_code == 400 and "was made for another base model" in response.text
    response = await create("bad name!")
    assert response.status_code == 400 and "endpoint&#39;s name" in response.text
    assert sorted(e["name"] for e in await listed(client, key, "endpoints")) == ["bot", "plain"]

    response = await client.post(f"/console/endpoints/{endpoints['plain']['id']}/delete", data={"csrf_token": token})
    assert response.status_code == 303 and response.headers["location"] == "/console/endpoints"
    assert [e["name"] for e in await listed(client, key, "endpoints")] == ["bot"]

    _, other_key = await make_tenant("globex")
    client.cookies = httpx.Cookies()
    assert (await sign_in(client, other_key)).status_code == 303
    other_token = await page_token(client, "/console/endpoints")
    assert adapter["id"] not in (await client.get("/console/endpoints")).text  # not offered to another tenant
    response = await client.post(
        f"/console/endpoints/{endpoints['bot']['id']}/delete", data={"csrf_token": other_token}
    )
    assert response.status_code == 404
    assert [e["name"] for e in await listed(client, key, "endpoints")] == ["bot"]


async def test_an_upload_without_the_csrf_token_is_refused(
    client: Client, tenant: tuple[dict[str, Any], str], files: dict[str, bytes]
) -> None:
    made, key = tenant
    fields = {"name": "support-bot", "base_model": BASE}
    response = await client.post("/console/adapters", data=fields, files=two_files(files))
    assert response.status_code == 403 and "CSRF" in response.text
    assert await listed(client, key) == [] and await stored(client, made["id"]) == []


async def test_an_upload_over_the_limit_is_refused_with_the_limit(
    integration_settings: Settings, files: dict[str, bytes]
) -> None:
    settings = integration_settings.model_copy(update={"max_adapter_upload_bytes": 4096})
    await migrate(settings)
    async with AsyncTestClient(app=create_app(settings)) as small:
        small.follow_redirects = False
        response = await small.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
        tenant_id = response.json()["id"]
        response = await small.post(f"/admin/tenants/{tenant_id}/api-keys", json={"name": "k"}, headers=ADMIN)
        assert (await sign_in(small, response.json()["key"])).status_code == 303
        token = await page_token(small, "/console/adapters")
        fields = {"name": "support-bot", "base_model": BASE}
        response = await small.post("/console/adapters", data={**fields, "csrf_token": token}, files=two_files(files))
        assert response.status_code == 413
        assert response.headers["content-type"].startswith("text/html")
        assert "The upload is larger than 4,096 bytes, the most this server accepts." in response.text
        script = {"X-CSRF-Token": token, "Accept": "application/json"}
        response = await small.post("/console/adapters", data=fields, files=two_files(files), headers=script)
        assert response.status_code == 413
        assert response.json()["detail"] == "The upload is larger than 4,096 bytes, the most this server accepts."
