"""SamplingParams: vLLM's defaults and shapes, and a RequestError naming the field for every bad value."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from loraplex.engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from loraplex.engine.errors import EngineError, RequestError

pytestmark = pytest.mark.unit


def _noop(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return logits


class TestDefaults:
    def test_match_vllm(self) -> None:
        params = SamplingParams()
        assert params.n == 1
        assert params.temperature == 1.0
        assert params.top_p == 1.0
        assert params.top_k == 0
        assert params.min_p == 0.0
        assert params.seed is None
        assert params.stop == ()
        assert params.stop_token_ids == ()
        assert params.max_tokens == 16
        assert params.min_tokens == 0
        assert params.ignore_eos is False
        assert params.logprobs is None
        assert params.skip_special_tokens is True
        assert params.include_stop_str_in_output is False
        assert params.logits_processors == ()
        assert not params.is_greedy

    def test_max_logprobs_is_openais_limit(self) -> None:
        assert MAX_LOGPROBS == 20


class TestNormalization:
    def test_a_single_stop_string_becomes_a_tuple(self) -> None:
        assert SamplingParams(stop="\n\n").stop == ("\n\n",)

    def test_stop_list_keeps_its_order(self) -> None:
        assert SamplingParams(stop=["b", "a"]).stop == ("b", "a")

    def test_stop_token_ids_become_a_tuple(self) -> None:
        assert SamplingParams(stop_token_ids=[7, 3]).stop_token_ids == (7, 3)

    def test_logits_processors_become_a_tuple(self) -> None:
        assert SamplingParams(logits_processors=[_noop]).logits_processors == (_noop,)

    def test_integral_floats_are_stored_as_float(self) -> None:
        params = SamplingParams(temperature=1, top_p=1, min_p=0)
        assert isinstance(params.temperature, float)
        assert isinstance(params.top_p, float)
        assert isinstance(params.min_p, float)


class TestIsGreedy:
    @pytest.mark.parametrize("temperature", [0.0, 0, 1e-6])
    def test_zero_or_tiny_temperature_is_greedy_whatever_else_is_set(self, temperature: float) -> None:
        assert SamplingParams(temperature=temperature, top_k=5, top_p=0.5, min_p=0.2, seed=3).is_greedy

    @pytest.mark.parametrize("temperature", [1e-5, 0.01, 1.0, 2.0, 100.0])
    def test_positive_temperature_samples(self, temperature: float) -> None:
        assert not SamplingParams(temperature=temperature).is_greedy


class TestAcceptedValues:
    @pytest.mark.parametrize(
        "kwargs",
        [
            {"top_p": 1.0},
            {"top_p": 1e-9},
            {"top_k": -1},
            {"top_k": 0},
            {"top_k": 1},
            {"min_p": 0.0},
            {"min_p": 1.0},
            {"logprobs": 0},
            {"logprobs": MAX_LOGPROBS},
            {"seed": 0},
            {"seed": -(2**63)},
            {"seed": 2**64 - 1},
            {"max_tokens": None},
            {"max_tokens": 1},
            {"min_tokens": 5, "max_tokens": 5},
            {"min_tokens": 100, "max_tokens": None},
            {"stop": []},
            {"stop_token_ids": []},
            {"stop_token_ids": [0]},
        ],
    )
    def test_boundary_values_are_valid(self, kwargs: dict[str, Any]) -> None:
        params = SamplingParams(**kwargs)
        for name, value in kwargs.items():
            stored = getattr(params, name)
            assert stored == (tuple(value) if isinstance(value, list) else value)

    def test_seed_range_is_what_torch_accepts(self) -> None:
        for seed in (-(2**63), 2**64 - 1):
            torch.Generator().manual_seed(SamplingParams(seed=seed).seed or 0)


INVALID: list[tuple[str, Any]] = [
    ("n", 129),
    ("n", 0),
    ("n", True),
    ("n", 1.0),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "42"),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", "12"),
    ("stop_token_ids", 12),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.0),
    ("min_tokens", -1),
    ("min_tokens", 1.0),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("logprobs", True),
    ("skip_special_tokens", None),
    ("include_stop_str_in_output", 0),
    ("logits_processors", [1]),
    ("logits_processors", "f"),
    ("logits_processors", _noop),
]


class TestInvalidValues:
    @pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
    def test_raises_request_error_naming_the_field(self, field: str, value: Any) -> None:
        with pytest.raises(RequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field
        assert field in str(info.value)
        assert info.value.code is not None

    def test_min_tokens_above_max_tokens_names_min_tokens(self) -> None:
        with pytest.raises(RequestError, match=r"min_tokens \(9\).*max_tokens \(8\)") as info:
            SamplingParams(min_tokens=9, max_tokens=8)
        assert info.value.param == "min_tokens"

    def test_n_choices_each_get_their_own_seed_stream(self) -> None:
        params = SamplingParams(n=3, seed=10, temperature=0.5)
        assert [(c.n, c.seed, c.temperature) for c in map(params.choice, range(3))] == [
            (1, 10, 0.5),
            (1, 11, 0.5),
            (1, 12, 0.5),
        ]
        assert SamplingParams(n=2).choice(1).seed is None
        assert SamplingParams(n=2, seed=2**64 - 1).choice(1).seed == -(2**63)  # wraps within the accepted range
        with pytest.raises(ValueError, match="choice 3"):
            params.choice(3)

    def test_request_error_is_a_value_error_and_an_engine_error(self) -> None:
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(top_p=0)
        with pytest.raises(EngineError):
            SamplingParams(top_p=0)


class TestImmutability:
    def test_fields_cannot_be_assigned(self) -> None:
        params = SamplingParams()
        with pytest.raises(dataclasses.FrozenInstanceError):
            params.temperature = -1.0  # type: ignore[misc]

    def test_replace_validates_again(self) -> None:
        params = SamplingParams(stop="x", stop_token_ids=[2], logits_processors=[_noop])
        changed = dataclasses.replace(params, temperature=0.5)
        assert changed.temperature == 0.5
        assert changed.stop == ("x",)
        assert changed.stop_token_ids == (2,)
        assert changed.logits_processors == (_noop,)
        with pytest.raises(RequestError) as info:
            dataclasses.replace(params, top_k=-5)
        assert info.value.param == "top_k"

    def test_equal_params_compare_and_hash_equal(self) -> None:
        assert SamplingParams(stop="a", seed=1) == SamplingParams(stop=["a"], seed=1)
        assert hash(SamplingParams(stop="a")) == hash(SamplingParams(stop=("a",)))
