"""Settings for the control plane and the embedded engine, read from `LORAPLEX_*` environment variables.

Nothing here reads the environment at import time: `load_settings()` does, once, at start. Every default is the
embedded mode (`make dev`): SQLite under the data dir, in-process substitutes for Redis, a local folder as the
object store. Setting a URL switches that dependency to the shared service that replicas use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loraplex.engine import SpeculativeConfig, parse_memory_budget
from loraplex.platform.service_tiers import ServiceTier, canonical_tiers

ENV_PREFIX = "LORAPLEX_"
# What compose.yaml's placeholder secrets start with: `platform serve` refuses them outside the dev profile.
PLACEHOLDER_PREFIX = "change-me"

_ASYNC_DRIVERS = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
}


class SettingsError(ValueError):
    """A setting has a bad value; the message names the environment variable."""


class Settings(BaseSettings):
    """Every knob of a loraplex process. Field `x` is read from `LORAPLEX_X`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    data_dir: Path = Field(
        default=Path(".loraplex"),
        description="Folder for the embedded defaults: SQLite file, local object store, generated secrets.",
    )
    host: str = Field(default="127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port the HTTP server binds.")
    public_url: str | None = Field(
        default=None, description="URL clients use to reach this platform; printed by `loraplex dev`."
    )

    database_url: str | None = Field(
        default=None,
        description="postgresql://... or sqlite:///...; default: SQLite file `loraplex.db` in the data dir.",
    )
    database_pool_size: int = Field(default=10, ge=1, le=200, description="Connections per process (Postgres).")
    database_statement_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="Longest one database statement may run while serving (SQLite: wait for a lock); past it the "
        "request answers 503 with Retry-After. Migrations are not bounded.",
    )
    database_pool_timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        description="Longest a request waits for a database connection (a free one from the pool, or a new one's "
        "connect) before it answers 503 with Retry-After.",
    )

    redis_url: str | None = Field(
        default=None, description="redis://...; default: in-process substitutes (one process only)."
    )
    redis_prefix: str = Field(default="loraplex:", description="Prefix of every Redis key this deployment writes.")
    redis_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Longest one Redis command or connect may take; past it the caller goes on without Redis "
        "(the key cache reads the database, rate limits follow LORAPLEX_RATELIMIT_FAILURE_POLICY).",
    )

    s3_bucket: str | None = Field(
        default=None, description="Bucket for adapter artifacts; default: a local folder under the data dir."
    )
    s3_endpoint_url: str | None = Field(
        default=None, description="S3 endpoint (MinIO, SeaweedFS); default: AWS's endpoint for the region."
    )
    s3_region: str = Field(default="us-east-1", description="S3 region.")
    s3_access_key_id: str | None = Field(default=None, description="S3 access key; default: boto3's chain.")
    s3_secret_access_key: SecretStr | None = Field(default=None, description="S3 secret key.")
    s3_multipart_threshold: int = Field(
        default=64 * 1024 * 1024,
        ge=5 * 1024 * 1024,
        description="Objects at least this large are uploaded in parts (bytes, >= 5 MiB as S3 requires).",
    )
    s3_multipart_part_size: int = Field(
        default=16 * 1024 * 1024, ge=5 * 1024 * 1024, description="Part size for multipart uploads (bytes)."
    )

    max_adapter_upload_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1024,
        description="Largest adapter upload request body (bytes); also caps what an uploaded archive unpacks to.",
    )
    max_lora_rank: int = Field(
        default=128, ge=1, le=4096, description="Highest LoRA rank an uploaded adapter may have in any module."
    )

    profile: Literal["production", "dev"] = Field(
        default="production",
        description="dev: `platform serve` accepts the placeholder secrets of compose.yaml (change-me-...), for a "
        "throwaway deployment; production refuses to start with them.",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bootstrap admin bearer token; `loraplex dev` generates one when unset.",
    )
    secret_key: SecretStr | None = Field(
        default=None,
        description="Key for hashing API keys (HMAC-SHA256); replicas must share it. "
        "Default: generated once into the data dir.",
    )
    key_cache_ttl_s: float = Field(
        default=300.0, gt=0, le=86400, description="How long an API key lookup stays cached in Redis."
    )

    console_session_ttl_s: float = Field(
        default=8 * 3600.0,
        ge=60,
        le=30 * 86400,
        description="How long a console sign-in lasts (seconds) before the browser must sign in again.",
    )
    console_sign_in_attempts_per_minute: int = Field(
        default=10,
        ge=1,
        le=10_000,
        description="Console sign-in attempts one client address may make per minute; more answer 429.",
    )

    default_requests_per_minute: int = Field(
        default=600, ge=1, description="Requests per minute of a tenant whose own limit an admin has not set."
    )
    default_tokens_per_minute: int = Field(
        default=1_000_000,
        ge=1,
        description="Tokens per minute (prompt + max_tokens, estimated at admission) of a tenant without its own "
        "limit.",
    )
    default_max_concurrent_requests: int = Field(
        default=64,
        ge=1,
        le=1_000_000,
        description="Requests a tenant without its own cap may have in flight at once, across all replicas.",
    )
    default_service_tiers: list[ServiceTier] = Field(
        default=[ServiceTier.FLEX, ServiceTier.DEFAULT],
        description="Service tiers a tenant may ask for when an admin has not set its own list: a JSON list of "
        "flex, default, priority that includes default. flex only lowers the tenant's own urgency, so it is safe by "
        "default; priority is for an admin to grant per tenant.",
    )
    concurrency_lease_ttl_s: float = Field(
        default=30.0,
        ge=1,
        le=3600,
        description="How long a request's concurrency lease lives unless renewed (its holder renews it every third "
        "of this while the request runs): the longest a crashed replica's requests keep counting against their "
        "tenants' caps.",
    )
    ratelimit_failure_policy: Literal["open", "closed"] = Field(
        default="open",
        description="When Redis does not answer the rate limiter or the concurrency caps: open admits the request "
        "(and logs it), closed refuses it with 503.",
    )
    usage_drain_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="How often usage that could not be written to the database is moved from the outbox into it.",
    )
    jobs_lease_s: float = Field(
        default=30.0,
        ge=1,
        le=3600,
        description="How long a replica holds a job (a background response) between renewals of its lease; a job "
        "whose replica stopped is taken up by another this long after its last renewal.",
    )
    jobs_concurrency: int = Field(
        default=16,
        ge=0,
        le=1024,
        description="How many jobs (background responses) one replica runs at once; 0: this replica runs none "
        "(it still takes them: the others run them).",
    )
    jobs_poll_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="How often an idle replica looks for jobs queued by another (the one that queues a job looks "
        "at once).",
    )
    responses_retention_days: float = Field(
        default=30.0,
        gt=0,
        le=3650,
        description="How long a stored response of the Responses API (store: true, the default) can be retrieved "
        "and continued (previous_response_id); older ones are deleted.",
    )

    engine_mode: Literal["embedded", "fleet", "off"] = Field(
        default="embedded",
        description="embedded: an in-process engine; fleet: remote engine replicas registered in Redis; "
        "off: no engine (admin and key APIs only).",
    )
    engine_model: str | None = Field(
        default=None, description="Base model folder for the embedded engine; default: the demo model."
    )
    engine_api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token the platform sends to fleet engines: the one they were started with "
        "(`loraplex engine serve --api-key`, or this same variable in the engine's environment).",
    )
    engine_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="Weight and activation dtype of the embedded engine."
    )
    engine_quantization: Literal["none", "int8", "int4", "fp8"] | None = Field(
        default=None,
        description="Weight-only quantization of the embedded engine's base model, done at load: int8, int4 or fp8; "
        "none forces full weights. Unset: what the base model was registered with (none at first start).",
    )
    engine_speculative_config: str | None = Field(
        default=None,
        description="Speculative decoding of the embedded engine, in vLLM's --speculative-config JSON shape "
        '(`{"method": "ngram", "num_speculative_tokens": 4}`); none turns it off. Unset: what the base model is '
        "registered with (off at first start).",
    )
    engine_max_model_len: int | None = Field(
        default=None, ge=16, description="Context length cap; default: the model's."
    )
    engine_kv_budget: str = Field(
        default="0.5",
        description="Page pool size: bytes (`2GiB`, `512MiB`, an integer) or a fraction of free memory (`0.5`).",
    )

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return normalize_database_url(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if urlsplit(value).scheme not in ("redis", "rediss", "unix"):
            raise ValueError("must be a redis://, rediss:// or unix:// URL")
        return value

    @field_validator("s3_endpoint_url", "public_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

    @field_validator("engine_kv_budget")
    @classmethod
    def _kv_budget(cls, value: str) -> str:
        parse_memory_budget(value)
        return value

    @field_validator("engine_speculative_config")
    @classmethod
    def _speculative_config(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.strip().lower() == "none":
            return "none"
        SpeculativeConfig.parse(value)  # its errors name the field at fault
        return value

    @field_validator("default_service_tiers")
    @classmethod
    def _service_tiers(cls, value: list[ServiceTier]) -> list[ServiceTier]:
        return canonical_tiers(value)

    @field_validator("redis_prefix")
    @classmethod
    def _redis_prefix(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError("must be a non-empty string without spaces")
        return value

    @model_validator(mode="after")
    def _s3_complete(self) -> Settings:
        if self.s3_endpoint_url is not None and self.s3_bucket is None:
            raise ValueError("LORAPLEX_S3_BUCKET is required when LORAPLEX_S3_ENDPOINT_URL is set")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both LORAPLEX_S3_ACCESS_KEY_ID and LORAPLEX_S3_SECRET_ACCESS_KEY, or neither")
        if self.s3_multipart_part_size > self.s3_multipart_threshold:
            raise ValueError("LORAPLEX_S3_MULTIPART_PART_SIZE must not exceed LORAPLEX_S3_MULTIPART_THRESHOLD")
        return self

    @property
    def effective_database_url(self) -> str:
        """The database URL with an async driver; the SQLite file under the data dir when none is set."""
        if self.database_url is not None:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'loraplex.db').resolve()}"

    @property
    def objects_dir(self) -> Path:
        """Root of the local object store (used when no S3 bucket is set)."""
        return self.data_dir / "objects"


def placeholder_secrets(settings: Settings) -> list[str]:
    """The variables holding a placeholder secret (compose.yaml's `change-me-...` defaults)."""
    values = {
        "admin_token": settings.admin_token,
        "secret_key": settings.secret_key,
        "engine_api_key": settings.engine_api_key,
    }
    return [
        ENV_PREFIX + name.upper()
        for name, value in values.items()
        if value is not None and value.get_secret_value().strip().lower().startswith(PLACEHOLDER_PREFIX)
    ]


def normalize_database_url(value: str) -> str:
    """Return `value` with the async driver SQLAlchemy needs; raise ValueError for anything else."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in _ASYNC_DRIVERS:
        raise ValueError("must be a postgresql:// or sqlite:/// URL")
    if _ASYNC_DRIVERS[scheme].startswith("sqlite") and not rest.startswith("/"):
        raise ValueError("a SQLite URL needs three slashes and a file path: sqlite:///path/to/file.db")
    return f"{_ASYNC_DRIVERS[scheme]}://{rest}"


def load_settings(**overrides: Any) -> Settings:
    """Read settings from the environment (and `overrides`), turning validation errors into SettingsError."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            loc = [str(part) for part in error["loc"]]
            name = f"{ENV_PREFIX}{loc[0].upper()}" if loc else "settings"
            message = error["msg"].removeprefix("Value error, ")
            problems.append(message if message.startswith(ENV_PREFIX) else f"{name}: {message}")
        raise SettingsError("invalid settings: " + "; ".join(problems)) from None
