"""The platform on a checkpoint of the test's own, as the family and protocol suites run it: module fixtures for
settings (real Postgres, Redis and S3; the embedded engine on that checkpoint, float32, 512 tokens of context) and
the platform on a real socket. A module names the fixture that gives its checkpoint's folder:

    settings, platform = embedded_fixtures("qwen3")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _support.services import PostgresServer, RedisServer, S3Server

from loraplex.engine.model.tokenizer import Tokenizer
from loraplex.platform.app import create_app
from loraplex.platform.resources import Resources
from loraplex.platform.settings import Settings

from .conftest import module_settings_sync
from .test_completions import Platform, _serving


def embedded_fixtures(
    model_fixture: str, platform_name: str = "platform"
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The `settings` fixture and the platform's (named `platform_name`: a module that wraps it names it apart)."""

    @pytest.fixture(scope="module")
    def settings(
        request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory,
        postgres_server: PostgresServer,
        redis_server: RedisServer,
        s3_server: S3Server,
        session_tag: str,
    ) -> Iterator[Settings]:
        model: Path = request.getfixturevalue(model_fixture)
        with module_settings_sync(
            tmp_path_factory.mktemp("data"),
            postgres_server,
            redis_server,
            s3_server,
            session_tag,
            engine_mode="embedded",
            engine_model=str(model),
            engine_dtype="float32",
            engine_max_model_len=512,
            engine_kv_budget="8MiB",
        ) as value:
            yield value

    @pytest.fixture(scope="module", name=platform_name)
    def platform(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Platform]:
        model: Path = request.getfixturevalue(model_fixture)
        app = create_app(settings)
        with _serving(app) as url:
            resources: Resources = app.state.resources
            assert resources.embedded_engine is not None
            yield Platform(url, app, resources.embedded_engine.core.served_model_name, Tokenizer.from_dir(model))

    return settings, platform
