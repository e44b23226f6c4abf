"""Reasoning fields of tenant chat requests, without services: what the strict schema takes (`reasoning_effort`,
`chat_template_kwargs`, `thinking_token_budget`), the engine request `engine_body` builds from them (the base model's
per-tier budgets always sent to a reasoning model, never a budget to another), and the usage tally's reasoning
tokens. The same rules through HTTP, the SDK and a real engine: test_completions_reasoning.py."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from pydantic import ValidationError

from loraplex.engine import REASONING_EFFORTS, ReasoningConfig
from loraplex.platform.domain.base_models.models import BaseModel
from loraplex.platform.domain.completions.schemas import (
    RESERVED_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    CompletionRequest,
    ReasoningEffort,
)
from loraplex.platform.domain.completions.service import Target, UsageTally, engine_body
from loraplex.platform.errors import ApiError

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]
BUDGETS = {"none": 0, "minimal": 8, "low": 16, "medium": 48, "high": 128}
THINKER = ReasoningConfig(parser="qwen3", budgets=BUDGETS, default_effort="low")


def chat(**fields: Any) -> ChatCompletionRequest:
    """A request as the app validates it (strictly)."""
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields}, strict=True)


def target(reasoning: ReasoningConfig | dict[str, Any] | None) -> Target:
    row = BaseModel(name="base", source="/models/base")
    if isinstance(reasoning, dict):
        row.reasoning_config = reasoning  # as stored, valid or not
    else:
        row.set_reasoning(reasoning)
    return Target(model="m", base_model=row)


def body_for(reasoning: ReasoningConfig | dict[str, Any] | None, request: Any) -> dict[str, Any]:
    return engine_body(target(reasoning), request, None, cache_salt="salt")


class TestSchema:
    def test_the_tiers_are_the_engines(self) -> None:
        assert get_args(ReasoningEffort) == REASONING_EFFORTS

    @pytest.mark.parametrize("effort", REASONING_EFFORTS)
    def test_each_tier_is_taken(self, effort: str) -> None:
        assert chat(reasoning_effort=effort).reasoning_effort == effort

    @pytest.mark.parametrize("effort", ["max", "", "HIGH", 3, None])
    def test_anything_else_is_refused(self, effort: Any) -> None:
        if effort is None:
            assert chat(reasoning_effort=None).reasoning_effort is None
            return
        with pytest.raises(ValidationError) as raised:
            chat(reasoning_effort=effort)
        assert raised.value.errors()[0]["loc"] == ("reasoning_effort",)

    @pytest.mark.parametrize("budget", [0, 1, 1_000_000])
    def test_a_budget_from_0_to_a_million(self, budget: int) -> None:
        assert chat(thinking_token_budget=budget).thinking_token_budget == budget

    @pytest.mark.parametrize("budget", [-1, 1_000_001, 2.0, "16", True])
    def test_other_budgets_are_refused(self, budget: Any) -> None:
        with pytest.raises(ValidationError) as raised:
            chat(thinking_token_budget=budget)
        assert raised.value.errors()[0]["loc"][0] == "thinking_token_budget"

    def test_template_kwargs_of_json_scalars_are_taken(self) -> None:
        kwargs = {"enable_thinking": False, "style": "brief", "depth": 2, "temperature_hint": 0.5, "_x": None}
        assert chat(chat_template_kwargs=kwargs).chat_template_kwargs == kwargs
        assert chat(chat_template_kwargs={}).chat_template_kwargs == {}

    @pytest.mark.parametrize(
        ("kwargs", "fragment"),
        [
            ({f"k{i}": 1 for i in range(17)}, "at most 16 variables"),
            ({"not a name": 1}, "is not a variable name"),
            ({"1st": 1}, "is not a variable name"),
            ({"x" * 65: 1}, "is not a variable name"),
            ({"nested": {"a": 1}}, "values are strings, numbers, booleans or null"),
            ({"listed": [1, 2]}, "values are strings, numbers, booleans or null"),
            ({"long": "x" * 1001}, "at most 1000 characters"),
            ({"huge": 2**63}, "fit in 64 bits"),
            ({"ratio": float("inf")}, "finite"),
            ("enable_thinking=false", "dict"),
        ],
    )
    def test_template_kwargs_out_of_bounds_are_refused(self, kwargs: Any, fragment: str) -> None:
        with pytest.raises(ValidationError, match=fragment) as raised:
            chat(chat_template_kwargs=kwargs)
        assert raised.value.errors()[0]["loc"] == ("chat_template_kwargs",)

    @pytest.mark.parametrize("name", sorted(RESERVED_TEMPLATE_KWARGS))
    def test_variables_the_request_or_tokenizer_set_are_refused(self, name: str) -> None:
        with pytest.raises(ValidationError, match=f"{name} is set by the request or the tokenizer"):
            chat(chat_template_kwargs={"enable_thinking": True, name: "x"})

    def test_legacy_completions_take_none_of_them(self) -> None:
        for field, value in (("reasoning_effort", "low"), ("thinking_token_budget", 4), ("chat_template_kwargs", {})):
            with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
                CompletionRequest.model_validate({"model": "m", "prompt": "hi", field: value}, strict=True)


class TestEngineBody:
    @pytest.mark.parametrize("effort", REASONING_EFFORTS)
    def test_a_reasoning_model_gets_its_records_budget_for_the_tier(self, effort: str) -> None:
        sent = body_for(THINKER, chat(reasoning_effort=effort))
        assert sent["thinking_token_budget"] == BUDGETS[effort]
        assert sent["reasoning_effort"] == effort  # and the template still hears the tier

    def test_without_a_tier_the_records_default_tier(self) -> None:
        assert body_for(THINKER, chat())["thinking_token_budget"] == BUDGETS["low"]
        medium = ReasoningConfig(parser="deepseek_r1", budgets=BUDGETS)  # default_effort left to its default
        assert body_for(medium, chat())["thinking_token_budget"] == BUDGETS["medium"]
        assert "reasoning_effort" not in body_for(THINKER, chat())

    @pytest.mark.parametrize("budget", [0, 5, 999_999])
    def test_the_tenants_own_budget_wins_over_the_tier(self, budget: int) -> None:
        sent = body_for(THINKER, chat(reasoning_effort="high", thinking_token_budget=budget))
        assert sent["thinking_token_budget"] == budget

    def test_a_model_without_reasoning_gets_the_template_hints_and_no_budget(self) -> None:
        kwargs = {"enable_thinking": False}
        sent = body_for(None, chat(reasoning_effort="high", chat_template_kwargs=kwargs))
        assert "thinking_token_budget" not in sent
        assert (sent["reasoning_effort"], sent["chat_template_kwargs"]) == ("high", kwargs)
        assert "thinking_token_budget" not in body_for(None, chat())

    def test_a_budget_for_a_model_without_reasoning_is_a_400(self) -> None:
        with pytest.raises(ApiError) as raised:
            body_for(None, chat(thinking_token_budget=16))
        error = raised.value
        assert (error.status_code, error.param, error.code) == (400, "thinking_token_budget", "unsupported_parameter")
        assert "this model has no reasoning parser" in error.message

    def test_template_kwargs_go_to_a_reasoning_model_too(self) -> None:
        sent = body_for(THINKER, chat(chat_template_kwargs={"enable_thinking": False}))
        assert sent["chat_template_kwargs"] == {"enable_thinking": False}
        assert sent["thinking_token_budget"] == BUDGETS["low"]

    def test_legacy_completions_get_no_budget(self) -> None:
        request = CompletionRequest.model_validate({"model": "m", "prompt": "hi"}, strict=True)
        assert "thinking_token_budget" not in body_for(THINKER, request)

    def test_a_stored_config_the_engine_no_longer_takes_is_our_error_not_the_tenants(self) -> None:
        with pytest.raises(ApiError) as raised:
            body_for({"parser": "retired-parser"}, chat())
        assert (raised.value.status_code, raised.value.code) == (500, "reasoning_config_invalid")


class TestUsageTally:
    def test_reasoning_tokens_come_from_the_running_usage(self) -> None:
        tally = UsageTally()
        tally.take({"prompt_tokens": 10, "completion_tokens": 3, "completion_tokens_details": {"reasoning_tokens": 3}})
        tally.take({"prompt_tokens": 10, "completion_tokens": 7, "completion_tokens_details": {"reasoning_tokens": 5}})
        tally.take({"prompt_tokens": 10, "completion_tokens": 9})  # a usage without details keeps what was counted
        assert (tally.completion_tokens, tally.reasoning_tokens) == (9, 5)
        assert tally.usage() == {
            "prompt_tokens": 10,
            "completion_tokens": 9,
            "total_tokens": 19,
            "prompt_tokens_details": {"cached_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 5},
        }

    def test_reasoning_tokens_never_exceed_completion_tokens(self) -> None:
        tally = UsageTally()
        tally.take({"prompt_tokens": 1, "completion_tokens": 2, "completion_tokens_details": {"reasoning_tokens": 4}})
        assert tally.reasoning_tokens == 2  # an engine's miscount must not make a usage row the recorder refuses
