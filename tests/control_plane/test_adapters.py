"""Tenants' adapter uploads on real Postgres, Redis and S3: packaging, versions, list/get/delete, and a corpus of
bad uploads, each of which must be refused with a message naming the problem and leave no row and no object.

One app, database and bucket serve the whole module (a fresh tenant per test keeps tests apart), so the corpus
stays fast. The upload limit is small here (MAX_UPLOAD) so the size cases cost nothing.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import secrets
import stat
import struct
import tarfile
import uuid
import warnings
import zipfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from _support.adapters import make_peft_adapter
from _support.services import PostgresServer, RedisServer, S3Server
from litestar import Litestar
from litestar.testing import AsyncTestClient
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from loraplex.engine.lora import CONFIG_FILE, WEIGHTS_FILE, adapter_digest, read_adapter_dir
from loraplex.engine.lora.adapter_config import MAX_CONFIG_BYTES
from loraplex.platform.app import create_app
from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.domain.adapters.models import Adapter
from loraplex.platform.domain.adapters.repository import AdapterRepository
from loraplex.platform.domain.adapters.service import ready_adapter_ref
from loraplex.platform.objectstore import LocalObjectStore, ObjectStoreError
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import ADMIN_TOKEN, bearer, module_settings

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

Client = AsyncTestClient[Litestar]

MAX_UPLOAD = 256 * 1024  # bytes: the module's upload limit, so oversized bodies and archive bombs stay cheap
MAX_RANK = 8
BASE = "tiny-llama"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# --- module fixtures: services, app, base model, adapters ---------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> AsyncIterator[Settings]:
    """Settings on a database, Redis prefix and bucket of this module's own, removed after it."""
    data_dir = tmp_path_factory.mktemp("data")
    async with module_settings(
        data_dir,
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        max_adapter_upload_bytes=MAX_UPLOAD,
        max_lora_rank=MAX_RANK,
    ) as value:
        yield value


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def api(settings: Settings, tiny_base_checkpoint: Path) -> AsyncIterator[Client]:
    """A client of one app for the whole module, with the tiny checkpoint registered as base model BASE."""
    async with AsyncTestClient(app=create_app(settings)) as client:
        response = await client.post(
            "/admin/base-models", json={"name": BASE, "source": str(tiny_base_checkpoint)}, headers=ADMIN
        )
        assert response.status_code == 201, response.text
        yield client


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def sessions(settings: Settings) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    """The test's own sessions on the module's database (the app's pool lives on the test client's event loop)."""
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
class AdapterBytes:
    config: bytes
    weights: bytes

    @property
    def digest(self) -> str:
        return adapter_digest(self.config, self.weights)

    def with_config(self, **changes: Any) -> AdapterBytes:
        values = json.loads(self.config)
        values.update(changes)
        return AdapterBytes(json.dumps(values).encode(), self.weights)


def _adapter(base: Path, out: Path, *, seed: int, r: int) -> AdapterBytes:
    make_peft_adapter(base, out, seed=seed, r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"])
    return AdapterBytes((out / CONFIG_FILE).read_bytes(), (out / WEIGHTS_FILE).read_bytes())


@pytest.fixture(scope="module")
def adapters(tiny_base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterBytes]:
    """Real PEFT adapters for the base: "good" and "other" (rank 4, different weights), "rank16" (over MAX_RANK)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "good": _adapter(tiny_base_checkpoint, root / "good", seed=1, r=4),
        "other": _adapter(tiny_base_checkpoint, root / "other", seed=2, r=4),
        "rank16": _adapter(tiny_base_checkpoint, root / "rank16", seed=3, r=16),
    }


@dataclass(frozen=True)
class Tenant:
    id: str
    headers: dict[str, str]


@pytest_asyncio.fixture(loop_scope="module")
async def make_tenant(api: Client) -> Callable[[], Any]:
    async def make() -> Tenant:
        response = await api.post("/admin/tenants", json={"name": f"tenant-{secrets.token_hex(4)}"}, headers=ADMIN)
        assert response.status_code == 201, response.text
        tenant = response.json()
        response = await api.post(f"/admin/tenants/{tenant['id']}/api-keys", json={"name": "k"}, headers=ADMIN)
        assert response.status_code == 201, response.text
        return Tenant(tenant["id"], bearer(response.json()["key"]))

    return make


@pytest_asyncio.fixture(loop_scope="module")
async def tenant(make_tenant: Callable[[], Any]) -> Tenant:
    made: Tenant = await make_tenant()
    return made


# --- helpers ------------------------------------------------------------------------------------------------

Part = tuple[str, str | None, bytes]  # (field name, filename or None for a plain field, content)


def two_files(adapter: AdapterBytes) -> list[Part]:
    return [(CONFIG_FILE, CONFIG_FILE, adapter.config), (WEIGHTS_FILE, WEIGHTS_FILE, adapter.weights)]


def multipart(fields: dict[str, str], parts: list[Part]) -> tuple[bytes, dict[str, str]]:
    """A multipart/form-data body (and its Content-Type header) with these text fields and parts, in order."""
    boundary = secrets.token_hex(16)
    body = bytearray()
    items: list[Part] = [(name, None, value.encode()) for name, value in fields.items()] + parts
    for name, filename, content in items:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    body += f"--{boundary}--\r\n".encode()
    return bytes(body), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


async def upload(
    api: Client, tenant: Tenant, parts: list[Part], *, name: str = "support-bot", base_model: str = BASE
) -> Any:
    body, headers = multipart({"name": name, "base_model": base_model}, parts)
    return await api.post("/v1/adapters", content=body, headers={**tenant.headers, **headers})


def make_zip(members: list[tuple[str | zipfile.ZipInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names, which one case wants
        with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for name, data in members:
                archive.writestr(name, data)
    return buffer.getvalue()


def patch_zip_size(data: bytes, name: str, size: int) -> bytes:
    """Rewrite the uncompressed size that the local header and the central directory declare for `name`."""
    patched = bytearray(data)
    # (signature, offset of the uncompressed size, of the name's length, of the name) in each kind of header
    for signature, size_at, length_at, name_at in ((b"PK\x03\x04", 22, 26, 30), (b"PK\x01\x02", 24, 28, 46)):
        start = patched.find(signature)
        while start != -1:
            (length,) = struct.unpack_from("<H", patched, start + length_at)
            if patched[start + name_at : start + name_at + length] == name.encode():
                struct.pack_into("<I", patched, start + size_at, size)
            start = patched.find(signature, start + 4)
    return bytes(patched)


def make_tar_gz(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for info, data in members:
            if info.isreg():
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
            else:
                archive.addfile(info)
    return buffer.getvalue()


def tar_file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def tar_special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, b""


def raw_safetensors(header: str, data: bytes) -> bytes:
    encoded = header.encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def edit_weights(adapter: AdapterBytes, edit: Callable[[dict[str, torch.Tensor]], None]) -> AdapterBytes:
    tensors = load_safetensors(adapter.weights)
    edit(tensors)
    return AdapterBytes(adapter.config, save_safetensors(tensors))


def first_key(tensors: dict[str, torch.Tensor], suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[0]


async def assert_nothing_stored(
    api: Client, resources: Resources, sessions: async_sessionmaker[AsyncSession], tenant: Tenant
) -> None:
    """No adapters row of the tenant in Postgres (in any state), none in its list, no object under its prefix."""
    async with sessions() as session:
        query = select(func.count()).select_from(Adapter).where(Adapter.tenant_id == uuid.UUID(tenant.id))
        assert await session.scalar(query) == 0
    listed = await api.get("/v1/adapters", headers=tenant.headers)
    assert listed.status_code == 200
    assert listed.json()["data"] == []
    assert await resources.objects.list(f"tenants/{tenant.id}/") == []


# --- uploads that work --------------------------------------------------------------------------------------


def _packaged(adapter: AdapterBytes, packaging: str) -> list[Part]:
    files = [(CONFIG_FILE, adapter.config), (WEIGHTS_FILE, adapter.weights)]
    if packaging == "two-files":
        return two_files(adapter)
    if packaging == "by-filename":  # field names say nothing; the filenames say which file is which
        return [("file", name, data) for name, data in files]
    if packaging == "zip":
        return [("file", "adapter.zip", make_zip(list(files)))]
    if packaging == "tar.gz":
        return [("file", "adapter.tar.gz", make_tar_gz([tar_file(n, d) for n, d in files]))]
    if packaging == "tgz-unnamed":  # recognised by content, whatever the name
        return [("archive", "upload", make_tar_gz([tar_file(n, d) for n, d in files]))]
    raise AssertionError(packaging)


class TestUpload:
    @pytest.mark.parametrize("packaging", ["two-files", "by-filename", "zip", "tar.gz", "tgz-unnamed"])
    async def test_packagings_store_the_same_adapter(
        self, api: Client, resources: Resources, tenant: Tenant, adapters: dict[str, AdapterBytes], packaging: str
    ) -> None:
        good = adapters["good"]
        response = await upload(api, tenant, _packaged(good, packaging))
        assert response.status_code == 201, response.text
        body = response.json()
        assert set(body) == {
            "id",
            "object",
            "name",
            "version",
            "base_model",
            "status",
            "error",
            "digest",
            "draft_digest",
            "rank",
            "size_bytes",
            "created_at",
        }
        assert body["object"] == "adapter"
        assert (body["name"], body["version"], body["base_model"]) == ("support-bot", 1, BASE)
        assert (body["status"], body["error"]) == ("ready", None)
        assert body["digest"] == good.digest
        assert body["draft_digest"] is None
        assert body["rank"] == 4
        assert body["size_bytes"] == len(good.weights)

        prefix = f"tenants/{tenant.id}/adapters/{body['id']}/"
        assert await resources.objects.list(prefix) == [prefix + CONFIG_FILE, prefix + WEIGHTS_FILE]
        assert await resources.objects.get(prefix + CONFIG_FILE) == good.config
        assert await resources.objects.get(prefix + WEIGHTS_FILE) == good.weights

        fetched = await api.get(f"/v1/adapters/{body['id']}", headers=tenant.headers)
        assert fetched.json() == body

    async def test_config_sent_as_a_plain_field(
        self, api: Client, tenant: Tenant, adapters: dict[str, AdapterBytes]
    ) -> None:
        # curl -F 'adapter_config.json=<adapter_config.json' sends the JSON as a text field, without a filename.
        good = adapters["good"]
        parts: list[Part] = [(CONFIG_FILE, None, good.config), (WEIGHTS_FILE, WEIGHTS_FILE, good.weights)]
        response = await upload(api, tenant, parts)
        assert response.status_code == 201, response.text
        assert response.json()["digest"] == good.digest

    async def test_same_name_adds_versions(
        self, api: Client, resources: Resources, tenant: Tenant, adapters: dict[str, AdapterBytes]
    ) -> None:
        first = (await upload(api, tenant, two_files(adapters["good"]))).json()
        again = (await upload(api, tenant, _packaged(adapters["good"], "zip"))).json()
        other = (await upload(api, tenant, two_files(adapters["other"]))).json()
        elsewhere = (await upload(api, tenant, two_files(adapters["other"]), name="another-name")).json()
        assert [first["version"], again["version"], other["version"], elsewhere["version"]] == [1, 2, 3, 1]
        assert again["digest"] == first["digest"]  # same content, same digest
        assert other["digest"] == adapters["other"].digest != first["digest"]
        assert len({first["id"], again["id"], other["id"], elsewhere["id"]}) == 4
        keys = await resources.objects.list(f"tenants/{tenant.id}/adapters/")
        assert len(keys) == 8  # each version has its own two objects; nothing was overwritten

    async def test_a_lost_version_race_takes_the_next_version(
        self, api: Client, tenant: Tenant, adapters: dict[str, AdapterBytes], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        assert (await upload(api, tenant, two_files(adapters["good"]))).status_code == 201
        real = AdapterRepository.latest_version
        calls: list[int] = []

        async def stale_once(self: AdapterRepository, name: str, tenant_id: Any) -> int:
            calls.append(1)
            # As if another upload committed version 1 after we looked: the unique constraint must catch it.
            return 0 if len(calls) == 1 else await real(self, name, tenant_id)

        monkeypatch.setattr(AdapterRepository, "latest_version", stale_once)
        response = await upload(api, tenant, two_files(adapters["other"]))
        assert response.status_code == 201, response.text
        assert response.json()["version"] == 2
        assert len(calls) == 2


# --- list, get, delete --------------------------------------------------------------------------------------


class TestReadAndDelete:
    async def test_list_newest_first_with_cursor_and_name(
        self, api: Client, tenant: Tenant, adapters: dict[str, AdapterBytes]
    ) -> None:
        ids = []
        for name in ("a", "b", "a"):
            response = await upload(api, tenant, two_files(adapters["good"]), name=name)
            ids.append(response.json()["id"])
        page = (await api.get("/v1/adapters?limit=2", headers=tenant.headers)).json()
        assert page["object"] == "list"
        assert [a["id"] for a in page["data"]] == [ids[2], ids[1]]
        assert page["has_more"] is True
        rest = (await api.get(f"/v1/adapters?limit=2&after={page['last_id']}", headers=tenant.headers)).json()
        assert [a["id"] for a in rest["data"]] == [ids[0]]
        assert rest["has_more"] is False
        named = (await api.get("/v1/adapters?name=a", headers=tenant.headers)).json()
        assert [(a["name"], a["version"]) for a in named["data"]] == [("a", 2), ("a", 1)]

    async def test_delete_removes_row_and_objects(
        self,
        api: Client,
        resources: Resources,
        sessions: async_sessionmaker[AsyncSession],
        tenant: Tenant,
        adapters: dict[str, AdapterBytes],
    ) -> None:
        adapter_id = (await upload(api, tenant, two_files(adapters["good"]))).json()["id"]
        response = await api.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
        assert response.status_code == 200
        assert response.json() == {"id": adapter_id, "object": "adapter", "deleted": True}
        assert (await api.get(f"/v1/adapters/{adapter_id}", headers=tenant.headers)).status_code == 404
        await assert_nothing_stored(api, resources, sessions, tenant)
        again = await api.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
        assert again.status_code == 404

    async def test_delete_while_an_endpoint_uses_it_is_409(
        self, api: Client, resources: Resources, tenant: Tenant, adapters: dict[str, AdapterBytes]
    ) -> None:
        adapter_id = (await upload(api, tenant, two_files(adapters["good"]))).json()["id"]
        endpoint = await api.post(
            "/v1/endpoints",
            json={"name": "bot", "base_model": BASE, "adapter_id": adapter_id},
            headers=tenant.headers,
        )
        assert endpoint.status_code == 201, endpoint.text
        response = await api.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
        assert response.status_code == 409
        error = response.json()["error"]
        assert error["code"] == "conflict"
        assert "endpoint" in error["message"]
        assert (await api.get(f"/v1/adapters/{adapter_id}", headers=tenant.headers)).status_code == 200
        assert len(await resources.objects.list(f"tenants/{tenant.id}/adapters/{adapter_id}/")) == 2

        await api.delete(f"/v1/endpoints/{endpoint.json()['id']}", headers=tenant.headers)
        assert (await api.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)).status_code == 200

    async def test_another_tenants_adapter_is_404_like_a_missing_one(
        self, api: Client, resources: Resources, make_tenant: Callable[[], Any], adapters: dict[str, AdapterBytes]
    ) -> None:
        owner, stranger = await make_tenant(), await make_tenant()
        adapter_id = (await upload(api, owner, two_files(adapters["good"]))).json()["id"]
        missing = str(uuid.uuid4())
        for method in ("get", "delete"):
            theirs = await getattr(api, method)(f"/v1/adapters/{adapter_id}", headers=stranger.headers)
            nobodys = await getattr(api, method)(f"/v1/adapters/{missing}", headers=stranger.headers)
            assert theirs.status_code == nobodys.status_code == 404
            # The same answer but for the id it quotes: nothing tells "someone else's" from "does not exist".
            assert theirs.text == nobodys.text.replace(missing, adapter_id)
        assert (await api.get("/v1/adapters", headers=stranger.headers)).json()["data"] == []
        assert (await api.get(f"/v1/adapters/{adapter_id}", headers=owner.headers)).status_code == 200
        assert len(await resources.objects.list(f"tenants/{owner.id}/")) == 2


# --- nothing half-written -----------------------------------------------------------------------------------


class TestNothingHalfWritten:
    async def test_a_failed_store_deletes_what_was_stored(
        self,
        api: Client,
        resources: Resources,
        sessions: async_sessionmaker[AsyncSession],
        tenant: Tenant,
        adapters: dict[str, AdapterBytes],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        real_put = resources.objects.put
        puts: list[str] = []

        async def put_then_fail(key: str, data: bytes, **kwargs: Any) -> Any:
            puts.append(key)
            if key.endswith(WEIGHTS_FILE):
                raise ObjectStoreError("S3 is down")
            return await real_put(key, data, **kwargs)

        monkeypatch.setattr(resources.objects, "put", put_then_fail)
        response = await upload(api, tenant, two_files(adapters["good"]))
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "storage_unavailable"
        assert len(puts) == 2  # the config was stored, and must be gone again
        monkeypatch.undo()
        await assert_nothing_stored(api, resources, sessions, tenant)

    async def test_a_failed_commit_deletes_the_objects(
        self,
        api: Client,
        resources: Resources,
        sessions: async_sessionmaker[AsyncSession],
        tenant: Tenant,
        adapters: dict[str, AdapterBytes],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        async def failing_commit(self: AsyncSession) -> None:
            raise ConnectionError("database went away")

        monkeypatch.setattr(AsyncSession, "commit", failing_commit)
        response = await upload(api, tenant, two_files(adapters["good"]))
        # A dependency gone away is a 503 the client may retry, not a 500.
        assert response.status_code == 503
        assert "retry-after" in response.headers
        monkeypatch.undo()
        await assert_nothing_stored(api, resources, sessions, tenant)


# --- where engines find an adapter --------------------------------------------------------------------------


class TestReadyAdapterRef:
    async def test_s3_uri_names_the_folder_of_both_files(
        self, api: Client, resources: Resources, tenant: Tenant, adapters: dict[str, AdapterBytes]
    ) -> None:
        body = (await upload(api, tenant, two_files(adapters["good"]))).json()
        # The row as the API described it (the app's database pool lives on the test client's own event loop).
        row = Adapter(
            id=uuid.UUID(body["id"]),
            tenant_id=uuid.UUID(tenant.id),
            name=body["name"],
            version=body["version"],
            status=body["status"],
            digest=body["digest"],
        )
        uri, digest = ready_adapter_ref(resources, row)
        assert uri == f"s3://{resources.settings.s3_bucket}/tenants/{tenant.id}/adapters/{body['id']}"
        assert digest == adapters["good"].digest
        folder = uri.removeprefix(f"s3://{resources.settings.s3_bucket}/")
        assert await resources.objects.list(folder + "/") == [f"{folder}/{CONFIG_FILE}", f"{folder}/{WEIGHTS_FILE}"]

    async def test_local_store_gives_a_folder_the_engine_reads(
        self, tmp_path: Path, adapters: dict[str, AdapterBytes]
    ) -> None:
        store = LocalObjectStore(tmp_path / "objects")
        good = adapters["good"]
        row = Adapter(id=uuid.uuid4(), tenant_id=uuid.uuid4(), name="x", version=1, status="ready", digest=good.digest)
        for name, data in ((CONFIG_FILE, good.config), (WEIGHTS_FILE, good.weights)):
            await store.put(f"tenants/{row.tenant_id}/adapters/{row.id}/{name}", data)
        uri, digest = ready_adapter_ref(_StoreOnly(store), row)  # type: ignore[arg-type]
        assert Path(uri).is_absolute()
        assert read_adapter_dir(Path(uri)) == (good.config, good.weights)
        assert digest == good.digest


class TestBaseModelRegistration:
    """What registration checks in a checkpoint's config.json: a GPTQ/AWQ one is served as it is."""

    @staticmethod
    def _gptq_folder(base: Path, folder: Path, **spec: Any) -> Path:
        folder.mkdir()
        config = json.loads((base / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, **spec}
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    async def _names(self, api: Client) -> set[str]:
        response = await api.get("/admin/base-models", headers=ADMIN)
        assert response.status_code == 200, response.text
        return {m["name"] for m in response.json()["data"]}

    async def test_a_gptq_checkpoint_registers_without_quantization_only(
        self, api: Client, tiny_base_checkpoint: Path, tmp_path: Path
    ) -> None:
        source = str(self._gptq_folder(tiny_base_checkpoint, tmp_path / "gptq"))
        name = f"gptq-{secrets.token_hex(3)}"
        refused = await api.post(
            "/admin/base-models", json={"name": name, "source": source, "quantization": "int8"}, headers=ADMIN
        )
        assert refused.status_code == 400, refused.text
        assert "already quantized (GPTQ, 4-bit)" in refused.json()["detail"]
        assert name not in await self._names(api)
        created = await api.post("/admin/base-models", json={"name": name, "source": source}, headers=ADMIN)
        assert created.status_code == 201, created.text
        assert created.json()["quantization"] is None

    async def test_an_unsupported_gptq_checkpoint_is_refused(
        self, api: Client, tiny_base_checkpoint: Path, tmp_path: Path
    ) -> None:
        source = str(self._gptq_folder(tiny_base_checkpoint, tmp_path / "gptq8", bits=8))
        name = f"gptq8-{secrets.token_hex(3)}"
        refused = await api.post("/admin/base-models", json={"name": name, "source": source}, headers=ADMIN)
        assert refused.status_code == 400, refused.text
        assert "bits is 8" in refused.json()["detail"]
        assert name not in await self._names(api)


@dataclass
class _StoreOnly:
    objects: LocalObjectStore


# --- the corpus of bad uploads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """A bad upload: parts made from the module's adapters, and what the answer must say."""

    parts: Callable[[dict[str, AdapterBytes]], list[Part]]
    status: int
    message: str  # a fragment the error message must contain
    param: str | None = None  # the error's param, when the case pins it
    form: dict[str, str] = field(default_factory=dict)  # overrides of the text fields
    mangle: Callable[[bytes], bytes] | None = None  # applied to the finished multipart body
    content_type: str | None = None  # instead of multipart/form-data with the body's boundary


def _config(**changes: Any) -> Callable[[dict[str, AdapterBytes]], list[Part]]:
    return lambda a: two_files(a["good"].with_config(**changes))


def _weights(data: bytes) -> Callable[[dict[str, AdapterBytes]], list[Part]]:
    return lambda a: [(CONFIG_FILE, CONFIG_FILE, a["good"].config), (WEIGHTS_FILE, WEIGHTS_FILE, data)]


def _zip(members: Callable[[AdapterBytes], list[tuple[str | zipfile.ZipInfo, bytes]]]) -> Callable[..., list[Part]]:
    return lambda a: [("file", "adapter.zip", make_zip(members(a["good"])))]


def _tar(members: Callable[[AdapterBytes], list[tuple[tarfile.TarInfo, bytes]]]) -> Callable[..., list[Part]]:
    return lambda a: [("file", "adapter.tar.gz", make_tar_gz(members(a["good"])))]


def _zip_symlink(good: AdapterBytes) -> list[tuple[str | zipfile.ZipInfo, bytes]]:
    link = zipfile.ZipInfo(WEIGHTS_FILE)
    link.create_system = 3  # unix: the high 16 bits of external_attr are st_mode
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    return [(CONFIG_FILE, good.config), (link, b"/etc/passwd")]


def _zip_bomb_declared_small(a: dict[str, AdapterBytes]) -> list[Part]:
    # 4x the limit of zeros, deflated to about 1 KiB, declaring 100 bytes.
    data = make_zip([(CONFIG_FILE, a["good"].config), (WEIGHTS_FILE, bytes(4 * MAX_UPLOAD))])
    return [("file", "bomb.zip", patch_zip_size(data, WEIGHTS_FILE, 100))]


def _zip_bomb_declared_huge(a: dict[str, AdapterBytes]) -> list[Part]:
    data = make_zip([(CONFIG_FILE, a["good"].config), (WEIGHTS_FILE, a["good"].weights)])
    return [("file", "bomb.zip", patch_zip_size(data, WEIGHTS_FILE, 0xFFFF_FFF0))]


def _tar_pax_bomb(a: dict[str, AdapterBytes]) -> list[Part]:
    # No member declares much, but a PAX extended header (which tarfile reads whole) inflates to 8x the limit:
    # only counting the bytes that come out of gzip catches it.
    info = tarfile.TarInfo(CONFIG_FILE)
    info.pax_headers = {"comment": "x" * (8 * MAX_UPLOAD)}
    info.size = len(a["good"].config)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.PAX_FORMAT) as archive:
        archive.addfile(info, io.BytesIO(a["good"].config))
    return [("file", "adapter.tgz", buffer.getvalue())]


def _torch_save() -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buffer)
    return buffer.getvalue()


def _edited(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[dict[str, AdapterBytes]], list[Part]]:
    return lambda a: two_files(edit_weights(a["good"], edit))


def _put_nan(tensors: dict[str, torch.Tensor]) -> None:
    tensors[first_key(tensors, "lora_B.weight")][0, 0] = float("nan")


def _narrow_a(tensors: dict[str, torch.Tensor]) -> None:
    key = first_key(tensors, "q_proj.lora_A.weight")
    tensors[key] = tensors[key][:, :32].contiguous()


def _f32x2(start: int, end: int) -> str:
    """A safetensors header entry: two float32 values at [start, end) of the data section."""
    return json.dumps({"dtype": "F32", "shape": [2], "data_offsets": [start, end]})


def _declared_header(length: int) -> bytes:
    """A safetensors file whose first 8 bytes declare a `length`-byte header, followed by a tiny valid-looking one."""
    return struct.pack("<Q", length) + b"{}"


def _patch_zip_flags(data: bytes, name: str, flags: int) -> bytes:
    """Set general-purpose flag bits (bit 0: encrypted) for `name` in the local header and the central directory."""
    patched = bytearray(data)
    for signature, flags_at, length_at, name_at in ((b"PK\x03\x04", 6, 26, 30), (b"PK\x01\x02", 8, 28, 46)):
        start = patched.find(signature)
        while start != -1:
            (length,) = struct.unpack_from("<H", patched, start + length_at)
            if patched[start + name_at : start + name_at + length] == name.encode():
                (old,) = struct.unpack_from("<H", patched, start + flags_at)
                struct.pack_into("<H", patched, start + flags_at, old | flags)
            start = patched.find(signature, start + 4)
    return bytes(patched)


def _zip_encrypted(a: dict[str, AdapterBytes]) -> list[Part]:
    data = make_zip([(CONFIG_FILE, a["good"].config), (WEIGHTS_FILE, a["good"].weights)])
    return [("file", "adapter.zip", _patch_zip_flags(data, WEIGHTS_FILE, 0x1))]


def _zip_declared(config_size: int, weights_size: int) -> Callable[[dict[str, AdapterBytes]], list[Part]]:
    """A zip of the good adapter whose members declare these uncompressed sizes."""

    def parts(a: dict[str, AdapterBytes]) -> list[Part]:
        data = make_zip([(CONFIG_FILE, a["good"].config), (WEIGHTS_FILE, a["good"].weights)])
        data = patch_zip_size(patch_zip_size(data, CONFIG_FILE, config_size), WEIGHTS_FILE, weights_size)
        return [("file", "adapter.zip", data)]

    return parts


def _rename_layer(tensors: dict[str, torch.Tensor]) -> None:
    for key in [k for k in tensors if ".layers.1." in k]:
        tensors[key.replace(".layers.1.", ".layers.7.")] = tensors.pop(key)


def _drop_b(tensors: dict[str, torch.Tensor]) -> None:
    del tensors[first_key(tensors, "v_proj.lora_B.weight")]


def _add_untargeted(tensors: dict[str, torch.Tensor]) -> None:
    # o_proj maps hidden to hidden like q_proj in this base, so q_proj's shapes fit it; the config targets q and v.
    for half in ("A", "B"):
        source = first_key(tensors, f"q_proj.lora_{half}.weight")
        tensors[source.replace("self_attn.q_proj", "self_attn.o_proj")] = tensors[source].clone()


def _add_embedding(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(2, 2)


def _add_stray(tensors: dict[str, torch.Tensor]) -> None:
    tensors["base_model.model.model.norm.weight"] = torch.zeros(2)


def _narrow_b(tensors: dict[str, torch.Tensor]) -> None:
    key = first_key(tensors, "v_proj.lora_B.weight")
    tensors[key] = tensors[key][:8].contiguous()


def _to_int(tensors: dict[str, torch.Tensor]) -> None:
    key = first_key(tensors, "q_proj.lora_A.weight")
    tensors[key] = tensors[key].to(torch.int32)


def _put_inf(tensors: dict[str, torch.Tensor]) -> None:
    tensors[first_key(tensors, "lora_A.weight")][0, 0] = float("-inf")


def _put_huge(tensors: dict[str, torch.Tensor]) -> None:
    # Finite in float32, but lora_alpha / r = 2 scales B past float32's largest value.
    tensors[first_key(tensors, "v_proj.lora_B.weight")][0, 0] = 3e38


BAD: dict[str, Bad] = {
    # what the upload holds
    "missing-weights": Bad(lambda a: two_files(a["good"])[:1], 400, f"no {WEIGHTS_FILE}", WEIGHTS_FILE),
    "missing-config": Bad(lambda a: two_files(a["good"])[1:], 400, f"no {CONFIG_FILE}", CONFIG_FILE),
    "no-files": Bad(lambda a: [], 400, f"no {CONFIG_FILE}"),
    "extra-file": Bad(
        lambda a: [*two_files(a["good"]), ("readme", "README.md", b"hi")], 400, "unexpected file 'README.md'"
    ),
    "config-twice": Bad(
        lambda a: [*two_files(a["good"]), ("file", CONFIG_FILE, a["good"].config)], 400, f"{CONFIG_FILE} 2 times"
    ),
    "archive-and-files": Bad(
        lambda a: [*_packaged(a["good"], "zip"), *two_files(a["good"])[:1]], 400, "an archive ('adapter.zip') and"
    ),
    "weights-as-text-field": Bad(  # curl -F 'adapter_model.safetensors=<FILE' (no filename): not UTF-8 text
        lambda a: [two_files(a["good"])[0], (WEIGHTS_FILE, None, a["good"].weights)], 400, "must be UTF-8 text"
    ),
    "wrong-base-model": Bad(
        lambda a: two_files(a["good"]), 400, "No base model named 'nope'", "base_model", {"base_model": "nope"}
    ),
    "missing-name": Bad(lambda a: two_files(a["good"]), 400, "Missing required field 'name'", "name", {"name": ""}),
    "bad-name": Bad(lambda a: two_files(a["good"]), 400, "Invalid value for 'name'", "name", {"name": "../x"}),
    # archives
    "zip-subdirectory": Bad(
        _zip(lambda g: [(f"adapter/{CONFIG_FILE}", g.config), (f"adapter/{WEIGHTS_FILE}", g.weights)]),
        400,
        "a path with folder components",
    ),
    "tar-folder": Bad(
        _tar(lambda g: [tar_special("adapter", tarfile.DIRTYPE), tar_file(f"adapter/{CONFIG_FILE}", g.config)]),
        400,
        "holds the folder 'adapter'",
    ),
    "zip-dotdot": Bad(_zip(lambda g: [(f"../{CONFIG_FILE}", g.config), (WEIGHTS_FILE, g.weights)]), 400, "or '..'"),
    "tar-dotdot": Bad(_tar(lambda g: [tar_file("../x", b"x")]), 400, "'../x', a path with folder components"),
    "zip-symlink": Bad(_zip(_zip_symlink), 400, "as a symbolic link", WEIGHTS_FILE),
    "tar-symlink": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_special(WEIGHTS_FILE, tarfile.SYMTYPE, "/etc/x")]),
        400,
        "as a symbolic link",
        WEIGHTS_FILE,
    ),
    "tar-hardlink": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_special(WEIGHTS_FILE, tarfile.LNKTYPE, CONFIG_FILE)]),
        400,
        "as a hard link",
    ),
    "tar-device": Bad(_tar(lambda g: [tar_special(CONFIG_FILE, tarfile.CHRTYPE)]), 400, "a device"),
    "zip-duplicate": Bad(
        _zip(lambda g: [(CONFIG_FILE, g.config), (WEIGHTS_FILE, g.weights), (CONFIG_FILE, b"{}")]), 400, "twice"
    ),
    "tar-duplicate": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file(CONFIG_FILE, g.config)]), 400, "twice"
    ),
    "zip-extra-member": Bad(
        _zip(lambda g: [(CONFIG_FILE, g.config), (WEIGHTS_FILE, g.weights), ("notes.txt", b"x")]),
        400,
        "'notes.txt', which is not an adapter file",
    ),
    "zip-missing-member": Bad(_zip(lambda g: [(CONFIG_FILE, g.config)]), 400, f"has no {WEIGHTS_FILE}"),
    "zip-bomb-declared-small": Bad(
        _zip_bomb_declared_small, 400, "does not match the size and checksum the archive declares", WEIGHTS_FILE
    ),
    "zip-bomb-declared-huge": Bad(_zip_bomb_declared_huge, 413, "as the archive declares it", WEIGHTS_FILE),
    "tar-bomb": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file(WEIGHTS_FILE, bytes(4 * MAX_UPLOAD))]),
        413,
        f"at most {MAX_UPLOAD} are accepted",
        WEIGHTS_FILE,
    ),
    "tar-pax-bomb": Bad(_tar_pax_bomb, 413, "unpacks to more than"),
    "corrupt-zip": Bad(lambda a: [("file", "adapter.zip", b"PK\x03\x04garbage")], 400, "not a readable zip archive"),
    "not-an-archive": Bad(lambda a: [("file", "adapter.zip", b"hello")], 400, "neither a zip archive nor"),
    # pickle and code
    "pickle-by-name": Bad(
        lambda a: [two_files(a["good"])[0], ("adapter_model.bin", "adapter_model.bin", _torch_save())],
        400,
        "a pickle file by its name",
        "adapter_model.bin",
    ),
    "pickle-by-name-in-zip": Bad(
        _zip(lambda g: [(CONFIG_FILE, g.config), ("adapter_model.bin", b"x")]), 400, "a pickle file by its name"
    ),
    "pickle-by-magic": Bad(_weights(b"\x80\x04\x95" + bytes(64)), 400, "pickle data", WEIGHTS_FILE),
    "pickle-by-magic-in-tar": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file(WEIGHTS_FILE, b"\x80\x02}q\x00.")]),
        400,
        "pickle data",
    ),
    "torch-save-zip": Bad(_weights(_torch_save()), 400, "the format torch.save writes", WEIGHTS_FILE),
    "py-part": Bad(
        lambda a: [*two_files(a["good"]), ("code", "modeling.py", b"import os")], 400, "a Python file", "modeling.py"
    ),
    "py-member": Bad(
        _zip(lambda g: [(CONFIG_FILE, g.config), (WEIGHTS_FILE, g.weights), ("modeling.py", b"import os")]),
        400,
        "a Python file",
    ),
    "auto-map": Bad(_config(auto_map={"AutoModel": "modeling.Evil"}), 400, "custom model code", "auto_map"),
    # the engine's validator
    "use-dora": Bad(_config(use_dora=True), 400, "DoRA", "use_dora"),
    "bias-all": Bad(_config(bias="all"), 400, "field 'bias' is 'all'", "bias"),
    "modules-to-save": Bad(_config(modules_to_save=["lm_head"]), 400, "modules_to_save", "modules_to_save"),
    "lm-head-target": Bad(
        _config(target_modules=["q_proj", "v_proj", "lm_head"]), 400, "output layer is not supported", "target_modules"
    ),
    "matches-no-module": Bad(_config(target_modules=["nothing_here"]), 400, "selects no module", "target_modules"),
    "rank-over-limit": Bad(lambda a: two_files(a["rank16"]), 400, f"rank 16 (from {CONFIG_FILE}); this server"),
    "nan": Bad(_edited(_put_nan), 400, "NaN or infinite"),
    "wrong-shape": Bad(_edited(_narrow_a), 400, "has shape [4, 32]; expected [4, 64]"),
    "non-json-config": Bad(
        lambda a: [(CONFIG_FILE, CONFIG_FILE, b"not json"), two_files(a["good"])[1]], 400, "not valid UTF-8 JSON"
    ),
    "header-past-end": Bad(_weights(struct.pack("<Q", 1000) + b"{}"), 400, "declares a 1000-byte header"),
    "overlapping-offsets": Bad(
        _weights(raw_safetensors(f'{{"a": {_f32x2(0, 8)}, "b": {_f32x2(4, 12)}}}', bytes(12))),
        400,
        "overlaps the tensor before it",
    ),
    "duplicate-keys": Bad(
        _weights(raw_safetensors(f'{{"a": {_f32x2(0, 8)}, "a": {_f32x2(0, 8)}}}', bytes(8))),
        400,
        "names 'a' twice",
    ),
    "unknown-dtype": Bad(
        _weights(raw_safetensors('{"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}', bytes(16))),
        400,
        "unknown dtype 'F128'",
    ),
    # more of what the upload holds, and archives
    "two-archives": Bad(
        lambda a: [*_packaged(a["good"], "zip"), ("other", "b.tar.gz", _packaged(a["good"], "tar.gz")[0][2])],
        400,
        "holds 2 archives",
    ),
    "tar-extra-member": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file(WEIGHTS_FILE, g.weights), tar_file("x.md", b"x")]),
        400,
        "'x.md', which is not an adapter file",
        "x.md",
    ),
    "tar-missing-member": Bad(_tar(lambda g: [tar_file(WEIGHTS_FILE, g.weights)]), 400, f"has no {CONFIG_FILE}"),
    "zip-folder-entry": Bad(
        _zip(lambda g: [("adapter/", b""), (CONFIG_FILE, g.config), (WEIGHTS_FILE, g.weights)]),
        400,
        "holds the folder 'adapter/'",
    ),
    "tar-absolute-path": Bad(
        _tar(lambda g: [tar_file(f"/{CONFIG_FILE}", g.config), tar_file(WEIGHTS_FILE, g.weights)]),
        400,
        "a path with folder components",
    ),
    "zip-backslash-path": Bad(
        _zip(lambda g: [(f"adapter\\{CONFIG_FILE}", g.config), (WEIGHTS_FILE, g.weights)]),
        400,
        "a path with folder components",
    ),
    "zip-encrypted": Bad(_zip_encrypted, 400, "encrypted; pack it without a password", WEIGHTS_FILE),
    "zip-config-over-member-cap": Bad(
        _zip_declared(2 * MAX_CONFIG_BYTES, 100), 413, f"at most {MAX_CONFIG_BYTES} are accepted", CONFIG_FILE
    ),
    "zip-declared-total-over-cap": Bad(
        _zip_declared(1000, MAX_UPLOAD - 100), 413, f"declares more than {MAX_UPLOAD} bytes of content", WEIGHTS_FILE
    ),
    "gzip-not-tar": Bad(
        lambda a: [("file", "adapter.tar.gz", gzip.compress(b"not a tar archive" * 40))],
        400,
        "not a readable .tar.gz archive",
    ),
    "pickle-by-name-in-tar": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file("adapter_model.pt", b"x")]),
        400,
        "a pickle file by its name",
    ),
    "pickle-part-by-name": Bad(
        lambda a: [*two_files(a["good"]), ("extra", "optimizer.pkl", b"x")], 400, "a pickle file by its name"
    ),
    "pickle-config-by-magic": Bad(
        lambda a: [(CONFIG_FILE, CONFIG_FILE, pickle.dumps({"r": 4})), two_files(a["good"])[1]],
        400,
        "pickle data",
        CONFIG_FILE,
    ),
    "py-member-in-tar": Bad(
        _tar(lambda g: [tar_file(CONFIG_FILE, g.config), tar_file(WEIGHTS_FILE, g.weights), tar_file("x.py", b"")]),
        400,
        "a Python file",
    ),
    "pyc-part": Bad(lambda a: [*two_files(a["good"]), ("code", "modeling.pyc", b"\x00")], 400, "a Python file"),
    "auto-map-in-zip": Bad(
        lambda a: _packaged(a["good"].with_config(auto_map={"AutoModel": "m.Evil"}), "zip"),
        400,
        "custom model code",
        "auto_map",
    ),
    # more of the engine's validator: the config
    "config-not-an-object": Bad(
        lambda a: [(CONFIG_FILE, CONFIG_FILE, b"[]"), two_files(a["good"])[1]], 400, "must hold a JSON object"
    ),
    "not-lora": Bad(_config(peft_type="IA3"), 400, 'only "LORA" adapters are supported', "peft_type"),
    "fan-in-fan-out": Bad(
        _config(fan_in_fan_out=True), 400, "'fan_in_fan_out' is True; it is for GPT-2", "fan_in_fan_out"
    ),
    "lora-bias": Bad(_config(lora_bias=True), 400, "LoRA bias vectors (lora_bias)", "lora_bias"),
    "unknown-field": Bad(_config(sparse_magic=1), 400, "'sparse_magic' is unknown to loraplex", "sparse_magic"),
    "base-changing-init": Bad(_config(init_lora_weights="pissa"), 400, "'init_lora_weights' is", "init_lora_weights"),
    "embedding-target": Bad(
        _config(target_modules=["q_proj", "v_proj", "embed_tokens"]), 400, "LoRA on embeddings", "target_modules"
    ),
    "rank-pattern-over-limit": Bad(
        _config(rank_pattern={"q_proj": 16}), 400, f"has rank 16 (from {CONFIG_FILE}); this server accepts ranks up to"
    ),
    "targeted-module-without-tensors": Bad(
        _config(target_modules=["q_proj", "v_proj", "k_proj"]), 400, f"but {WEIGHTS_FILE} has no tensor for it"
    ),
    # more of the engine's validator: the safetensors structure
    "too-short": Bad(_weights(b"abc"), 400, "too short for a safetensors file", WEIGHTS_FILE),
    "header-over-cap": Bad(_weights(_declared_header(1 << 30)), 400, "at most 1048576 bytes are accepted"),
    "header-not-json": Bad(_weights(raw_safetensors("not json", b"")), 400, "header is not valid UTF-8 JSON"),
    "metadata-not-strings": Bad(
        _weights(raw_safetensors('{"__metadata__": {"format": 1}}', b"")), 400, "must be an object of string values"
    ),
    "offsets-out-of-bounds": Bad(
        _weights(raw_safetensors(f'{{"a": {_f32x2(0, 8)}}}', bytes(4))), 400, "outside the 4-byte data section", "a"
    ),
    "gap-between-tensors": Bad(
        _weights(raw_safetensors(f'{{"a": {_f32x2(0, 8)}, "b": {_f32x2(12, 20)}}}', bytes(20))),
        400,
        "tensors must tile the data section exactly",
    ),
    "bytes-after-last-tensor": Bad(
        _weights(raw_safetensors(f'{{"a": {_f32x2(0, 8)}}}', bytes(12))), 400, "4 bytes after its last tensor"
    ),
    "shape-times-dtype-not-length": Bad(
        _weights(raw_safetensors('{"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}', bytes(8))),
        400,
        "does not fill its 8 bytes",
        "a",
    ),
    "no-tensors": Bad(_weights(raw_safetensors("{}", b"")), 400, "holds no LoRA tensors"),
    # more of the engine's validator: tensors against the config and the base model
    "not-a-lora-tensor": Bad(_edited(_add_stray), 400, "not a LoRA weight of a decoder-layer projection"),
    "embedding-tensor": Bad(_edited(_add_embedding), 400, "LoRA on embeddings or the output layer"),
    "layer-out-of-range": Bad(_edited(_rename_layer), 400, "for layer 7, but the base model has 2 layers"),
    "missing-partner": Bad(_edited(_drop_b), 400, "but not its partner"),
    "untargeted-module": Bad(_edited(_add_untargeted), 400, "target_modules (with exclude_modules"),
    "wrong-shape-b": Bad(_edited(_narrow_b), 400, "= [out_features, rank]"),
    "integer-dtype": Bad(_edited(_to_int), 400, "is I32; LoRA weights must be F32, F16 or BF16"),
    "infinite": Bad(_edited(_put_inf), 400, "NaN or infinite"),
    "overflows-when-scaled": Bad(_edited(_put_huge), 400, "(scaled by 2) overflows float32"),
    # the multipart body itself
    "too-many-parts": Bad(
        lambda a: [(f"f{i}", None, b"x") for i in range(1001)], 400, "The multipart body has more than 1000 parts"
    ),
    "truncated-multipart": Bad(
        lambda a: two_files(a["good"]), 400, "not valid multipart/form-data", mangle=lambda body: body[:-40]
    ),
    "no-boundary": Bad(lambda a: two_files(a["good"]), 400, "check the boundary", content_type="multipart/form-data"),
    # sizes
    "oversized-body": Bad(_weights(bytes(MAX_UPLOAD + 1)), 413, f"larger than {MAX_UPLOAD} bytes"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_bad_upload_is_refused_and_leaves_nothing(
    api: Client,
    resources: Resources,
    sessions: async_sessionmaker[AsyncSession],
    tenant: Tenant,
    adapters: dict[str, AdapterBytes],
    case: str,
) -> None:
    bad = BAD[case]
    form = {key: value for key, value in {"name": "bad", "base_model": BASE, **bad.form}.items() if value}
    body, headers = multipart(form, bad.parts(adapters))
    if bad.mangle is not None:
        body = bad.mangle(body)
    if bad.content_type is not None:
        headers = {"Content-Type": bad.content_type}
    bucket_before = await resources.objects.list()
    response = await api.post("/v1/adapters", content=body, headers={**tenant.headers, **headers})
    assert response.status_code == bad.status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert bad.message in error["message"], error["message"]
    if bad.param is not None:
        assert error["param"] == bad.param
    await assert_nothing_stored(api, resources, sessions, tenant)
    assert await resources.objects.list() == bucket_before  # nothing written anywhere else in the bucket either


async def test_openapi_documents_the_multipart_upload(api: Client) -> None:
    paths = (await api.get("/schema/openapi.json")).json()["paths"]
    assert "multipart/form-data" in paths["/v1/adapters"]["post"]["requestBody"]["content"]
    assert set(paths["/v1/adapters/{adapter_id}"]) == {"get", "delete"}


async def test_a_body_that_is_not_multipart_is_415(
    api: Client, resources: Resources, sessions: async_sessionmaker[AsyncSession], tenant: Tenant
) -> None:
    response = await api.post("/v1/adapters", json={"name": "x", "base_model": BASE}, headers=tenant.headers)
    assert response.status_code == 415
    error = response.json()["error"]
    assert error["code"] == "unsupported_media_type"
    assert "multipart/form-data" in error["message"]
    await assert_nothing_stored(api, resources, sessions, tenant)
