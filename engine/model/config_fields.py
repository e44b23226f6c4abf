"""Typed reads of config.json's fields, each refusal naming the field and its value. The family modules and the common
part of ModelConfig read their fields through this one reader, so every message has the same shape."""

from __future__ import annotations

import math
from typing import Any

from loraplex.engine.errors import CheckpointError
from loraplex.engine.model.layers.activation import ACTIVATIONS, Activation
from loraplex.engine.model.layers.rope import (
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    RopeConfig,
    RopeScaling,
    YarnScaling,
)


class ConfigFields:
    """config.json's object (or a nested part of it, `where` naming it in messages)."""

    def __init__(self, raw: dict[str, Any], where: str = "config.json") -> None:
        self.raw = raw
        self.where = where

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def positive_int(self, name: str, *, default: int | None = None) -> int:
        value = self.raw.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{self.where} field '{name}' must be a positive integer, got {value!r}")
        return value

    def optional_positive_int(self, name: str) -> int | None:
        return None if self.raw.get(name) is None else self.positive_int(name)

    def positive_float(self, name: str, *, default: float | None = None) -> float:
        value = self.raw.get(name, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
            raise CheckpointError(f"{self.where} field '{name}' must be a positive number, got {value!r}")
        return float(value)

    def optional_positive_float(self, name: str) -> float | None:
        return None if self.raw.get(name) is None else self.positive_float(name)

    def flag(self, name: str, *, default: bool = False) -> bool:
        value = self.raw.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where} field '{name}' must be true or false, got {value!r}")
        return value

    def refuse_if_set(self, name: str, what: str) -> None:
        """A field whose set value asks for something loraplex does not compute."""
        value = self.raw.get(name)
        if value not in (None, False, 0, "", [], {}):
            raise CheckpointError(f"{self.where} field '{name}' is {value!r}: {what} is not supported")

    def activation(self, *names: str, default: str = "silu") -> Activation:
        """The MLP activation from the first of `names` that is present."""
        name = next((n for n in names if self.raw.get(n) is not None), names[0])
        value = self.raw.get(name, default)
        if value not in ACTIVATIONS:
            raise CheckpointError(
                f"{self.where} field '{name}' is {value!r}; supported: {', '.join(sorted(ACTIVATIONS))}"
            )
        return ACTIVATIONS[value]

    def layer_sliding(self, num_layers: int, default: list[bool]) -> tuple[bool, ...]:
        """Which layers attend through a sliding window: `layer_types` when written, else the family's `default`."""
        layer_types = self.raw.get("layer_types")
        if layer_types is None:
            return tuple(default)
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise CheckpointError(
                f"{self.where} field 'layer_types' must list one type per layer ({num_layers}), got {layer_types!r}"
            )
        kinds = {"full_attention": False, "sliding_attention": True}
        unknown = [kind for kind in layer_types if kind not in kinds]
        if unknown:
            raise CheckpointError(
                f"{self.where} field 'layer_types' holds {unknown[0]!r}; supported: full_attention, sliding_attention"
            )
        return tuple(kinds[kind] for kind in layer_types)

    def rope(
        self, head_dim: int, *, theta: float | None = None, parameters: dict[str, Any] | None = None
    ) -> RopeConfig:
        """The rotary embedding: `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5) beside
        `rope_theta` and `partial_rotary_factor`; `parameters` a family's own dict (Gemma 3's per-layer-type ones)."""
        if parameters is None:
            parameters = self.rope_parameters()
        raw_theta = parameters.get("rope_theta", self.raw.get("rope_theta")) if theta is None else theta
        rope_theta = 10000.0 if raw_theta is None else raw_theta
        if not isinstance(rope_theta, int | float) or isinstance(rope_theta, bool) or not rope_theta > 0:
            raise CheckpointError(f"{self.where} field 'rope_theta' must be a positive number, got {rope_theta!r}")
        factor = parameters.get("partial_rotary_factor", self.raw.get("partial_rotary_factor", 1.0))
        if not isinstance(factor, int | float) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise CheckpointError(f"{self.where} field 'partial_rotary_factor' must be in (0, 1], got {factor!r}")
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or rotary_dim == 0:
            raise CheckpointError(
                f"{self.where} field 'partial_rotary_factor' ({factor}) gives {rotary_dim} rotary dimensions of a "
                f"{head_dim}-dimensional head; it must be a positive even number"
            )
        return RopeConfig(float(rope_theta), self._rope_scaling(parameters, rotary_dim), rotary_dim)

    def rope_parameters(self) -> dict[str, Any]:
        """rope_parameters and rope_scaling merged (the latter wins), as written."""
        scaling = self.raw.get("rope_scaling")
        parameters = self.raw.get("rope_parameters")
        if scaling is not None and not isinstance(scaling, dict):
            raise CheckpointError(f"{self.where} field 'rope_scaling' must be an object or null")
        if parameters is not None and not isinstance(parameters, dict):
            raise CheckpointError(f"{self.where} field 'rope_parameters' must be an object")
        return {**(parameters or {}), **(scaling or {})}

    def _rope_scaling(self, value: dict[str, Any], rotary_dim: int) -> RopeScaling | None:
        kind = value.get("rope_type", value.get("type"))
        if kind in (None, "default"):
            return None
        where = f"{self.where} field 'rope_scaling'"
        try:
            if kind == "llama3":
                return self._checked(
                    Llama3Scaling(
                        factor=float(value["factor"]),
                        low_freq_factor=float(value["low_freq_factor"]),
                        high_freq_factor=float(value["high_freq_factor"]),
                        original_max_position_embeddings=int(value["original_max_position_embeddings"]),
                    ),
                    where,
                )
            if kind == "linear":
                return self._checked(LinearScaling(factor=float(value["factor"])), where)
            if kind == "yarn":
                return self._checked(self._yarn(value), where)
            if kind in ("longrope", "su"):
                return self._longrope(value, rotary_dim, where)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where} (type {kind!r}) is missing or has a bad {exc}") from None
        raise CheckpointError(
            f"{where} has type {kind!r}; supported: 'default', 'llama3', 'linear', 'yarn' and 'longrope'"
        )

    def _yarn(self, value: dict[str, Any]) -> YarnScaling:
        factor = float(value["factor"])
        original = int(value.get("original_max_position_embeddings") or self.positive_int("max_position_embeddings"))
        attention_factor = value.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = value.get("mscale"), value.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        return YarnScaling(
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(value.get("beta_fast") or 32),
            beta_slow=float(value.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
            truncate=bool(value.get("truncate", True)),
        )

    def _longrope(self, value: dict[str, Any], rotary_dim: int, where: str) -> LongRopeScaling:
        original = self.raw.get("original_max_position_embeddings") or value.get("original_max_position_embeddings")
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise CheckpointError(f"{where} (longrope) needs a positive 'original_max_position_embeddings'")
        factors = {}
        for name in ("short_factor", "long_factor"):
            listed = value.get(name)
            if (
                not isinstance(listed, list)
                or len(listed) != rotary_dim // 2
                or not all(isinstance(f, int | float) and not isinstance(f, bool) and f > 0 for f in listed)
            ):
                raise CheckpointError(
                    f"{where} field '{name}' must list {rotary_dim // 2} positive numbers (one per rotary pair)"
                )
            factors[name] = tuple(float(f) for f in listed)
        attention_factor = value.get("attention_factor")
        if attention_factor is None:
            factor = value.get("factor") or self.positive_int("max_position_embeddings") / original
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return LongRopeScaling(
            short_factor=factors["short_factor"],
            long_factor=factors["long_factor"],
            original_max_position_embeddings=original,
            attention_factor=float(attention_factor),
        )

    @staticmethod
    def _checked(scaling: RopeScaling, where: str) -> RopeScaling:
        factor = getattr(scaling, "factor", 1.0)
        if not (factor > 0 and math.isfinite(factor)):
            raise CheckpointError(f"{where} field 'factor' must be positive")
        return scaling


def token_ids(value: object) -> frozenset[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset({value})
    if isinstance(value, list):
        return frozenset(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return frozenset()
