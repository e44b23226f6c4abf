"""Base model shapes at the edge: `{name, source, quantization, speculative_config, status}`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel as Schema
from pydantic import Field, PlainValidator, StringConstraints, field_validator, model_validator

from loraplex.engine import SpeculativeConfig
from loraplex.platform.domain.base_models.models import BaseModel, Quantization
from loraplex.platform.schemas import Name, Printable, RequestBody, from_json_string

ModelName = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"),
]
# The longest speculative config text taken (a form field or a JSON string): far above any real one.
MAX_SPECULATIVE_CONFIG_CHARS = 4096


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


class SpeculativeConfigOut(Schema):
    """A base model's speculative config as engines take it, every field given (defaults filled in)."""

    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(description="The most tokens a request proposes in a step.")
    prompt_lookup_max: int = Field(description="ngram: the longest suffix looked up in the request's tokens.")
    prompt_lookup_min: int = Field(description="ngram: the shortest suffix looked up.")
    model: str | None = Field(description="draft_model: the draft checkpoint's folder.")


class BaseModelOut(Schema):
    name: str
    source: str
    quantization: Quantization | None
    speculative_config: SpeculativeConfigOut | None = Field(
        description="How engines serving this base model speculate; null: they do not."
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
            status=row.status,
            created_at=row.created_at,
        )


class BaseModelCreate(RequestBody):
    name: ModelName
    source: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=1024), Printable]
    quantization: Annotated[Quantization, from_json_string(Quantization)] | None = None
    speculative_config: SpeculativeConfigIn | None = Field(default=None, description=SPECULATIVE_CONFIG_DESCRIPTION)

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if "://" in value and not value.startswith("s3://"):
            raise ValueError("must be a local folder or an s3:// URI")
        return value


class BaseModelPatch(RequestBody):
    """What to change; an absent field stays as it is. `speculative_config: null` turns speculation off."""

    speculative_config: SpeculativeConfigIn | None = Field(default=None, description=SPECULATIVE_CONFIG_DESCRIPTION)

    @model_validator(mode="after")
    def _something(self) -> BaseModelPatch:
        if "speculative_config" not in self.model_fields_set:
            raise ValueError("give speculative_config (null turns speculation off)")
        return self


__all__ = ["BaseModelCreate", "BaseModelOut", "BaseModelPatch", "ModelName", "Name", "SpeculativeConfigOut"]
