"""SpeculativeConfig: how an engine speculates, in vLLM's `--speculative-config` shape.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}` proposes
tokens by prompt lookup (the request's own prompt and output); `{"method": "draft_model", "model": PATH,
"num_speculative_tokens": 4}` by a small checkpoint that shares the target's tokenizer. `num_speculative_tokens` is
the most a row may propose in a step: the load-adaptive policy (speculation_policy.py) picks each row's length per
step, down to none. Parsed once, with errors that name the field, before anything is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

SpeculativeMethod = Literal["ngram", "draft_model"]
METHODS: tuple[SpeculativeMethod, ...] = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's names for the same methods, accepted as spellings of ours.
_ALIASES = {"ngram": "ngram", "draft_model": "draft_model", "draft": "draft_model"}
_FIELDS = frozenset({"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"})


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpeculativeMethod
    num_speculative_tokens: int = 4  # at most this many proposed tokens per row and step
    # n-gram lookup: the longest suffix of the request's tokens, of at most prompt_lookup_max and at least
    # prompt_lookup_min tokens, that occurred earlier proposes the tokens that followed it.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Path | None = None  # draft_model: the draft checkpoint's folder

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}")
        if self.prompt_lookup_min < 1:
            raise ValueError("prompt_lookup_min must be at least 1")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("prompt_lookup_max must be at least prompt_lookup_min")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("a draft_model speculative config needs 'model': the draft checkpoint's folder")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("'model' is for the draft_model method; ngram speculation has no model")

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the JSON text of `--speculative-config` (or its decoded object). Unknown fields are an error, so a
        misspelt one is not silently ignored."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the speculative config is not valid JSON: {exc.msg}") from None
        if not isinstance(value, dict):
            raise ValueError("the speculative config must be a JSON object")
        unknown = sorted(set(value) - _FIELDS)
        if unknown:
            raise ValueError(f"unknown speculative config field(s): {', '.join(unknown)}")
        method = value.get("method")
        if not isinstance(method, str) or method not in _ALIASES:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {method!r}")
        numbers: dict[str, int] = {}
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if name in value:
                number = value[name]
                if not isinstance(number, int) or isinstance(number, bool):
                    raise ValueError(f"{name} must be an integer, not {number!r}")
                numbers[name] = number
        model = value.get("model")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a path, not {model!r}")
        resolved: SpeculativeMethod = "ngram" if _ALIASES[method] == "ngram" else "draft_model"
        return cls(method=resolved, model=None if model is None else Path(model), **numbers)
