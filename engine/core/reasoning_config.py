"""How an engine reads and bounds a reasoning model's think block: the parser (vLLM's `--reasoning-parser` names),
the thinking-token budget of each `reasoning_effort` tier, the default tier, and the short text forced before the
end-of-think marker when a row runs out of budget.

Pure data, no torch: the platform validates a base model's reasoning settings with it before it stores them.

- Parsers: `deepseek_r1` and `qwen3` both read `<think>` ... `</think>`. `qwen3`'s output has a think block only if
  it opens one as it starts (or its template opened it in the prompt); `deepseek_r1`'s output is read as reasoning
  from its first token until `</think>` (R1 writes no `<think>` of its own), unless the prompt closed the block.
- Budgets: the most tokens a row may spend inside its think block before the engine forces the closing text and the
  end marker (engine_core's `reasoning.py` does that per row). `none` is 0: the block is closed before the first
  token. Tiers are OpenAI's `reasoning_effort` values; a request without one gets `default_effort`'s budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

REASONING_PARSERS: Final = ("deepseek_r1", "qwen3")
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high")
DEFAULT_REASONING_BUDGETS: Final[Mapping[str, int]] = {"none": 0, "minimal": 16, "low": 64, "medium": 256, "high": 1024}
DEFAULT_REASONING_EFFORT: Final = "medium"  # OpenAI's default tier
DEFAULT_CLOSING_TEXT: Final = "\n\nTime is up; answering now.\n"
MAX_CLOSING_CHARS: Final = 256
MAX_THINKING_BUDGET: Final = 1_000_000

# The think block's markers, as both parsers (and the models they are named after) write them.
THINK_START: Final = "<think>"
THINK_END: Final = "</think>"


def parse_reasoning_budgets(text: str) -> dict[str, int]:
    """`none=0,low=64,medium=256,high=1024` (the engine's --reasoning-budgets) as a dict; ValueError naming the bad
    entry. Tiers left out keep their defaults (`ReasoningConfig`)."""
    budgets: dict[str, int] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        tier, sep, value = entry.partition("=")
        tier = tier.strip()
        if not sep:
            raise ValueError(f"{entry!r} is not tier=tokens (e.g. low=64)")
        if tier not in REASONING_EFFORTS:
            raise ValueError(f"{tier!r} is not a reasoning effort; tiers are {', '.join(REASONING_EFFORTS)}")
        if tier in budgets:
            raise ValueError(f"{tier} is given twice")
        try:
            budgets[tier] = int(value.strip())
        except ValueError:
            raise ValueError(f"{tier}'s budget must be a whole number of tokens, not {value.strip()!r}") from None
    if not budgets:
        raise ValueError("give at least one tier=tokens entry, e.g. none=0,low=64,medium=256,high=1024")
    return budgets


def format_reasoning_budgets(budgets: Mapping[str, int]) -> str:
    """The --reasoning-budgets form of `budgets`, tiers in their order."""
    return ",".join(f"{tier}={budgets[tier]}" for tier in REASONING_EFFORTS if tier in budgets)


@dataclass(frozen=True, slots=True)
class ReasoningConfig:
    """An engine's reasoning settings; `budgets` always holds every tier (defaults fill what is not given)."""

    parser: str
    budgets: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_REASONING_BUDGETS))
    default_effort: str = DEFAULT_REASONING_EFFORT
    closing_text: str = DEFAULT_CLOSING_TEXT

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, not {self.parser!r}")
        if not isinstance(self.budgets, Mapping):
            raise ValueError("budgets must map reasoning efforts to token counts")
        merged = dict(DEFAULT_REASONING_BUDGETS)
        for tier, budget in self.budgets.items():
            if tier not in REASONING_EFFORTS:
                raise ValueError(f"{tier!r} is not a reasoning effort; tiers are {', '.join(REASONING_EFFORTS)}")
            if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget <= MAX_THINKING_BUDGET:
                raise ValueError(f"{tier}'s budget must be a whole number of tokens from 0 to {MAX_THINKING_BUDGET}")
            merged[tier] = budget
        if merged["none"] != 0:
            raise ValueError("the none tier's budget is 0: it closes the think block before the first token")
        object.__setattr__(self, "budgets", merged)
        if self.default_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"default reasoning effort must be one of {', '.join(REASONING_EFFORTS)}, not {self.default_effort!r}"
            )
        if not isinstance(self.closing_text, str) or len(self.closing_text) > MAX_CLOSING_CHARS:
            raise ValueError(f"the closing text must be a string of at most {MAX_CLOSING_CHARS} characters")
        if THINK_END in self.closing_text or THINK_START in self.closing_text:
            raise ValueError("the closing text must not hold the think markers (the end marker follows it)")

    def budget(self, effort: str | None) -> int:
        """The thinking-token budget of `effort` (None: the default tier)."""
        return self.budgets[effort if effort is not None else self.default_effort]

    def to_dict(self) -> dict[str, Any]:
        return {
            "parser": self.parser,
            "budgets": {tier: self.budgets[tier] for tier in REASONING_EFFORTS},
            "default_effort": self.default_effort,
            "closing_text": self.closing_text,
        }

    @classmethod
    def from_dict(cls, value: Any) -> ReasoningConfig:
        """From its JSON object (`to_dict`'s shape; only `parser` is required); ValueError naming what is wrong."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise ValueError('must be an object such as {"parser": "qwen3", "budgets": {"low": 64}}')
        unknown = sorted(set(value) - {"parser", "budgets", "default_effort", "closing_text"})
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}; fields are parser, budgets, default_effort, closing_text")
        if "parser" not in value:
            raise ValueError(f"parser is required: one of {', '.join(REASONING_PARSERS)}")
        budgets = value.get("budgets", {})
        if isinstance(budgets, str):
            budgets = parse_reasoning_budgets(budgets)
        return cls(
            parser=value["parser"],
            budgets=budgets if budgets is not None else {},
            default_effort=value.get("default_effort") or DEFAULT_REASONING_EFFORT,
            closing_text=value.get("closing_text", DEFAULT_CLOSING_TEXT),
        )
