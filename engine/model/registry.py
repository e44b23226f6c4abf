"""config.json's `architectures` -> the family that reads the rest: the one place an architecture is accepted or
refused.

A family module (engine/model/llama.py, qwen3.py, gemma.py, phi3.py, moe_families.py) exports a `Family`: the
transformers class names
it serves with their labels, and `read`, which turns its config.json fields into ModelConfig's variation fields
(norms, activations, sliding windows, RoPE where it differs from the common reading). Classes of the bare decoder
(transformers' `*Model`, which is what sentence-transformers saves) are served headless: no lm_head, tensor names
without the "model." prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.config_fields import ConfigFields

# (the family's fields, the common fields read so far) -> ModelConfig fields to set or override
FamilyReader = Callable[[ConfigFields, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    architectures: dict[str, str]  # transformers class of the causal LM -> ModelConfig.architecture label
    read: FamilyReader
    headless: dict[str, str] = field(default_factory=dict)  # bare-decoder classes -> label
    # Classes of this family's checkpoints that loraplex refuses, with why (a vision tower, say).
    refused: dict[str, str] = field(default_factory=dict)


def families() -> tuple[Family, ...]:
    from loraplex.engine.model import gemma, llama, moe_families, phi3, qwen3

    dense = (llama.FAMILY, qwen3.FAMILY, gemma.FAMILY, phi3.FAMILY)
    return (*dense, moe_families.MIXTRAL, moe_families.QWEN2_MOE, moe_families.QWEN3_MOE)


def supported_architectures() -> list[str]:
    return [name for family in families() for name in (*family.architectures, *family.headless)]


def resolve(raw: dict[str, Any]) -> tuple[Family, str, bool]:
    """(family, label, headless) for config.json's `architectures`; a CheckpointError naming them otherwise."""
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise CheckpointError("config.json field 'architectures' must be a list of class names")
    for name in architectures:
        for family in families():
            if name in family.refused:
                raise CheckpointError(f"config.json field 'architectures' is {name}: {family.refused[name]}")
            if name in family.architectures:
                return family, family.architectures[name], False
            if name in family.headless:
                return family, family.headless[name], True
    shown = ", ".join(map(str, architectures)) or f"model_type {raw.get('model_type')!r}"
    raise CheckpointError(
        f"config.json field 'architectures' is {shown}; supported: {', '.join(supported_architectures())}"
    )
