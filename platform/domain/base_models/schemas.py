"""Base model shapes at the edge: `{name, source, quantization, speculative_config, reasoning_config, status}`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel as Schema
from pydantic import Field, PlainValidator, StringConstraints, field_validator, model_validator

from loraplex.engine import ReasoningConfig, SpeculativeConfig
from loraplex.platform.domain.base_models.models import BaseModel, Quantization
from loraplex.platform.schemas import Name, Printable, RequestBody, from_json_string

ModelName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"),
]
# The longest speculative or reasoning config text taken (a form field or a JSON string): far above any real one.
MAX_SPECULATIVE_CONFIG_CHARS = 4096
MAX_REASONING_CONFIG_CHARS = 4096


def _speculative_config(value: Any) -> SpeculativeConfig:
    """vLLM's `--speculative-config`: the JSON object, or its text (as the CLI and the console's form give it), read
    by the engine's own parser, whose errors name the field at fault."""
    if isinstance(value, str) and len(value) > MAX_SPECULATIVE_CONFIG_CHARS:
        raise ValueError(f"must be at most {MAX_SPECULATIVE_CONFIG_CHARS} characters of JSON")
    if not isinstance(value, str | dict):
        raise ValueError("must be a JSON object (or its text) in vLLM's --speculative-config shape")
    config = SpeculativeConfig.parse(value)
    model = (json.loads(value) if isinstance(value, str) else value).get("model")
    if isinstance(model, str) and "://" in model:
        raise ValueError("model must be the draft checkpoint's local folder (the engine reads it from disk), not a URI")
    return config


SpeculativeConfigIn = Annotated[
    SpeculativeConfig, PlainValidator(_speculative_config, json_schema_input_type=dict[str, Any] | str)
]
SPECULATIVE_CONFIG_DESCRIPTION = (
    'Speculative decoding, in vLLM\'s --speculative-config shape: {"method": "ngram", "num_speculative_tokens": 4, '
    '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model": "/models/draft", '
    '"num_speculative_tokens": 4}, as the object or its JSON text; null: no speculation.'
)


def _reasoning_config(value: Any) -> ReasoningConfig:
    """A reasoning model's settings: the JSON object (ReasoningConfig.to_dict's shape; only `parser` is required) or
    its text, read by the engine's own parser, whose errors name the field at fault."""
    if isinstance(value, str) and len(value) > MAX_REASONING_CONFIG_CHARS:
        raise ValueError(f"must be at most {MAX_REASONING_CONFIG_CHARS} characters of JSON")
    if not isinstance(value, str | dict):
        raise ValueError('must be a JSON object (or its text) such as {"parser": "qwen3", "budgets": {"low": 64}}')
    try:
        return ReasoningConfig.from_dict(value)
    except TypeError as exc:  # a value of a type the parser does not expect where it does not check the type
        raise ValueError(str(exc)) from None


ReasoningConfigIn = Annotated[
    ReasoningConfig, PlainValidator(_reasoning_config, json_schema_input_type=dict[str, Any] | str)
]
REASONING_CONFIG_DESCRIPTION = (
    'A reasoning model\'s settings: {"parser": "qwen3" | "deepseek_r1", "budgets": {"none": 0, "minimal": 16, "low": '
    '64, "medium": 256, "high": 1024}, "default_effort": "medium", "closing_text": "..."}, as the object or its JSON '
    "text (only parser is required; tiers left out keep these budgets). Each reasoning_effort tier's budget is the "
    "most tokens a request may think before the engine closes its think block. null: not a reasoning model."
)


class SpeculativeConfigOut(Schema):
    """A base model's speculative config as engines take it, every field given (defaults filled in)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(description="The most tokens a request proposes in a step.")
    prompt_lookup_max: int = Field(description="ngram: the longest suffix looked up in the request's tokens.")
    prompt_lookup_min: int = Field(description="ngram: the shortest suffix looked up.")
    model: str | None = Field(description="draft_model: the draft checkpoint's folder.")


class ReasoningConfigOut(Schema):
    """A base model's reasoning settings as engines take them, every field given (defaults filled in)."""

    parser: str = Field(description="How the think block is read (vLLM's --reasoning-parser): qwen3 or deepseek_r1.")
    budgets: dict[str, int] = Field(description="The thinking-token budget of each reasoning_effort tier.")
    default_effort: str = Field(description="The tier of a request that names none.")
    closing_text: str = Field(description="What the engine writes before closing a think block out of budget.")


class BaseModelOut(Schema):
    name: str
    source: str
    quantization: Quantization | None
    speculative_config: SpeculativeConfigOut | None = Field(
        description="How engines serving this base model speculate; null: they do not."
    )
    reasoning_config: ReasoningConfigOut | None = Field(
        description="How engines serving this base model read and bound its think block; null: not a reasoning model."
    )
    status: str
    created_at: datetime

    @classmethod
    def of(cls, row: BaseModel) -> BaseModelOut:
        return cls(
            name=row.name,
            source=row.source,
            quantization=Quantization(row.quantization) if row.quantization else None,
            # The stored object has this shape (speculative_config_json); read as it is, so a listing never fails.
            speculative_config=(
                None if row.speculative_config is None else SpeculativeConfigOut.model_validate(row.speculative_config)
            ),
            # Stored by set_reasoning (ReasoningConfig.to_dict): read as it is, for the same reason.
            reasoning_config=(
                None if row.reasoning_config is None else ReasoningConfigOut.model_validate(row.reasoning_config)
            ),
            status=row.status,
            created_at=row.created_at,
        )


class BaseModelCreate(RequestBody):
    name: ModelName
    source: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=1024), Printable]
    quantization: Annotated[Quantization, from_json_string(Quantization)] | None = None
    speculative_config: SpeculativeConfigIn | None = Field(default=None, description=SPECULATIVE_CONFIG_DESCRIPTION)
    reasoning_config: ReasoningConfigIn | None = Field(default=None, description=REASONING_CONFIG_DESCRIPTION)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if "://" in value and not value.startswith("s3://"):
            raise ValueError("must be a local folder or an s3:// URI")
        return value


class BaseModelPatch(RequestBody):
    """What to change; an absent field stays as it is. `speculative_config: null` turns speculation off,
    `reasoning_config: null` makes it no reasoning model."""

    speculative_config: SpeculativeConfigIn | None = Field(default=None, description=SPECULATIVE_CONFIG_DESCRIPTION)
    reasoning_config: ReasoningConfigIn | None = Field(default=None, description=REASONING_CONFIG_DESCRIPTION)

    @model_validator(mode="after")
    def _something(self) -> BaseModelPatch:
        if not self.model_fields_set & {"speculative_config", "reasoning_config"}:
            raise ValueError("give speculative_config or reasoning_config (null turns it off)")
        return self


__all__ = [
    "BaseModelCreate",
    "BaseModelOut",
    "BaseModelPatch",
    "ModelName",
    "Name",
    "ReasoningConfigOut",
    "SpeculativeConfigOut",
]
