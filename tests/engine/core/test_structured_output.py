"""Structured outputs in the engine: every answer of a random model sampled at temperature 1.0 under a schema parses
and validates; what xgrammar cannot enforce is refused by keyword; grammars are compiled once; the matcher follows
its request through chunked prefill, preemption and stop strings; rows without a grammar are not touched."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from _support.checkpoints import tiny_spec

from loraplex.engine import LLM, SamplingParams, StructuredOutputsParams
from loraplex.engine.core.structured_output import GrammarState, unpack
from loraplex.engine.errors import RequestError
from loraplex.engine.tools.demo import write_random_model

pytestmark = pytest.mark.unit

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "scores": {"type": "array", "items": {"type": "number", "minimum": -1.5, "maximum": 2.5}, "minItems": 1,
                       "maxItems": 4},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
        },
        "required": ["scores", "pair"],
    },
    "enums_and_optional": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["color"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"type": "string", "maxLength": 3},
                                {"type": "null"}]},
        },
        "required": ["value"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-C]{2}-[0-9]{3}$"}, "id": {"type": "string",
                                                                                          "format": "uuid"}},
        "required": ["code", "id"],
    },
    "refs": {
        "$defs": {"item": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                           "required": ["n"]}},
        "type": "array",
        "items": {"$ref": "#/$defs/item"},
        "minItems": 2,
        "maxItems": 3,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = write_random_model(tmp_path_factory.mktemp("model") / "tiny", tiny_spec(max_position_embeddings=512))
    return LLM(path, device="cpu", dtype="float32", max_num_batched_tokens=256)


def constrained(spec: StructuredOutputsParams, seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=seed, max_tokens=kw.pop("max_tokens", 200), structured_outputs=spec, **kw
    )


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    params = [constrained(StructuredOutputsParams(json=schema), seed) for seed in range(12)]
    for output in llm.generate(["Hello"] * len(params), params):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_choice_and_regex(llm: LLM) -> None:
    outs = llm.generate(
        ["a"] * 8, [constrained(StructuredOutputsParams(json_object=True), s, max_tokens=300) for s in range(8)]
    )
    finished = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished  # a random model under "any object" does finish now and then; those that do are objects
    assert all(isinstance(json.loads(c.text), dict) for c in finished)
    choices = ["yes", "no", "maybe so"]
    outs = llm.generate(["a"] * 8, [constrained(StructuredOutputsParams(choice=choices), s) for s in range(8)])
    assert {o.outputs[0].text for o in outs} <= set(choices)
    outs = llm.generate(
        ["a"] * 8, [constrained(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,3}"), s) for s in range(8)]
    )
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        head, _, tail = o.outputs[0].text.partition("-")
        assert head.isdigit() and len(head) == 3 and tail.isalpha() and 2 <= len(tail) <= 3
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    for o in llm.generate(["a"] * 4, [constrained(StructuredOutputsParams(grammar=grammar), s) for s in range(4)]):
        text = o.outputs[0].text
        assert o.outputs[0].finish_reason in ("stop", "length")
        assert text.startswith("(") and all(c in "()+123456789" for c in text)


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"not": {"type": "integer"}}, "not"),
        ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if"),
        ({"type": "array", "contains": {"const": 1}}, "contains"),
        ({"type": "object", "minProperties": 1}, "minProperties"),
        ({"type": "object", "properties": {"a": {"type": "string", "format": "email", "maxLength": 9}}}, "maxLength"),
        ({"type": "string", "format": "credit-card"}, "format"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "string", "format": ["email"]}, "format"),
    ],
)
def test_keywords_it_cannot_enforce_are_refused_by_name(llm: LLM, schema: dict[str, Any], keyword: str) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, param="response_format"))
    with pytest.raises(RequestError) as caught:
        llm.engine.check_request([1, 2], params)
    assert caught.value.param == "response_format"
    assert f"'{keyword}'" in str(caught.value)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputsParams(regex="[0-9"),
        StructuredOutputsParams(grammar="root ::= missing_rule"),
        StructuredOutputsParams(json={"type": "no-such-type"}),
    ],
)
def test_specs_that_do_not_compile_are_request_errors(llm: LLM, spec: StructuredOutputsParams) -> None:
    with pytest.raises(RequestError) as caught:
        llm.engine.check_request([1, 2], SamplingParams(structured_outputs=spec))
    assert caught.value.param == "structured_outputs"
    assert "cannot be compiled" in str(caught.value)


def test_a_schema_nested_too_deep_is_refused_before_it_is_compiled(llm: LLM) -> None:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    with pytest.raises(RequestError, match="nests deeper"):
        llm.engine.check_request([1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))


def test_specs_need_exactly_one_form() -> None:
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(RequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_grammars_are_compiled_once_and_the_cache_is_bounded(tmp_path: Path) -> None:
    llm = LLM(write_random_model(tmp_path / "m", tiny_spec()), device="cpu", dtype="float32")
    compiler = llm.engine.grammars
    compiler.max_entries = 2
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for _ in range(3):
        llm.engine.check_request([1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    # The same schema as text, spaced otherwise, is the same grammar.
    llm.engine.check_request(
        [1], SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(schema, indent=2)))
    )
    assert (compiler.stats.misses, compiler.stats.hits) == (1, 3)
    for regex in ("a+", "b+", "c+"):
        llm.engine.check_request([1], SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex)))
    assert compiler.num_cached == 2
    llm.engine.check_request([1], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    assert compiler.stats.misses == 5  # evicted by the regexes, compiled again


def test_grammar_survives_chunked_prefill_and_preemption(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m", tiny_spec(max_position_embeddings=512))
    page_bytes = 2 * 2 * 2 * 16 * 16 * 4  # layers x (K, V) x kv_heads x block x head_dim x float32
    llm = LLM(path, device="cpu", dtype="float32", kv_budget=40 * page_bytes, max_num_batched_tokens=32,
              max_model_len=512)  # fmt: skip
    schema = SCHEMAS["nested"]
    prompts = [[(7 * i + j) % 400 + 2 for j in range(60 + 5 * i)] for i in range(10)]
    params = [constrained(StructuredOutputsParams(json=schema), seed, ignore_eos=True) for seed in range(10)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_stop_string_inside_the_grammar_cuts_the_answer(llm: LLM) -> None:
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    [out] = llm.generate(["Hello"], [constrained(spec, 3, stop=['"age"'])])
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == '"age"'
    assert out.outputs[0].text.startswith('{"user": {"name": "')


def test_rows_without_a_grammar_are_not_touched(llm: LLM) -> None:
    free = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    [alone] = llm.generate(["Hello there"], [free])
    spec = StructuredOutputsParams(json=SCHEMAS["arrays"])
    mixed = llm.generate(["Hello there", "Hello", "Hi"], [free, constrained(spec, 1), constrained(spec, 2)])
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for o in mixed[1:]:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["arrays"])


def test_masks_ahead_follow_a_proposal_and_leave_the_matcher_where_it_was(llm: LLM) -> None:
    """A speculating row's masks (GrammarState.fill_ahead): row j is the mask after the first j proposed tokens, as a
    matcher that accepted them gives it; past a token the grammar refuses, rows repeat the last mask; the matcher is
    rolled back to where it was."""
    import xgrammar

    spec = StructuredOutputsParams(json=SCHEMAS["arrays"])
    [answer] = llm.generate(["Hello"], [constrained(spec, 3)])
    tokens = list(answer.outputs[0].token_ids)[:5]
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    compiled = engine.grammars.compile(spec)

    reference = GrammarState(compiled, vocab)
    expected = xgrammar.allocate_token_bitmask(len(tokens) + 1, vocab)
    for j, token in enumerate([*tokens, None]):
        reference.fill(expected, j)
        if token is not None:
            assert reference.accept(token)

    state = GrammarState(compiled, vocab)
    ahead = xgrammar.allocate_token_bitmask(len(tokens) + 1, vocab)
    state.fill_ahead(ahead, 0, tokens)
    assert torch.equal(ahead, expected)
    # Rolled back: the next mask is the first one again, and the same walk gives the same masks.
    again = xgrammar.allocate_token_bitmask(len(tokens) + 1, vocab)
    state.fill_ahead(again, 0, tokens)
    assert torch.equal(again, expected)

    refused = next(t for t in range(vocab) if not bool(unpack(expected[1], vocab)[t]))
    cut = xgrammar.allocate_token_bitmask(4, vocab)
    state.fill_ahead(cut, 0, [tokens[0], refused, tokens[2]])
    assert torch.equal(cut[:2], expected[:2])
    assert torch.equal(cut[2], expected[1]) and torch.equal(cut[3], expected[1])
