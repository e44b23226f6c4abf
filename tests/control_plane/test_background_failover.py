"""A background response outlives the replica running it (issue 36: background on a durable queue, decision 0049):
three platform replicas on one Postgres, Redis and bucket, in fleet mode over one `loraplex engine serve` process.
The replica the client talks to runs no jobs (`LORAPLEX_JOBS_CONCURRENCY=0`); a second one, its own process, claims
the response and is killed (SIGKILL) while it generates; a third, started after, takes the job up once its lease
runs out and finishes it. The client sees one response, in_progress and then completed, equal to the same request
answered at once, billed once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _support.services import PostgresServer, RedisServer, S3Server
from _support.waiting import wait_for

from loraplex.platform.db.engine import create_engine, create_session_factory
from loraplex.platform.jobs.repository import JobRepository
from loraplex.platform.settings import Settings

from .conftest import module_settings_sync
from .fleet_setup import (
    ENGINE_KEY,
    Platform,
    ServerProcess,
    engine_process,
    keyed_tenant,
    platform_app,
    platform_process,
)

pytestmark = pytest.mark.integration

BASE = "failover-base"
LEASE_S = 2.0
# A grammar that needs 1500 characters: the random model cannot end early, so the run lasts long enough to be killed.
LONG = {
    "type": "object",
    "properties": {"t": {"type": "string", "minLength": 1500}},
    "required": ["t"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_server: PostgresServer,
    redis_server: RedisServer,
    s3_server: S3Server,
    session_tag: str,
) -> Iterator[Settings]:
    with module_settings_sync(
        tmp_path_factory.mktemp("data"),
        postgres_server,
        redis_server,
        s3_server,
        session_tag,
        engine_mode="fleet",
        engine_api_key=ENGINE_KEY,
        jobs_lease_s=LEASE_S,
        jobs_poll_interval_s=0.2,
        jobs_concurrency=0,  # the replica in this process only takes requests
    ) as value:
        yield value


@pytest.fixture(scope="module")
def engine(
    settings: Settings, tiny_base_checkpoint: Path, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with engine_process(
        settings, tiny_base_checkpoint, s3_server, tmp_path_factory.mktemp("engine"), engine_id="e1", base_model=BASE
    ) as running:
        yield running


@pytest.fixture(scope="module")
def platform(settings: Settings, tiny_base_checkpoint: Path, engine: ServerProcess) -> Iterator[Platform]:
    with platform_app(settings, tiny_base_checkpoint, BASE) as value:
        yield value


def _job(settings: Settings, job_id: str) -> dict[str, Any] | None:
    """The job's row, as the database holds it now."""

    async def read() -> dict[str, Any] | None:
        engine = create_engine(settings.effective_database_url)
        try:
            async with create_session_factory(engine)() as session:
                job = await JobRepository(session).get(job_id)
                return None if job is None else {key: getattr(job, key) for key in ("status", "attempts", "claimed_by")}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_a_background_response_whose_replica_dies_is_finished_by_another(
    settings: Settings, platform: Platform, tmp_path: Path
) -> None:
    _, key = keyed_tenant(platform, "failover")
    sdk = openai.OpenAI(base_url=f"{platform.url}/v1", api_key=key, max_retries=0, timeout=120)
    ask: dict[str, Any] = {
        "model": BASE,
        "input": "Write the lighthouse keeper's log for the whole winter.",
        "temperature": 0,
        "max_output_tokens": 700,
        "text": {"format": {"type": "json_schema", "name": "log", "schema": LONG, "strict": True}},
    }
    with platform_process(settings, tmp_path, "doomed", jobs_concurrency=4) as doomed:
        started = sdk.responses.create(**ask, background=True)
        assert started.status == "queued"
        claimed = wait_for(
            lambda: job if (job := _job(settings, started.id)) and job["status"] == "running" else None,
            what="the second replica to claim the response",
        )
        wait_for(lambda: sdk.responses.retrieve(started.id).status == "in_progress", what="it to run")
        doomed.kill()
    assert claimed["attempts"] == 1 and sdk.responses.retrieve(started.id).status == "in_progress"
    with platform_process(settings, tmp_path, "heir", jobs_concurrency=4):
        deadline = time.monotonic() + 120
        while (done := sdk.responses.retrieve(started.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the third replica did not finish the response"
            time.sleep(0.2)
    job = _job(settings, started.id)
    assert job is not None and job["status"] == "succeeded" and job["attempts"] == 2
    assert job["claimed_by"] != claimed["claimed_by"]
    at_once = sdk.responses.create(**ask)
    assert done.status == at_once.status and done.output_text == at_once.output_text and done.output_text
    assert done.usage is not None and at_once.usage is not None
    assert done.usage.output_tokens == at_once.usage.output_tokens
    # Billed once: one usage row under the response's id, for the run that finished.
    rows = wait_for(
        lambda: [row for row in _usage(platform, key) if row["request_id"] == started.id] or None,
        what="its usage row",
    )
    assert len(rows) == 1 and rows[0]["completion_tokens"] == done.usage.output_tokens


def _usage(platform: Platform, key: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{platform.url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, params={"limit": 100}, timeout=30
    )
    assert response.status_code == 200, response.text
    return list(response.json()["data"])
