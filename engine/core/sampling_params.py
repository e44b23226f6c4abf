"""Per-request sampling settings, shaped like vLLM's `SamplingParams` so its users feel at home.

`SamplingParams(temperature=0.7, top_p=0.9, stop=["\\n"], max_tokens=64)`: keyword construction, validated at
once; a bad value raises `RequestError` whose `param` names the field and whose message can go to an API user
as is. The object is frozen, so what was validated is what the engine runs; use `dataclasses.replace` to derive
a changed copy (it validates again).

The constructor is written out by hand rather than generated: it accepts vLLM's loose input types (`stop` as a
string or a list, lists for the id and processor fields) while the attributes have one normalized type each
(tuples), so code that reads them is type-checked against what is really there.
"""

from __future__ import annotations

import dataclasses
import json as _json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeGuard

from loraplex.engine.errors import RequestError

if TYPE_CHECKING:
    import torch

# A per-row logits hook: (the request's output token ids so far, its logits [vocab] float32) -> logits [vocab].
# It may modify the tensor in place and return it, or return a new one; it must not keep either argument.
LogitsProcessor: TypeAlias = Callable[[list[int], "torch.Tensor"], "torch.Tensor"]

MAX_N: Final = 128  # most choices per request (OpenAI's limit)
MAX_LOGPROBS: Final = 20  # most top logprobs a request may ask for per token (OpenAI's top_logprobs limit)

# Temperatures below this sample greedily: dividing logits by a tinier one overflows float32 (vLLM's rule too).
GREEDY_TEMPERATURE: Final = 1e-5

# torch.Generator.manual_seed accepts exactly this range; checking here keeps a bad seed a 400, not a crash.
_MIN_SEED: Final = -(2**63)
_MAX_SEED: Final = 2**64 - 1

# OpenAI's logit_bias range: -100 bans a token in practice, +100 makes it the only choice in practice.
MAX_LOGIT_BIAS: Final = 100.0
MAX_PENALTY: Final = 2.0  # OpenAI's presence and frequency penalty range is [-2, 2]

_INVALID: Final = "invalid_value"


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(message, code=_INVALID, param=param)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(param: str, value: object, *, low: int, high: int | None = None) -> int:
    if not _is_int(value):
        raise _invalid(param, f"{param} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise _invalid(param, f"{param} must be {bounds}, got {value}")
    return value


def _float(param: str, value: object, *, low: float, high: float | None = None, low_open: bool = False) -> float:
    if not (isinstance(value, int | float) and not isinstance(value, bool)) or not math.isfinite(value):
        raise _invalid(param, f"{param} must be a finite number, got {value!r}")
    number = float(value)
    if number < low or (low_open and number == low) or (high is not None and number > high):
        lower = f"> {low}" if low_open else f">= {low}"
        bounds = lower if high is None else f"{lower} and <= {high}"
        raise _invalid(param, f"{param} must be {bounds}, got {value}")
    return number


def _bool(param: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _invalid(param, f"{param} must be true or false, got {value!r}")
    return value


def _stop_strings(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, Sequence) or not all(isinstance(s, str) for s in items):
        raise _invalid("stop", f"stop must be a string or a list of strings, got {value!r}")
    if any(s == "" for s in items):
        raise _invalid("stop", "stop strings must not be empty")
    return tuple(items)


def _token_ids(param: str, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise _invalid(param, f"{param} must be a list of token ids, got {value!r}")
    return tuple(_int(param, token, low=0) for token in value)


def _processors(value: object) -> tuple[LogitsProcessor, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(callable(f) for f in value):
        raise _invalid("logits_processors", "logits_processors must be a list of callables")
    return tuple(value)


@dataclass(frozen=True, slots=True, init=False)
class StructuredOutputsParams:
    """A request's output grammar, as vLLM's `StructuredOutputsParams`: exactly one of a JSON schema (`json`, a
    dict or its JSON text), any JSON object (`json_object=True`), a regular expression, a list of choices, or an EBNF
    grammar (xgrammar's dialect, GBNF-like). The engine compiles it once per distinct spec and masks each step's
    logits to the tokens it allows; `check_request` refuses a spec that does not compile, or a schema keyword that
    cannot be enforced, as a RequestError naming `param`."""

    kind: str  # "json", "json_object", "regex", "choice" or "grammar"
    spec: str  # the canonical text: compact JSON for a schema, the JSON list of choices, else as given
    param: str  # the API field it came from, for error messages

    def __init__(
        self,
        *,
        json: Mapping[str, Any] | str | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        param: str = "structured_outputs",
    ) -> None:
        given = [
            name
            for name, value in (("json", json), ("regex", regex), ("choice", choice), ("grammar", grammar))
            if value is not None
        ]
        if json_object:
            given.append("json_object")
        if len(given) != 1:
            found = ", ".join(given) if given else "none"
            raise _invalid(
                param, f"{param} must set exactly one of json, json_object, regex, choice, grammar; got {found}"
            )
        kind = given[0]
        if kind == "json":
            spec = _canonical_schema(param, json)
        elif kind == "json_object":
            spec = ""
        elif kind == "choice":
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not choice:
                raise _invalid(param, f"{param} choice must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in choice):
                raise _invalid(param, f"{param} choices must be non-empty strings")
            spec = _json.dumps(list(choice), ensure_ascii=False)
        else:
            text = regex if kind == "regex" else grammar
            if not isinstance(text, str) or not text:
                raise _invalid(param, f"{param} {kind} must be a non-empty string")
            spec = text
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "spec", spec)
        object.__setattr__(self, "param", param)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a `json` spec, else None."""
        return _json.loads(self.spec) if self.kind == "json" else None

    @property
    def choices(self) -> list[str] | None:
        return _json.loads(self.spec) if self.kind == "choice" else None


def _canonical_schema(param: str, value: object) -> str:
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except ValueError as exc:
            raise _invalid(param, f"{param} json is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping) and not isinstance(value, bool):
        raise _invalid(param, f"{param} json must be a JSON schema (an object), got {type(value).__name__}")
    try:
        # Keys keep their order: a schema's property order is the order the output follows.
        return _json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _invalid(param, f"{param} json must be plain JSON: {exc}") from None


def _penalty(param: str, value: object, *, low: float, high: float, neutral: float) -> float:
    number = _float(param, value, low=low, high=high, low_open=param == "repetition_penalty")
    return neutral if number == neutral else number


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id; ids as ints or as the decimal strings of OpenAI's JSON keys."""
    if value is None:
        return ()
    if isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
        value = dict(value)  # the attribute's own form, as dataclasses.replace passes it back
    if not isinstance(value, Mapping):
        raise _invalid("logit_bias", "logit_bias must map token ids to numbers")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token) or token < 0:
            raise _invalid("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        pairs[token] = _float(f"logit_bias[{key}]", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)
    return tuple(sorted((t, b) for t, b in pairs.items() if b != 0.0))


@dataclass(frozen=True, slots=True, init=False)
class SamplingParams:
    """How one request picks its tokens and when it stops. Defaults match vLLM's."""

    n: int  # choices per request: the prompt is prefilled once and each choice samples on (see `choice`)
    presence_penalty: float  # OpenAI's: minus this from each token's logit once it has appeared in the output
    frequency_penalty: float  # OpenAI's: minus this times the number of times the token appeared in the output
    repetition_penalty: float  # vLLM's (and CTRL's): a token seen in prompt or output has its logit divided by
    # this when positive, multiplied when negative; 1 is none
    logit_bias: tuple[tuple[int, float], ...]  # (token id, bias added to its logit), sorted by id
    structured_outputs: StructuredOutputsParams | None  # the output's grammar, if any
    temperature: float  # >= 0; 0 (below GREEDY_TEMPERATURE) means greedy
    top_p: float  # nucleus: keep the most likely tokens whose mass reaches top_p; 0 < top_p <= 1
    top_k: int  # keep the top_k most likely tokens; 0 or -1 keeps all
    min_p: float  # drop tokens less likely than min_p times the most likely one; 0 <= min_p <= 1
    seed: int | None  # a seeded request's tokens depend only on the seed and its logits, never on its batch
    stop: tuple[str, ...]  # strings that end the output (not included unless include_stop_str_in_output)
    stop_token_ids: tuple[int, ...]  # token ids that end the output, besides EOS
    max_tokens: int | None  # most tokens to generate; None: up to the context length
    min_tokens: int  # EOS and stop token ids cannot be sampled before this many tokens
    ignore_eos: bool  # keep generating after EOS (benchmarks)
    logprobs: int | None  # None: no logprobs; k: the sampled token's logprob and the top k (0..MAX_LOGPROBS)
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    logits_processors: tuple[LogitsProcessor, ...]  # applied in order to the request's logits row, pre-sampling
    # The output may hold a think block (the engine's --reasoning-parser markers): the engine follows it, counts its
    # tokens, starts the output grammar after it, and, with a budget, closes it once the row has spent that many
    # tokens inside it (vLLM's thinking_token_budget; 0 closes it before the first token). A budget implies reasoning.
    reasoning: bool
    thinking_token_budget: int | None

    def __init__(
        self,
        *,
        n: int = 1,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | Mapping[str, float] | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        reasoning: bool = False,
        thinking_token_budget: int | None = None,
    ) -> None:
        _int("n", n, low=1, high=MAX_N)
        if not _is_int(top_k) or top_k < -1:
            raise _invalid("top_k", f"top_k must be a positive integer, or 0 or -1 for no limit; got {top_k!r}")
        if max_tokens is not None:
            _int("max_tokens", max_tokens, low=1)
        _int("min_tokens", min_tokens, low=0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise _invalid("min_tokens", f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")
        if seed is not None:
            _int("seed", seed, low=_MIN_SEED, high=_MAX_SEED)
        if logprobs is not None:
            _int("logprobs", logprobs, low=0, high=MAX_LOGPROBS)
        if thinking_token_budget is not None:
            _int("thinking_token_budget", thinking_token_budget, low=0)
        if structured_outputs is not None and not isinstance(structured_outputs, StructuredOutputsParams):
            raise _invalid("structured_outputs", "structured_outputs must be a StructuredOutputsParams")
        fields: dict[str, object] = {
            "n": n,
            "presence_penalty": _penalty(
                "presence_penalty", presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY, neutral=0.0
            ),
            "frequency_penalty": _penalty(
                "frequency_penalty", frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY, neutral=0.0
            ),
            "repetition_penalty": _penalty(
                "repetition_penalty", repetition_penalty, low=0.0, high=math.inf, neutral=1.0
            ),
            "logit_bias": _logit_bias(logit_bias),
            "structured_outputs": structured_outputs,
            "temperature": _float("temperature", temperature, low=0.0),
            "top_p": _float("top_p", top_p, low=0.0, high=1.0, low_open=True),
            "top_k": top_k,
            "min_p": _float("min_p", min_p, low=0.0, high=1.0),
            "seed": seed,
            "stop": _stop_strings(stop),
            "stop_token_ids": _token_ids("stop_token_ids", stop_token_ids),
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "ignore_eos": _bool("ignore_eos", ignore_eos),
            "logprobs": logprobs,
            "skip_special_tokens": _bool("skip_special_tokens", skip_special_tokens),
            "include_stop_str_in_output": _bool("include_stop_str_in_output", include_stop_str_in_output),
            "logits_processors": _processors(logits_processors),
            "reasoning": _bool("reasoning", reasoning) or thinking_token_budget is not None,
            "thinking_token_budget": thinking_token_budget,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n-choice request: one choice each (n=1), and with a seed, each its
        own seed stream (seed + index, as vLLM's parallel sampling does)."""
        if not 0 <= index < self.n:
            raise ValueError(f"choice {index} of a request with n={self.n}")
        seed = None if self.seed is None else (self.seed + index - _MIN_SEED) % (_MAX_SEED - _MIN_SEED + 1) + _MIN_SEED
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the most likely token each step (top_k, top_p, min_p and seed are moot)."""
        return self.temperature < GREEDY_TEMPERATURE
