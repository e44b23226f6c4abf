"""Grammar-constrained decoding with xgrammar: compile a request's output grammar once, follow it token by token,
and give each step's constrained rows their masks of allowed tokens.

- `GrammarCompiler` turns a `StructuredOutputsParams` into xgrammar's compiled grammar, cached by the spec's hash
  (a bounded LRU shared by every request of the engine), and refuses what it cannot enforce as a RequestError.
- `GrammarState` is one request's matcher: the sampler's mask comes from it, the output processor advances it.
- `fill_bitmasks` fills one bitmask for all the constrained rows of a step, and for a row that verifies speculative
  proposals, one mask per position: the mask after each prefix of its proposal, the matcher walked ahead and back.

JSON is generated compactly (xgrammar's `any_whitespace=False`: one space after `,` and `:`, none elsewhere), so a
weak model cannot spend its budget on whitespace; and tokens holding a raw control character are never allowed in
JSON (xgrammar's length-bounded strings would otherwise admit them, and no JSON parser accepts them).

xgrammar (and the transformers it wraps tokenizers with) is imported on first use: an engine that never sees a
grammar never loads it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch

from loraplex.engine.core.sampling_params import StructuredOutputsParams
from loraplex.engine.errors import RequestError

if TYPE_CHECKING:
    import xgrammar

    from loraplex.engine.model.tokenizer import Tokenizer

DEFAULT_CACHE_ENTRIES: Final = 256
MAX_SCHEMA_DEPTH: Final = 64  # nesting levels of subschemas: deeper is refused before it reaches xgrammar's recursion

# Schema keywords xgrammar enforces (checked by sampling at temperature 1 and validating, tests/engine/core/
# test_structured_output.py). Anything else that constrains is refused by name rather than silently dropped.
_ANNOTATIONS: Final = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
     "writeOnly", "strict"}
)  # fmt: skip
_ENFORCED: Final = frozenset(
    {"type", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "allOf",
     "properties", "required", "additionalProperties", "patternProperties",
     "items", "prefixItems", "minItems", "maxItems",
     "minLength", "maxLength", "pattern", "format",
     "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)  # fmt: skip
# String formats xgrammar knows; it ignores length bounds on them, so a format with a bound is refused.
_FORMATS: Final = frozenset(
    {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
     "uri-template", "json-pointer", "relative-json-pointer"}
)  # fmt: skip
_SCHEMA_MAPS: Final = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS: Final = ("anyOf", "allOf", "prefixItems")  # lists of subschemas
_SCHEMAS: Final = ("items", "additionalProperties")  # one subschema (or a boolean)


def check_schema(schema: Any, param: str) -> None:
    """Raise RequestError naming the first keyword of `schema` that the grammar cannot enforce."""

    def refuse(keyword: str, where: str, why: str = "which cannot be enforced") -> RequestError:
        return RequestError(
            f"{param}: the schema uses '{keyword}' at {where}, {why}; supported keywords: "
            + ", ".join(sorted(_ENFORCED)),
            code="unsupported_value",
            param=param,
        )

    def walk(node: Any, where: str, depth: int = 0) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestError(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        if isinstance(node, bool):
            return
        if not isinstance(node, Mapping):
            raise RequestError(f"{param}: the schema at {where} must be an object or a boolean", param=param)
        for keyword in node:
            if keyword not in _ENFORCED and keyword not in _ANNOTATIONS:
                raise refuse(str(keyword)[:64], where)
        if "format" in node:
            if not isinstance(node["format"], str) or node["format"] not in _FORMATS:
                raise refuse("format", where, f"whose value {str(node['format'])[:64]!r} is not a supported format")
            if "minLength" in node or "maxLength" in node:
                raise refuse("maxLength" if "maxLength" in node else "minLength", where, "together with 'format'")
        if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) != 1):
            raise refuse("allOf", where, "with more than one subschema")
        for keyword in _SCHEMA_MAPS:
            children = node.get(keyword)
            if isinstance(children, Mapping):
                for name, child in children.items():
                    walk(child, f"{where}/{keyword}/{name}", depth + 1)
        for keyword in _SCHEMA_LISTS:
            children = node.get(keyword)
            if isinstance(children, list):
                for i, child in enumerate(children):
                    walk(child, f"{where}/{keyword}/{i}", depth + 1)
        for keyword in _SCHEMAS:
            if keyword in node:
                walk(node[keyword], f"{where}/{keyword}", depth + 1)

    walk(schema, "#")


@dataclass(slots=True)
class CompilerStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # spent compiling the misses


class GrammarCompiler:
    """Compiles output grammars for one tokenizer and vocabulary; thread-safe (the server compiles off its event
    loop while the engine thread makes matchers)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, *, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.stats = CompilerStats()
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._json_safe: torch.Tensor | None = None  # [words] int32: tokens without raw control characters

    def _xgrammar(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import transformers
            import xgrammar

            wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.backend)  # type: ignore[no-untyped-call]
            info = xgrammar.TokenizerInfo.from_huggingface(
                wrapped, vocab_size=self.vocab_size, stop_token_ids=sorted(self._tokenizer.eos_token_ids)
            )
            self._json_safe = _tokens_without_control_chars(self._tokenizer, self.vocab_size)
            # Our cache sits in front; xgrammar's own would keep a second copy of each grammar.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `params`; RequestError (naming `params.param`) if it cannot be enforced."""
        if params.kind == "json":
            check_schema(params.schema, params.param)
        key = hashlib.sha256(f"{params.kind}\0{params.spec}".encode()).hexdigest()
        with self._lock:
            compiler = self._xgrammar()
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                return CompiledGrammar(cached, params.kind in ("json", "json_object"), key)
            started = time.perf_counter()
            compiled = _compile(compiler, params)
            self.stats.misses += 1
            self.stats.compile_seconds += time.perf_counter() - started
            self._cache[key] = compiled
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return CompiledGrammar(compiled, params.kind in ("json", "json_object"), key)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    @property
    def json_safe(self) -> torch.Tensor:
        self._xgrammar()
        assert self._json_safe is not None
        return self._json_safe


def _compile(compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    try:
        if params.kind == "json":
            return compiler.compile_json_schema(params.spec, any_whitespace=False)
        if params.kind == "json_object":
            # A schema rather than xgrammar's builtin JSON grammar, which allows any whitespace.
            return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
        if params.kind == "regex":
            return compiler.compile_regex(params.spec)
        if params.kind == "choice":
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(params.spec))
            return compiler.compile_grammar(f"root ::= {alternatives}")
        return compiler.compile_grammar(params.spec)
    except Exception as exc:  # xgrammar reports a bad spec as RuntimeError or ValueError; any error here is the spec's
        message = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise RequestError(
            f"{params.param}: the {params.kind} cannot be compiled: {message}", param=params.param
        ) from None


def _tokens_without_control_chars(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """A packed bitmask [ceil(vocab / 32)] int32, bit set for each token whose text holds no control character."""
    allowed = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.bool)
    backend = tokenizer.backend
    for token_id in range(min(vocab_size, backend.get_vocab_size(with_added_tokens=True))):
        text = backend.decode([token_id], skip_special_tokens=False)
        allowed[token_id] = not any(ord(ch) < 0x20 for ch in text)
    for token_id in tokenizer.eos_token_ids:  # ending is always allowed where the grammar allows it
        if token_id < vocab_size:
            allowed[token_id] = True
    return pack(allowed)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[..., 32 k] bool -> [..., k] int32, bit j of word i = allowed[32 i + j] (xgrammar's layout)."""
    words = allowed.reshape(*allowed.shape[:-1], -1, 32).to(torch.int64)
    packed = (words << torch.arange(32, dtype=torch.int64)).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., k] int32 -> [..., vocab_size] bool (see `pack`)."""
    bits = (bitmask.to(torch.int64)[..., None] >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    grammar: xgrammar.CompiledGrammar
    is_json: bool  # JSON output: tokens with raw control characters are never allowed
    key: str  # the spec's hash


class GrammarState:
    """One request's place in its grammar."""

    __slots__ = ("_matcher", "_scratch", "is_json", "stop_token_ids")

    def __init__(self, compiled: CompiledGrammar, vocab_size: int) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled.grammar)
        self.is_json = compiled.is_json
        self.stop_token_ids = frozenset(self._matcher.stop_token_ids)
        self._scratch = xgrammar.allocate_token_bitmask(1, vocab_size)

    def fill(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def fill_ahead(self, bitmask: torch.Tensor, index: int, proposal: Sequence[int]) -> None:
        """Fill rows index .. index + len(proposal): row index + j the mask after the first j proposed tokens, as if
        they had been accepted. The matcher ends where it began (xgrammar's rollback). Past a proposed token the
        grammar refuses or that ends it, the rows repeat the last mask: a row's verification stops at such a token
        (it is masked out, or ends the output), so those positions are never emitted."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(bitmask, index)
        walked = 0
        for token in proposal:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            walked += 1
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, index + walked)
        last = index + walked
        if walked < len(proposal):
            bitmask[last + 1 : index + len(proposal) + 1] = bitmask[last]
        if walked:
            matcher.rollback(walked)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    def is_finished(self) -> bool:
        """True when the grammar is complete and allows nothing more but a stop token: the output is done."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        self._matcher.fill_next_token_bitmask(self._scratch, 0)
        allowed = unpack(self._scratch[0], self._scratch.shape[1] * 32).nonzero().flatten().tolist()
        return all(token in self.stop_token_ids for token in allowed)


@dataclass(frozen=True, slots=True)
class GrammarMasks:
    """One step's masks: logits row `r` of `rows` may take the tokens set in `bitmask[r]` (one bitmask row per row of
    the step, as xgrammar's kernel indexes both by the same row; rows not in `rows` are left as they are)."""

    rows: torch.Tensor  # [n] int64 logits rows that are constrained
    bitmask: torch.Tensor  # [num_rows, ceil(vocab / 32)] int32, xgrammar's packed layout


def allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set `token_id`'s bit in bitmask row `row` (see `pack`), in place: a token allowed besides the grammar's."""
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - 2**32 if value >= 2**31 else value


def apply_masks(logits: torch.Tensor, masks: GrammarMasks) -> None:
    """Set to -inf, in place, every logit of `masks.rows` that its bitmask does not allow: xgrammar's kernel (C++ on
    CPU, Triton on CUDA), about 2.5x faster here than unpacking the bits in torch (`unpack`, the reference)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, masks.bitmask.to(logits.device), vocab_size=logits.shape[1], indices=masks.rows.tolist()
    )


def fill_bitmasks(
    states: Sequence[tuple[int, GrammarState, Sequence[int]]],
    num_rows: int,
    vocab_size: int,
    json_safe: torch.Tensor | None,
    also_allowed: Sequence[tuple[int, int]] = (),
) -> GrammarMasks | None:
    """The masks of a step of `num_rows` rows whose constrained requests are `states` (first row, its state, the
    proposal it verifies: [] for none); a request takes rows first .. first + len(proposal) (GrammarState.fill_ahead).
    `also_allowed` (row, token) pairs are allowed besides their row's grammar (a think block's opening marker).
    None when there are none."""
    if not states:
        return None
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(num_rows, vocab_size)
    rows: list[int] = []
    json_rows: list[int] = []
    for row, state, proposal in states:
        if proposal:
            state.fill_ahead(bitmask, row, proposal)
        else:
            state.fill(bitmask, row)
        span = range(row, row + len(proposal) + 1)
        rows.extend(span)
        if state.is_json:
            json_rows.extend(span)
    if json_safe is not None and json_rows:
        index = torch.tensor(json_rows, dtype=torch.int64)
        bitmask[index] &= json_safe[: bitmask.shape[1]]
    for row, token_id in also_allowed:
        allow_token(bitmask, row, token_id)
    return GrammarMasks(rows=torch.tensor(rows, dtype=torch.int64), bitmask=bitmask)
