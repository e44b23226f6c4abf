"""Settings: embedded defaults, LORAPLEX_ environment names, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from loraplex.platform.cli import main
from loraplex.platform.settings import Settings, SettingsError, load_settings, parse_memory_budget

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


class TestDefaults:
    def test_embedded_defaults(self, tmp_path: Path) -> None:
        settings = load_settings(data_dir=tmp_path)
        assert settings.effective_database_url == f"sqlite+aiosqlite:///{(tmp_path / 'loraplex.db').resolve()}"
        assert settings.redis_url is None
        assert settings.s3_bucket is None
        assert settings.objects_dir == tmp_path / "objects"
        assert settings.admin_token is None

    def test_reads_prefixed_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LORAPLEX_DATABASE_URL", "postgresql://u:p@db:5432/lp")
        monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://cache:6379/0")
        monkeypatch.setenv("LORAPLEX_PORT", "9000")
        monkeypatch.setenv("LORAPLEX_ADMIN_TOKEN", "s3cr3t-admin-value")
        settings = load_settings()
        assert settings.effective_database_url == "postgresql+asyncpg://u:p@db:5432/lp"
        assert settings.redis_url == "redis://cache:6379/0"
        assert settings.port == 9000
        assert settings.admin_token is not None and settings.admin_token.get_secret_value() == "s3cr3t-admin-value"
        assert "s3cr3t-admin-value" not in repr(settings)


class TestErrorsNameTheSetting:
    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("LORAPLEX_DATABASE_URL", "mysql://x/y"),
            ("LORAPLEX_DATABASE_URL", "sqlite://relative.db"),
            ("LORAPLEX_REDIS_URL", "http://localhost"),
            ("LORAPLEX_PORT", "eighty"),
            ("LORAPLEX_PORT", "70000"),
            ("LORAPLEX_S3_ENDPOINT_URL", "localhost:9000"),
            ("LORAPLEX_ENGINE_KV_BUDGET", "lots"),
            ("LORAPLEX_ENGINE_KV_BUDGET", "1.5"),
            ("LORAPLEX_ENGINE_DTYPE", "float8"),
            ("LORAPLEX_ENGINE_MODE", "cluster"),
            ("LORAPLEX_KEY_CACHE_TTL_S", "-1"),
        ],
    )
    def test_bad_value(self, monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        with pytest.raises(SettingsError, match=name):
            load_settings()

    def test_endpoint_needs_bucket(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LORAPLEX_S3_ENDPOINT_URL", "http://minio:9000")
        with pytest.raises(SettingsError, match="LORAPLEX_S3_BUCKET"):
            load_settings()

    def test_half_credentials(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LORAPLEX_S3_ACCESS_KEY_ID", "id")
        with pytest.raises(SettingsError, match="LORAPLEX_S3_SECRET_ACCESS_KEY"):
            load_settings()

    def test_cli_fails_at_start_with_the_name(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("LORAPLEX_DATABASE_URL", "mysql://x/y")
        result = CliRunner().invoke(main, ["platform", "serve"])
        assert result.exit_code != 0
        assert "LORAPLEX_DATABASE_URL" in result.output


class TestMemoryBudget:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("0.5", 0.5),
            ("1", 1.0),
            ("2GiB", 2 * 2**30),
            ("512MiB", 512 * 2**20),
            ("1000000", 1_000_000),
            ("3 GB", 3e9),
        ],
    )
    def test_parses(self, text: str, expected: float) -> None:
        assert parse_memory_budget(text) == expected

    @pytest.mark.parametrize("text", ["0", "-1", "1.5", "GiB", "2XB", "", "abc"])
    def test_refuses(self, text: str) -> None:
        with pytest.raises(ValueError, match=r"fraction|size"):
            parse_memory_budget(text)


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.port = 1  # type: ignore[misc]
