"""Base model logic: registration (the checkpoint's config.json must be readable and supported, and so must a
speculative config's draft model), the speculative and reasoning settings, and the model configs adapter validation
needs. Stateless apart from a config cache; never commits."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anyio.to_thread
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.engine import CheckpointError, ModelConfig, ReasoningConfig, SpeculativeConfig
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.base_models.repository import BaseModelRepository
from loraplex.platform.errors import ApiError, conflict, invalid_request
from loraplex.platform.settings import Settings


class ModelConfigs:
    """The engine ModelConfig of each base model, read once from its source (a folder or s3://)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._cache: dict[str, ModelConfig] = {}

    async def of(self, source: str) -> ModelConfig:
        cached = self._cache.get(source)
        if cached is None:
            cached = await anyio.to_thread.run_sync(self._read, source)
            self._cache[source] = cached
        return cached

    def _read(self, source: str) -> ModelConfig:
        if not source.startswith("s3://"):
            return ModelConfig.from_dir(Path(source))
        import boto3

        bucket, _, prefix = source.removeprefix("s3://").partition("/")
        key = f"{prefix.rstrip('/')}/config.json" if prefix else "config.json"
        secret = self._settings.s3_secret_access_key
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self._settings.s3_endpoint_url,
            region_name=self._settings.s3_region,
            aws_access_key_id=self._settings.s3_access_key_id,
            aws_secret_access_key=secret.get_secret_value() if secret else None,
        )
        try:
            raw = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            return ModelConfig.from_dict(json.loads(raw))
        except CheckpointError:
            raise
        except Exception as exc:  # botocore and json raise many types; the message is what the admin needs
            raise CheckpointError(f"could not read {source}/config.json: {exc}") from None


class BaseModelService:
    def __init__(self, session: AsyncSession, configs: ModelConfigs) -> None:
        self._session = session
        self._models = BaseModelRepository(session)
        self._configs = configs

    async def create(
        self,
        name: str,
        source: str,
        quantization: str | None,
        speculative_config: SpeculativeConfig | None = None,
        reasoning_config: ReasoningConfig | None = None,
    ) -> BaseModel:
        if await self._models.get_by_name(name) is not None:
            raise conflict(f"A base model named '{name}' already exists.", param="name")
        try:
            config = await self._configs.of(source)
        except CheckpointError as exc:
            raise invalid_request(f"The base model at {source} cannot be served: {exc}", param="source") from None
        if config.prequantized is not None and quantization is not None:
            raise invalid_request(
                f"The base model at {source} is already quantized ({config.prequantized.method.upper()}, 4-bit) and is "
                f"served as it is: register it without quantization, not '{quantization}'.",
                param="quantization",
            )
        await self._check_draft(speculative_config, config)
        row = BaseModel(name=name, source=source, quantization=quantization)
        row.set_speculative(speculative_config)
        row.set_reasoning(reasoning_config)
        try:
            async with self._session.begin_nested():
                return await self._models.add(row)
        except IntegrityError:
            raise conflict(f"A base model named '{name}' already exists.", param="name") from None

    async def set_speculative_config(self, name: str, speculative_config: SpeculativeConfig | None) -> BaseModel:
        """Set (None: clear) how engines serving the base model `name` speculate. Engines take it when they start:
        the embedded one at the platform's next start, fleet engines from their own --speculative-config."""
        row = await self.named(name)
        if speculative_config is not None and speculative_config.model is not None:
            try:
                target = await self._configs.of(row.source)
            except CheckpointError as exc:
                raise invalid_request(
                    f"speculative_config: the base model at {row.source} cannot be read to check the draft model "
                    f"against it: {exc}",
                    param="speculative_config",
                ) from None
            await self._check_draft(speculative_config, target)
        row.set_speculative(speculative_config)
        await self._session.flush()
        return row

    async def set_reasoning_config(self, name: str, reasoning_config: ReasoningConfig | None) -> BaseModel:
        """Set (None: clear) how the base model `name` reasons. Its budgets apply at once: the platform sends each chat
        request's thinking_token_budget from them. Its parser is taken when engines start: the embedded one at the
        platform's next start, fleet engines from their own --reasoning-parser."""
        row = await self.named(name)
        row.set_reasoning(reasoning_config)
        await self._session.flush()
        return row

    async def _check_draft(self, speculative_config: SpeculativeConfig | None, target: ModelConfig) -> None:
        """A draft model must be a checkpoint the engine reads (its config.json, as a base model's source is
        checked) with the target's vocabulary, since it proposes the target's token ids. That the tokenizer files
        agree too is checked by the engine when it loads the draft."""
        if speculative_config is None or speculative_config.model is None:
            return
        draft = speculative_config.model
        try:
            config = await self._configs.of(str(draft))
        except CheckpointError as exc:
            raise invalid_request(
                f"speculative_config: the draft model at {draft} cannot be served: {exc}", param="speculative_config"
            ) from None
        if config.vocab_size != target.vocab_size:
            raise invalid_request(
                f"speculative_config: the draft model at {draft} has a vocabulary of {config.vocab_size} tokens, the "
                f"base model one of {target.vocab_size}: a draft must share the base model's tokenizer.",
                param="speculative_config",
            )

    async def list(self) -> list[BaseModel]:
        return await self._models.list()

    async def by_name(self, name: str) -> BaseModel | None:
        return await self._models.get_by_name(name)

    async def named(self, name: str) -> BaseModel:
        found = await self._models.get_by_name(name)
        if found is None:
            raise ApiError(404, f"No base model named '{name}'.", code="not_found")
        return found

    async def get(self, base_model_id: uuid.UUID) -> BaseModel:
        found = await self._models.get(base_model_id)
        if found is None:
            raise ApiError(404, f"No base model with id '{base_model_id}'.", code="not_found")
        return found

    async def config(self, base_model: BaseModel) -> ModelConfig:
        return await self._configs.of(base_model.source)
